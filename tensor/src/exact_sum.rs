//! [`ExactSum`]: a sum of f64 values that does not depend on the order they are added in, or on
//! how they were split between partial sums before being merged.
//!
//! Every finite f64 is an integer multiple of 2⁻¹⁰⁷⁴, below 2¹⁰²⁴. The accumulator keeps the
//! positive and the negative values apart, each as one big fixed-point integer in units of
//! 2⁻¹⁰⁷⁴, stored as limbs of 32 bits in `i64` words (so a word takes 2³¹ additions before it
//! must carry). Integer addition is associative, so every order and every partition of the
//! values gives the same integers; [`ExactSum::value`] rounds them to f64 once (their difference
//! rounded to nearest once).
//!
//! Reference mode uses it for gradient norms: a norm computed over one device's whole gradients,
//! over ZeRO shards that cut a parameter anywhere, or over tensor-parallel pieces gives the same
//! bits. Partial sums travel between ranks as [`ExactSum::to_words`]: f64 values holding
//! integers below 2³² that any all-reduce adds exactly (up to 2²⁰ ranks).
//!
//! ```
//! use meshgrad_tensor::exact_sum::ExactSum;
//! let mut a = ExactSum::new();
//! a.add(1e300);
//! a.add(1.0);
//! a.add(-1e300);
//! assert_eq!(a.value(), 1.0); // a plain f64 sum gives 0
//! ```

use crate::{DType, Result, Tensor};

/// Bits per limb.
const LIMB_BITS: u32 = 32;
/// Limbs of one fixed-point integer: 2⁻¹⁰⁷⁴ to 2¹⁰²⁴ is 2098 bits, plus 64 bits of headroom
/// for the count of additions.
const LIMBS: usize = 68;
/// Additions a word takes before carries must be propagated (each adds below 2³²).
const CARRY_EVERY: u32 = 1 << 30;

/// An order-independent sum of f64 values (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExactSum {
    /// Sums of the positive and of the negative values' magnitudes, in units of 2⁻¹⁰⁷⁴.
    pos: Vec<i64>,
    neg: Vec<i64>,
    /// Additions since the last carry propagation.
    pending: u32,
    /// Counts of NaN, +inf and -inf values added.
    nan: u64,
    pos_inf: u64,
    neg_inf: u64,
}

impl Default for ExactSum {
    fn default() -> Self {
        Self::new()
    }
}

impl ExactSum {
    /// Words in [`ExactSum::to_words`].
    pub const WORDS: usize = 2 * LIMBS + 3;

    /// Zero.
    pub fn new() -> Self {
        ExactSum {
            pos: vec![0; LIMBS],
            neg: vec![0; LIMBS],
            pending: 0,
            nan: 0,
            pos_inf: 0,
            neg_inf: 0,
        }
    }

    /// Adds `x`.
    pub fn add(&mut self, x: f64) {
        if x.is_nan() {
            self.nan += 1;
            return;
        }
        if x.is_infinite() {
            if x > 0.0 {
                self.pos_inf += 1;
            } else {
                self.neg_inf += 1;
            }
            return;
        }
        if x == 0.0 {
            return;
        }
        let bits = x.to_bits();
        let exp = ((bits >> 52) & 0x7ff) as u32;
        let frac = bits & ((1u64 << 52) - 1);
        // x = mant · 2^(shift - 1074) with mant < 2^53.
        let (mant, shift) = if exp == 0 {
            (frac, 0)
        } else {
            (frac | (1u64 << 52), exp - 1)
        };
        let acc = if x > 0.0 {
            &mut self.pos
        } else {
            &mut self.neg
        };
        let limb = (shift / LIMB_BITS) as usize;
        let off = shift % LIMB_BITS;
        // mant << off spans at most 53 + 31 = 84 bits: three limbs.
        let wide = u128::from(mant) << off;
        for k in 0..3 {
            let part = ((wide >> (LIMB_BITS as usize * k)) & 0xffff_ffff) as i64;
            if part != 0 {
                acc[limb + k] += part;
            }
        }
        self.pending += 1;
        if self.pending >= CARRY_EVERY {
            self.normalize();
        }
    }

    /// Adds every value of `values`.
    pub fn add_all(&mut self, values: impl IntoIterator<Item = f64>) {
        for v in values {
            self.add(v);
        }
    }

