//! The linear layer composed of basic ops, and the tests that it agrees with the fused paths.

use super::{Linear, LinearGelu};
use crate::ops::fallback::widen;
use crate::{GeluKind, Result, Tensor};

/// See [`Linear`]: one product and a broadcast add in compute precision, rounded once to `x`'s
/// dtype.
pub(super) fn forward(a: &Linear<&Tensor>) -> Result<Tensor> {
    let mut y = widen(a.x)?.matmul(&widen(a.w)?.t()?)?;
    if let Some(b) = a.bias {
        y = y.add(&widen(b)?)?;
    }
    y.to_dtype(a.x.dtype())?.reshape(a.out_dims.clone())
}

/// See [`LinearGelu`]: [`Tensor::linear`] (fused where the backend provides it), then GELU.
pub(super) fn gelu(a: &LinearGelu<&Tensor>) -> Result<(Tensor, Tensor)> {
    let l = &a.lin;
    let pre = l.x.linear(l.w, l.bias)?.reshape(l.out_dims.clone())?;
    let kind = if a.tanh_form {
        GeluKind::Tanh
    } else {
        GeluKind::Erf
    };
    Ok((pre.gelu(kind)?, pre))
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close};

    #[test]
    fn linear_matches_its_composition() {
        let shapes: [&[usize]; 4] = [&[2, 5, 24], &[7, 24], &[7], &[24, 7]];
        for (dt, rel, [x, w, b, wt]) in cases(15, shapes) {
            // A transposed weight view too (the fused op reads it through its strides).
            let wt = wt.t().unwrap();
            for (w, bias) in [(&w, None), (&w, Some(&b)), (&wt, Some(&b))] {
                let (a, c) = both(|| x.linear(w, bias).unwrap());
                close(&format!("linear {dt} bias={}", bias.is_some()), &a, &c, rel);
            }
        }
    }
}
