//! Branch-free f32 `exp` and `tanh` that auto-vectorise (plain arithmetic and bit operations,
//! no calls into libm), and generic wrappers that use them for `f32` and the exact `std`
//! functions for every other [`Float`] (so f64 keeps reference precision).
//!
//! Accuracy (checked by the tests over dense sweeps): `exp_f32` within 2 ulp over its whole range
//! (results below `f32::MIN_POSITIVE` flush to 0, above `f32::MAX` give `inf`, NaN propagates);
//! `tanh_f32` within 4 ulp.

use std::any::TypeId;

use crate::Float;

/// ln(f32::MAX): above it `exp` overflows.
const EXP_HI: f32 = 88.722_83;
/// ln(f32::MIN_POSITIVE): below it `exp` is flushed to 0.
const EXP_LO: f32 = -87.336_54;
/// ln 2 split into a part with few mantissa bits (so `n * LN2_HI` is exact for |n| <= 512) and
/// the rest.
const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125
const LN2_LO: f32 = (std::f64::consts::LN_2 - LN2_HI as f64) as f32;
/// 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer held in the low
/// mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// e^x for f32 (see the module documentation for accuracy and special values).
///
/// `x = n ln2 + r` with `|r| <= ln2 / 2`, `e^r` by its degree-7 Taylor polynomial (truncation
/// error below 1e-8 relative), and `2^n` applied by adding `n` to the exponent bits.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let xc = if x > EXP_HI { EXP_HI } else { x };
    let xc = if xc < EXP_LO { EXP_LO } else { xc };
    let t = xc * std::f32::consts::LOG2_E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let res = f32::from_bits((p.to_bits() as i32).wrapping_add(ni << 23) as u32);
    if x > EXP_HI {
        f32::INFINITY
    } else if x < EXP_LO {
        0.0
    } else if x >= EXP_LO {
        res
    } else {
        x // NaN
    }
}

/// tanh for f32: an odd Taylor polynomial (through x^13) for |x| < 0.4, else
/// `sign(x) (1 - 2 / (e^{2|x|} + 1))`.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let e = exp_f32(2.0 * a);
    let big = (1.0 - 2.0 / (e + 1.0)).copysign(x);
    let x2 = x * x;
    let small = x + x
        * x2
        * (-1.0 / 3.0
            + x2 * (2.0 / 15.0
                + x2 * (-17.0 / 315.0
                    + x2 * (62.0 / 2835.0
                        + x2 * (-1382.0 / 155_925.0 + x2 * (21_844.0 / 6_081_075.0))))));
    if a < 0.4 {
        small
    } else {
        big
    }
}

/// Whether `T` is `f32` (decided at compile time after monomorphisation).
#[inline(always)]
pub(crate) fn is_f32<T: 'static>() -> bool {
    TypeId::of::<T>() == TypeId::of::<f32>()
}

/// e^x: [`exp_f32`] for f32, [`Float::exp`] otherwise.
#[inline(always)]
pub(crate) fn exp<T: Float>(x: T) -> T {
    if is_f32::<T>() {
        // For T = f32 both conversions are exact and fold away.
        T::from_f64(f64::from(exp_f32(x.to_f64() as f32)))
    } else {
        x.exp()
    }
}

/// tanh x: [`tanh_f32`] for f32, [`Float::tanh`] otherwise.
#[inline(always)]
pub(crate) fn tanh<T: Float>(x: T) -> T {
    if is_f32::<T>() {
        T::from_f64(f64::from(tanh_f32(x.to_f64() as f32)))
    } else {
        x.tanh()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the correctly rounded `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w {
            return 0.0;
        }
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_f32_is_accurate_over_its_range() {
        let n = 2_000_000;
        let mut worst: f64 = 0.0;
        for i in 0..=n {
            let x = (-87.3 + (88.7 + 87.3) * i as f64 / n as f64) as f32;
            let u = ulps(exp_f32(x), (x as f64).exp());
            worst = worst.max(u);
            assert!(
                u <= 2.0,
                "exp_f32({x}) = {} vs {} ({u} ulp)",
                exp_f32(x),
                (x as f64).exp()
            );
        }
        // Small arguments.
        for i in -1000..=1000 {
            let x = i as f32 * 1e-6;
            assert!(ulps(exp_f32(x), (x as f64).exp()) <= 1.0);
        }
        assert!(worst > 0.0);
    }

    #[test]
    fn exp_f32_special_values() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.72).is_finite());
        assert!(exp_f32(EXP_HI).is_finite());
        assert!(exp_f32(EXP_LO) >= f32::MIN_POSITIVE);
    }

    #[test]
    fn tanh_f32_is_accurate() {
        let n = 1_000_000;
        for i in -n..=n {
            let x = (i as f64 * 12.0 / n as f64) as f32;
            let want = (x as f64).tanh();
            let u = ulps(tanh_f32(x), want);
            assert!(
                u <= 4.0,
                "tanh_f32({x}) = {} vs {want} ({u} ulp)",
                tanh_f32(x)
            );
        }
        for x in [1e-30f32, -1e-20, 1e-8, 0.0, -0.0, 50.0, -50.0, 1e30] {
            assert!(ulps(tanh_f32(x), (x as f64).tanh()) <= 1.0, "{x}");
        }
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
    }

    #[test]
    fn generic_wrappers_dispatch_by_type() {
        assert_eq!(exp(1.5f32), exp_f32(1.5));
        assert_eq!(exp(1.5f64), 1.5f64.exp());
        assert_eq!(tanh(0.7f32), tanh_f32(0.7));
        assert_eq!(tanh(0.7f64), 0.7f64.tanh());
    }
}
