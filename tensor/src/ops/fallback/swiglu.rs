//! SwiGLU (forward and backward), composed.

use super::widen;
use crate::{Result, Tensor};

/// `silu(gate) * up`, in `gate`'s dtype.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    widen(gate)?
        .silu()?
        .mul(&widen(up)?)?
        .to_dtype(gate.dtype())
}

/// The backward of [`swiglu`]: `(dgate, dup)` in `gate`'s dtype, with `s = sigmoid(gate)`:
/// `dup = dy gate s`, `dgate = dy up s (1 + gate (1 - s))`.
pub(crate) fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (g, u, d) = (widen(gate)?, widen(up)?, widen(dy)?);
    let s = g.sigmoid()?;
    let dup = d.mul(&g.mul(&s)?)?;
    let slope = s.mul(&s.neg()?.add_scalar(1.0)?.mul(&g)?.add_scalar(1.0)?)?;
    let dgate = d.mul(&u)?.mul(&slope)?;
    Ok((dgate.to_dtype(gate.dtype())?, dup.to_dtype(gate.dtype())?))
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{both, close, rand, CASES};
    use crate::Tensor;

    #[test]
    fn swiglu_matches_its_composition() {
        for (dt, rel) in CASES {
            let g = rand(&[3, 50], 9, dt);
            let u = rand(&[3, 50], 10, dt);
            let (a, c) = both(|| Tensor::swiglu(&g, &u).unwrap());
            close(&format!("swiglu {dt}"), &a, &c, rel);
        }
    }

    #[test]
    fn swiglu_backward_matches_its_composition() {
        for (dt, rel) in CASES {
            let g = rand(&[3, 50], 28, dt);
            let u = rand(&[3, 50], 29, dt);
            let dy = rand(&[3, 50], 30, dt);
            let (a, c) = both(|| Tensor::swiglu_backward(&g, &u, &dy).unwrap());
            close(&format!("swiglu_backward {dt} dgate"), &a.0, &c.0, rel);
            close(&format!("swiglu_backward {dt} dup"), &a.1, &c.1, rel);
        }
    }
}
