//! Counter-based random numbers (Philox4x32-10): every value is a pure function of
//! `(seed, global element index)`, so it never depends on how a tensor is sharded or on the order
//! in which elements are generated.
//!
//! Element `i` of stream `seed` uses the Philox block with counter `[lo32(i), hi32(i), 0, 0]` and
//! key `[lo32(seed), hi32(seed)]`, giving four 32-bit words `w0..w3`:
//! - uniform: `(w0 >> 8) · 2^-24`, in `[0, 1)` with 24 random bits (exact in f32);
//! - normal (Box-Muller, computed in f64): `u1 = (w0 + 1) · 2^-32` in `(0, 1]` (so `ln u1` is
//!   finite), `u2 = w1 · 2^-32` in `[0, 1)`, `n = sqrt(-2 ln u1) · cos(2π u2)`; `|n|` is at most
//!   `sqrt(64 ln 2) ≈ 6.66`.
//!
//! - integer in `[low, high)`: with `x = w1 · 2^32 + w0` (64 random bits) and `n = high - low`,
//!   `low + floor(x · n / 2^64)` (a multiply-shift, no rejection; the bias is below `n / 2^64`).
//!
//! Words `w2`, `w3` are unused. Large fills run in parallel chunks; the values do not depend on
//! the split.

use rayon::prelude::*;

use crate::cpu::vecops::simd;
use crate::Float;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Fills of at least this many elements run in parallel.
const PAR_FILL: usize = 16 * 1024;

/// One Philox4x32 round.
#[inline(always)]
fn round(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let p0 = u64::from(M0) * u64::from(ctr[0]);
    let p1 = u64::from(M1) * u64::from(ctr[2]);
    [
        ((p1 >> 32) as u32) ^ ctr[1] ^ key[0],
        p1 as u32,
        ((p0 >> 32) as u32) ^ ctr[3] ^ key[1],
        p0 as u32,
    ]
}

/// The Philox4x32 block function with 10 rounds (Salmon et al., SC'11).
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut ctr = counter;
    let mut key = key;
    for r in 0..10 {
        if r > 0 {
            key = [key[0].wrapping_add(W0), key[1].wrapping_add(W1)];
        }
        ctr = round(ctr, key);
    }
    ctr
}

/// The Philox block of element `index` in stream `seed`.
#[inline]
fn block(seed: u64, index: u64) -> [u32; 4] {
    philox4x32_10(
        [index as u32, (index >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// 2^-24
const TWO_POW_M24: f32 = 1.0 / 16_777_216.0;
/// 2^-32
const TWO_POW_M32: f64 = 1.0 / 4_294_967_296.0;

/// The uniform value in `[0, 1)` of element `index` in stream `seed` (24 random mantissa bits).
pub fn uniform(seed: u64, index: u64) -> f32 {
    (block(seed, index)[0] >> 8) as f32 * TWO_POW_M24
}

/// The standard normal value of element `index` in stream `seed` (Box-Muller, see the module
/// documentation).
pub fn normal(seed: u64, index: u64) -> f64 {
    let w = block(seed, index);
    let u1 = (f64::from(w[0]) + 1.0) * TWO_POW_M32;
    let u2 = f64::from(w[1]) * TWO_POW_M32;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The integer in `[0, n)` of element `index` in stream `seed` (multiply-shift of the 64 bits
/// `w1 · 2^32 + w0`, see the module documentation); 0 when `n` is 0.
pub fn below(seed: u64, index: u64, n: u64) -> u64 {
    let w = block(seed, index);
    let x = (u64::from(w[1]) << 32) | u64::from(w[0]);
    ((u128::from(x) * u128::from(n)) >> 64) as u64
}

/// Fills `out[i] = f(start + i)`, in parallel chunks when large.
fn fill_with<T: Copy + Send>(start: u64, out: &mut [T], f: impl Fn(u64) -> T + Sync) {
    let serial = |first: u64, out: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = f(first.wrapping_add(i as u64));
                }
            },
        )
    };
    if out.len() < PAR_FILL {
        serial(start, out);
    } else {
        let chunk = PAR_FILL / 4;
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, o)| serial(start.wrapping_add((c * chunk) as u64), o));
    }
}

/// `out[i] = low + (high - low) * u(seed, start + i)`.
///
/// Computed in f64 and rounded to `T` (so with f32 a value can round up to `high`).
pub fn fill_uniform<T: Float>(seed: u64, start: u64, low: f64, high: f64, out: &mut [T]) {
    let width = high - low;
    fill_with(start, out, |i| {
        T::from_f64(low + width * f64::from(uniform(seed, i)))
    });
}

/// `out[i] = mean + std * n(seed, start + i)`, with `n` a standard normal from Box-Muller over
/// the Philox block of counter `start + i`.
///
/// `n` is [`normal`]: computed in f64, `mean + std * n` rounded to `T`.
pub fn fill_normal<T: Float>(seed: u64, start: u64, mean: f64, std: f64, out: &mut [T]) {
    fill_with(start, out, |i| T::from_f64(mean + std * normal(seed, i)));
}

