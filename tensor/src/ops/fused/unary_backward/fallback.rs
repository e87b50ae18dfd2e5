//! The SiLU / clamp backward composed of basic ops, and the test that it agrees with the fused
//! paths.

use meshgrad_kernels::ops::UnaryGrad;

use super::UnaryBackward;
use crate::ops::fallback::widen;
use crate::{Result, Tensor};

/// `dy * f'(x)` in `x`'s dtype for the fused unary derivatives: SiLU's
/// `s (1 + x (1 - s))` with `s = sigmoid(x)`, and clamp's 1 where `lo <= x <= hi` (bounds
/// rounded to the compute precision, NaN excluded), else 0.
pub(super) fn backward(&UnaryBackward { x, dy, op }: &UnaryBackward<&Tensor>) -> Result<Tensor> {
    let xc = widen(x)?;
    match op {
        UnaryGrad::Silu => {
            let s = xc.sigmoid()?;
            let slope = s.mul(&s.neg()?.add_scalar(1.0)?.mul(&xc)?.add_scalar(1.0)?)?;
            widen(dy)?.mul(&slope)?.to_dtype(x.dtype())
        }
        UnaryGrad::Clamp(lo, hi) => {
            let bound = |v: f64| Tensor::scalar(v, xc.dtype(), xc.device());
            let zero = dy.zeros_like()?;
            let below_hi = xc.le(&bound(hi)?)?.where_cond(dy, &zero)?;
            xc.ge(&bound(lo)?)?.where_cond(&below_hi, &zero)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close, with_values};
    use crate::Tensor;

    #[test]
    fn unary_backward_matches_its_composition() {
        for (dt, rel, [x, dy]) in cases(40, [&[3, 30], &[3, 30]]) {
            // Values on the clamp bounds (included) and a NaN (excluded) too.
            let x = with_values(&x, &[(2, -1.0), (5, 1.5), (9, f64::NAN)]);
            let (a, c) = both(|| x.silu_backward(&dy).unwrap());
            // The NaN input gives NaN on both sides: compare the rest.
            let keep = |t: &Tensor| t.narrow(1, 10, 20).unwrap();
            close(&format!("silu_backward {dt}"), &keep(&a), &keep(&c), rel);
            assert!(a.to_vec_f64().unwrap()[9].is_nan() && c.to_vec_f64().unwrap()[9].is_nan());
            for (lo, hi) in [
                (Some(-1.0), Some(1.5)),
                (None, Some(0.5)),
                (Some(0.0), None),
            ] {
                let (a, c) = both(|| x.clamp_backward(&dy, lo, hi).unwrap());
                close(&format!("clamp_backward {dt} {lo:?}..{hi:?}"), &a, &c, rel);
            }
        }
    }
}