    /// Adds the square of every element of `t` (computed in f64: exact for f32, bf16 and f16
    /// values, rounded once for f64 ones). Chunks of the elements are summed on the rayon
    /// threads and merged: the sum is exact, so neither the chunks nor the threads change it.
    pub fn add_squares(&mut self, t: &Tensor) -> Result<()> {
        use rayon::prelude::*;
        /// Elements per parallel chunk.
        const CHUNK: usize = 1 << 15;
        fn squares<T: Copy + Into<f64> + Sync>(values: &[T]) -> Vec<ExactSum> {
            values
                .par_chunks(CHUNK)
                .map(|c| {
                    let mut s = ExactSum::new();
                    for &x in c {
                        let x: f64 = x.into();
                        s.add(x * x);
                    }
                    s
                })
                .collect()
        }
        let parts = match t.dtype() {
            DType::F32 => squares(&t.to_vec::<f32>()?),
            _ => squares(&t.to_dtype(DType::F64)?.to_vec::<f64>()?),
        };
        for p in &parts {
            self.merge(p);
        }
        Ok(())
    }

    /// Adds the values another accumulator holds.
    pub fn merge(&mut self, other: &ExactSum) {
        let mut o = other.clone();
        o.normalize();
        self.normalize();
        for (a, b) in self.pos.iter_mut().zip(&o.pos) {
            *a += b;
        }
        for (a, b) in self.neg.iter_mut().zip(&o.neg) {
            *a += b;
        }
        self.nan += o.nan;
        self.pos_inf += o.pos_inf;
        self.neg_inf += o.neg_inf;
        self.normalize();
    }

    /// Propagates carries so every limb is below 2³².
    fn normalize(&mut self) {
        for acc in [&mut self.pos, &mut self.neg] {
            let mut carry = 0i64;
            for w in acc.iter_mut() {
                let v = *w + carry;
                *w = v & 0xffff_ffff;
                carry = v >> LIMB_BITS;
            }
            debug_assert_eq!(carry, 0, "exact sum overflowed its headroom");
        }
        self.pending = 0;
    }

    /// The sum rounded to f64: NaN if a NaN (or both infinities) was added, an infinity if one
    /// was, otherwise the exact sum rounded to nearest.
    pub fn value(&self) -> f64 {
        if self.nan > 0 || (self.pos_inf > 0 && self.neg_inf > 0) {
            return f64::NAN;
        }
        if self.pos_inf > 0 {
            return f64::INFINITY;
        }
        if self.neg_inf > 0 {
            return f64::NEG_INFINITY;
        }
        let mut s = self.clone();
        s.normalize();
        // Subtract the smaller magnitude from the larger (limbs compared from the top), then
        // round once.
        let pos_larger = s.pos.iter().rev().cmp(s.neg.iter().rev()) != std::cmp::Ordering::Less;
        let (big, small) = if pos_larger {
            (&s.pos, &s.neg)
        } else {
            (&s.neg, &s.pos)
        };
        let mut diff = vec![0i64; LIMBS];
        let mut borrow = 0i64;
        for k in 0..LIMBS {
            let mut v = big[k] - small[k] - borrow;
            borrow = 0;
            if v < 0 {
                v += 1 << LIMB_BITS;
                borrow = 1;
            }
            diff[k] = v;
        }
        let m = round_magnitude(&diff);
        if pos_larger {
            m
        } else {
            -m
        }
    }

    /// The state as f64 words (integers below 2³², exactly representable), for an all-reduce:
    /// the sum of several accumulators' words, element by element, in any order, is the words
    /// of their merged sum (see [`ExactSum::from_words`]).
    pub fn to_words(&self) -> Vec<f64> {
        let mut s = self.clone();
        s.normalize();
        let mut w: Vec<f64> = s.pos.iter().chain(&s.neg).map(|&x| x as f64).collect();
        w.extend([s.nan as f64, s.pos_inf as f64, s.neg_inf as f64]);
        w
    }

    /// The accumulator whose words (possibly summed over several accumulators) are `words`.
    pub fn from_words(words: &[f64]) -> Result<ExactSum> {
        if words.len() != Self::WORDS {
            crate::bail!("exact sum: {} words, expected {}", words.len(), Self::WORDS);
        }
        if words
            .iter()
            .any(|w| !w.is_finite() || *w < 0.0 || w.fract() != 0.0)
        {
            crate::bail!("exact sum: the words must be non-negative integers");
        }
        let mut s = ExactSum::new();
        for (k, w) in words[..LIMBS].iter().enumerate() {
            s.pos[k] = *w as i64;
        }
        for (k, w) in words[LIMBS..2 * LIMBS].iter().enumerate() {
            s.neg[k] = *w as i64;
        }
        s.nan = words[2 * LIMBS] as u64;
        s.pos_inf = words[2 * LIMBS + 1] as u64;
        s.neg_inf = words[2 * LIMBS + 2] as u64;
        s.normalize();
        Ok(s)
    }
}