/// `out[i] = low + below(seed, start + i, high - low)`: integers uniform in `[low, high)`
/// (see [`below`]). Panics if `high <= low`.
pub fn fill_randint(seed: u64, start: u64, low: i64, high: i64, out: &mut [i64]) {
    assert!(high > low, "fill_randint: empty range [{low}, {high})");
    // The width fits in u64 for any pair of i64 (at most 2^64 - 1).
    let width = (i128::from(high) - i128::from(low)) as u64;
    fill_with(start, out, |i| {
        (i128::from(low) + i128::from(below(seed, i, width))) as i64
    });
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answers() {
        // Random123 kat_vectors for philox4x32_10.
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffff_ffff; 4], [0xffff_ffff; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn counter_and_key_layout() {
        let seed = 0x1234_5678_9abc_def0u64;
        let index = 0x0000_0007_0000_0003u64;
        let w = philox4x32_10([3, 7, 0, 0], [0x9abc_def0, 0x1234_5678]);
        assert_eq!(uniform(seed, index), (w[0] >> 8) as f32 / 16_777_216.0);
    }

    #[test]
    fn fills_are_split_invariant() {
        let seed = 987_654_321;
        let n = 40_000usize;
        let start = (1u64 << 32) - 1000; // crosses the 32-bit counter word boundary
        let mut full = vec![0f32; n];
        fill_uniform(seed, start, -2.0, 3.0, &mut full);
        for (i, &v) in full.iter().enumerate() {
            let want = (-2.0 + 5.0 * uniform(seed, start + i as u64) as f64) as f32;
            assert_eq!(v, want, "at {i}");
        }
        for split in [0usize, 1, 999, 1000, 1001, 17_000, n] {
            let mut a = vec![0f32; split];
            let mut b = vec![0f32; n - split];
            fill_uniform(seed, start, -2.0, 3.0, &mut a);
            fill_uniform(seed, start + split as u64, -2.0, 3.0, &mut b);
            a.extend_from_slice(&b);
            assert_eq!(a, full);

            let mut whole = vec![0f64; n];
            fill_normal(seed, start, 0.5, 2.0, &mut whole);
            let mut a = vec![0f64; split];
            let mut b = vec![0f64; n - split];
            fill_normal(seed, start, 0.5, 2.0, &mut a);
            fill_normal(seed, start + split as u64, 0.5, 2.0, &mut b);
            a.extend_from_slice(&b);
            assert_eq!(a, whole);
        }
        // Direct Box-Muller from the raw block words.
        let mut one = [0f64];
        fill_normal(seed, 12345, 0.0, 1.0, &mut one);
        let w = philox4x32_10([12345, 0, 0, 0], [seed as u32, 0]);
        let u1 = (w[0] as f64 + 1.0) / 4_294_967_296.0;
        let u2 = w[1] as f64 / 4_294_967_296.0;
        let want = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        assert_eq!(one[0], want);
    }

    #[test]
    fn randint_is_the_documented_function_and_split_invariant() {
        let seed = 5;
        let start = (1u64 << 32) - 3;
        let n = 20_000usize;
        let mut full = vec![0i64; n];
        fill_randint(seed, start, -7, 10, &mut full);
        for (i, &v) in full.iter().enumerate().take(50) {
            let w = philox4x32_10(
                [
                    (start + i as u64) as u32,
                    ((start + i as u64) >> 32) as u32,
                    0,
                    0,
                ],
                [seed as u32, 0],
            );
            let x = ((w[1] as u128) << 32) | w[0] as u128;
            assert_eq!(v, -7 + ((x * 17) >> 64) as i64, "at {i}");
        }
        assert!(full.iter().all(|v| (-7..10).contains(v)));
        let mut a = vec![0i64; 17_001];
        let mut b = vec![0i64; n - 17_001];
        fill_randint(seed, start, -7, 10, &mut a);
        fill_randint(seed, start + 17_001, -7, 10, &mut b);
        a.extend_from_slice(&b);
        assert_eq!(a, full);
        // The full i64 range and a one-value range.
        let mut wide = vec![0i64; 1000];
        fill_randint(seed, 0, i64::MIN, i64::MAX, &mut wide);
        assert!(wide.iter().any(|&v| v < 0) && wide.iter().any(|&v| v > 0));
        let mut one = vec![1i64; 10];
        fill_randint(seed, 0, 3, 4, &mut one);
        assert_eq!(one, vec![3; 10]);
    }

    #[test]
    fn moments_are_sane() {
        let n = 200_000;
        let mut u = vec![0f64; n];
        fill_uniform(1, 0, 0.0, 1.0, &mut u);
        let mean = u.iter().sum::<f64>() / n as f64;
        let var = u.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "uniform mean {mean}");
        assert!((var - 1.0 / 12.0).abs() < 0.002, "uniform var {var}");
        assert!(u.iter().all(|&v| (0.0..1.0).contains(&v)));
        // Buckets are roughly even.
        let mut hist = [0usize; 10];
        for &v in &u {
            hist[(v * 10.0) as usize] += 1;
        }
        for h in hist {
            assert!(
                (h as f64 - n as f64 / 10.0).abs() < 0.05 * n as f64 / 10.0,
                "{hist:?}"
            );
        }

        let mut z = vec![0f32; n];
        fill_normal(2, 0, 1.0, 3.0, &mut z);
        let mean = z.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        let var = z.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        let m4 = z
            .iter()
            .map(|&v| ((v as f64 - mean) / 3.0).powi(4))
            .sum::<f64>()
            / n as f64;
        assert!((mean - 1.0).abs() < 0.03, "normal mean {mean}");
        assert!((var - 9.0).abs() < 0.15, "normal var {var}");
        assert!((m4 - 3.0).abs() < 0.15, "normal kurtosis {m4}");
        assert!(z.iter().all(|v| v.is_finite()));
        // Different seeds give different streams.
        let mut z2 = vec![0f32; 100];
        fill_normal(3, 0, 1.0, 3.0, &mut z2);
        assert_ne!(&z[..100], &z2[..]);
    }
}
