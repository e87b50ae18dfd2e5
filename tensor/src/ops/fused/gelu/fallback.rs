//! GELU's backward composed of basic ops, and the test that it agrees with the fused paths.

use super::GeluBackward;
use crate::ops::fallback::widen;
use crate::{Result, Tensor};

/// See [`GeluBackward`], in `x`'s dtype: the tanh form
/// `0.5 (1 + t) + 0.5 x (1 - t²) c (1 + 3 a x²)` with `t = tanh(c (x + a x³))`,
/// `c = sqrt(2/π)`, `a = 0.044715`; the erf form `Φ(x) + x φ(x)` with `Φ(x) = gelu(x) / x`
/// (0.5 at 0) and `φ(x) = exp(-x²/2) / sqrt(2π)`.
pub(super) fn backward(
    &GeluBackward { x, dy, tanh_form }: &GeluBackward<&Tensor>,
) -> Result<Tensor> {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    const A: f64 = 0.044_715;
    const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
    let xc = widen(x)?;
    let x2 = xc.sqr()?;
    let grad = if tanh_form {
        let t = xc
            .mul(&x2.mul_scalar(A)?.add_scalar(1.0)?)?
            .mul_scalar(C)?
            .tanh()?;
        let left = t.add_scalar(1.0)?.mul_scalar(0.5)?;
        let one_minus_t2 = t.sqr()?.neg()?.add_scalar(1.0)?;
        let slope = x2
            .mul_scalar(3.0 * A)?
            .add_scalar(1.0)?
            .mul_scalar(0.5 * C)?;
        left.add(&xc.mul(&one_minus_t2)?.mul(&slope)?)?
    } else {
        let zero = xc.zeros_like()?;
        let at_zero = xc.eq(&zero)?;
        let cdf = at_zero.where_cond(
            &zero.add_scalar(0.5)?,
            &xc.gelu(crate::GeluKind::Erf)?.div(&xc)?,
        )?;
        let pdf = x2.mul_scalar(-0.5)?.exp()?.mul_scalar(INV_SQRT_2PI)?;
        cdf.add(&xc.mul(&pdf)?)?
    };
    grad.mul(&widen(dy)?)?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close, with_values};
    use crate::GeluKind;

    #[test]
    fn gelu_backward_matches_its_composition() {
        for (dt, rel, [x, dy]) in cases(11, [&[4, 25], &[4, 25]]) {
            // Include an exact zero (the erf form's special case).
            let x = with_values(&x, &[(7, 0.0)]);
            for kind in [GeluKind::Tanh, GeluKind::Erf] {
                let (a, c) = both(|| x.gelu_backward(&dy, kind).unwrap());
                close(&format!("gelu_backward {dt} {kind:?}"), &a, &c, rel);
            }
        }
    }
}
