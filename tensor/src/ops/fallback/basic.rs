//! Linear, composed.

use super::widen;
use crate::{Result, Tensor};

/// `x Wᵀ + bias` for `x [rows, in]`, `weight [out, in]`, `bias [out]`: one product and a
/// broadcast add in compute precision, rounded once to `x`'s dtype.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut y = widen(x)?.matmul(&widen(weight)?.t()?)?;
    if let Some(b) = bias {
        y = y.add(&widen(b)?)?;
    }
    y.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{both, close, rand, CASES};

    #[test]
    fn linear_matches_its_composition() {
        for (dt, rel) in CASES {
            let x = rand(&[2, 5, 24], 15, dt);
            let w = rand(&[7, 24], 16, dt);
            let b = rand(&[7], 17, dt);
            // A transposed weight view too (the fused op reads it through its strides).
            let wt = rand(&[24, 7], 18, dt).t().unwrap();
            for (w, bias) in [(&w, None), (&w, Some(&b)), (&wt, Some(&b))] {
                let (a, c) = both(|| x.linear(w, bias).unwrap());
                close(&format!("linear {dt} bias={}", bias.is_some()), &a, &c, rel);
            }
        }
    }
}