/// The normalized fixed-point magnitude `limbs` (units of 2⁻¹⁰⁷⁴) rounded to the nearest f64.
fn round_magnitude(limbs: &[i64]) -> f64 {
    let Some(top) = limbs.iter().rposition(|&w| w != 0) else {
        return 0.0;
    };
    // The top three limbs hold at least 65 significant bits; a sticky bit for anything below
    // makes the one rounding of u128 -> f64 correct.
    let lo = top.saturating_sub(2);
    let mut m: u128 = 0;
    for k in (lo..=top).rev() {
        m = (m << LIMB_BITS) | limbs[k] as u128;
    }
    if limbs[..lo].iter().any(|&w| w != 0) {
        m |= 1;
    }
    // value = m · 2^(32·lo − 1074); scale in steps that stay exact (powers of two).
    let mut v = m as f64;
    let mut e = LIMB_BITS as i32 * lo as i32 - 1074;
    while e > 0 {
        let step = e.min(1000);
        v *= 2f64.powi(step);
        e -= step;
    }
    while e < 0 {
        let step = (-e).min(1000);
        v *= 2f64.powi(-step);
        e += step;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator of awkward f64 values.
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let m = ((s >> 11) as f64) / (1u64 << 53) as f64 - 0.5;
                let e = ((s >> 3) % 120) as i32 - 60;
                m * 2f64.powi(e)
            })
            .collect()
    }

    #[test]
    fn order_and_partition_do_not_change_the_bits() {
        let v = values(5000, 7);
        let mut whole = ExactSum::new();
        whole.add_all(v.iter().copied());
        let mut rev = ExactSum::new();
        rev.add_all(v.iter().rev().copied());
        assert_eq!(whole.value().to_bits(), rev.value().to_bits());
        for parts in [2, 3, 7] {
            let mut merged = ExactSum::new();
            let mut words = vec![0f64; ExactSum::WORDS];
            for chunk in v.chunks(v.len().div_ceil(parts)) {
                let mut p = ExactSum::new();
                p.add_all(chunk.iter().copied());
                merged.merge(&p);
                for (w, x) in words.iter_mut().zip(p.to_words()) {
                    *w += x;
                }
            }
            assert_eq!(merged.value().to_bits(), whole.value().to_bits());
            let via_words = ExactSum::from_words(&words).unwrap();
            assert_eq!(via_words.value().to_bits(), whole.value().to_bits());
        }
    }

    #[test]
    fn matches_a_correctly_rounded_reference() {
        // Values that are integers times 2^-40 with small magnitude sum exactly in i128.
        let v: Vec<f64> = values(3000, 11)
            .into_iter()
            .map(|x| (x * 2f64.powi(20)).round() * 2f64.powi(-40))
            .collect();
        let exact: i128 = v.iter().map(|x| (x * 2f64.powi(40)) as i128).sum();
        let reference = exact as f64 * 2f64.powi(-40);
        let mut s = ExactSum::new();
        s.add_all(v);
        assert_eq!(s.value(), reference);
        let mut c = ExactSum::new();
        c.add_all([1e300, 1.0, -1e300, 2f64.powi(-1074), f64::MAX, -f64::MAX]);
        assert_eq!(c.value(), 1.0);
        let mut sub = ExactSum::new();
        sub.add_all([2f64.powi(-1074); 3]);
        assert_eq!(sub.value(), 3.0 * 2f64.powi(-1074));
    }

    #[test]
    fn specials_and_bad_words() {
        let mut s = ExactSum::new();
        s.add(f64::INFINITY);
        assert_eq!(s.value(), f64::INFINITY);
        s.add(f64::NEG_INFINITY);
        assert!(s.value().is_nan());
        let mut t = ExactSum::new();
        t.add(f64::NAN);
        assert!(t.value().is_nan());
        assert!(ExactSum::from_words(&[0.0; 3]).is_err());
        assert!(ExactSum::from_words(&vec![0.5; ExactSum::WORDS]).is_err());
    }

    #[test]
    fn squares_of_a_tensor() {
        let t = Tensor::from_vec(vec![3f32, -4.0], 2, crate::Device::Cpu).unwrap();
        let mut s = ExactSum::new();
        s.add_squares(&t).unwrap();
        assert_eq!(s.value(), 25.0);
    }

    /// A tensor of several parallel chunks (f32 and f64) gives the words of one sequential
    /// pass over its squares, and the f32 result is within rounding of a plain f64 sum.
    #[test]
    fn squares_in_parallel_chunks_equal_one_pass() {
        let n = 5 * (1 << 15) + 123;
        for dtype in [DType::F32, DType::F64] {
            let t = crate::Random::new(3)
                .dtype(dtype)
                .normal(vec![n], 0.0, 1.0)
                .unwrap();
            let mut chunked = ExactSum::new();
            chunked.add_squares(&t).unwrap();
            let v = t.to_vec_f64().unwrap();
            let mut one = ExactSum::new();
            one.add_all(v.iter().map(|x| x * x));
            assert_eq!(chunked.to_words(), one.to_words(), "{dtype}");
            let plain: f64 = v.iter().map(|x| x * x).sum();
            assert!((chunked.value() - plain).abs() <= 1e-9 * plain, "{dtype}");
        }
    }
}
