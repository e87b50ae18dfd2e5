//! SwiGLU composed of basic ops, forward and backward, and the tests that it agrees with the
//! fused paths.

use super::{Swiglu, SwigluBackward};
use crate::ops::fallback::widen;
use crate::{Result, Tensor};

/// See [`Swiglu`]: `silu(gate) * up` in compute precision.
pub(super) fn forward(&Swiglu { gate, up }: &Swiglu<&Tensor>) -> Result<Tensor> {
    widen(gate)?
        .silu()?
        .mul(&widen(up)?)?
        .to_dtype(gate.dtype())
}

/// See [`SwigluBackward`]: with `s = sigmoid(gate)`, `dup = dy gate s` and
/// `dgate = dy up s (1 + gate (1 - s))`.
pub(super) fn backward(
    &SwigluBackward { gate, up, dy }: &SwigluBackward<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (g, u, d) = (widen(gate)?, widen(up)?, widen(dy)?);
    let s = g.sigmoid()?;
    let dup = d.mul(&g.mul(&s)?)?;
    let slope = s.mul(&s.neg()?.add_scalar(1.0)?.mul(&g)?.add_scalar(1.0)?)?;
    let dgate = d.mul(&u)?.mul(&slope)?;
    Ok((dgate.to_dtype(gate.dtype())?, dup.to_dtype(gate.dtype())?))
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close};
    use crate::Tensor;

    #[test]
    fn swiglu_matches_its_composition() {
        for (dt, rel, [g, u]) in cases(9, [&[3, 50], &[3, 50]]) {
            let (a, c) = both(|| Tensor::swiglu(&g, &u).unwrap());
            close(&format!("swiglu {dt}"), &a, &c, rel);
        }
    }

    #[test]
    fn swiglu_backward_matches_its_composition() {
        for (dt, rel, [g, u, dy]) in cases(28, [&[3, 50], &[3, 50], &[3, 50]]) {
            let (a, c) = both(|| Tensor::swiglu_backward(&g, &u, &dy).unwrap());
            close(&format!("swiglu_backward {dt} dgate"), &a.0, &c.0, rel);
            close(&format!("swiglu_backward {dt} dup"), &a.1, &c.1, rel);
        }
    }
}
