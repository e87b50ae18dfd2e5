//! Fused SwiGLU (`silu(gate) * up`, Llama's MLP gate), forward and backward.

use super::same_kind;
use crate::{backend, Error, Result, Tensor};

fn check(op: &'static str, gate: &Tensor, other: &Tensor) -> Result<()> {
    same_kind(op, gate, other)?;
    if !gate.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: gate.dtype(),
        });
    }
    if gate.shape() != other.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: gate.shape().clone(),
            rhs: other.shape().clone(),
        });
    }
    Ok(())
}

impl Tensor {
    /// SwiGLU: `silu(gate) * up` elementwise, with `silu(g) = g * sigmoid(g)`, in one pass.
    /// `gate` and `up` have the same shape and dtype (no broadcasting).
    pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("swiglu");
        check("swiglu (gate vs up)", gate, up)?;
        let (g, u) = (gate.contiguous()?, up.contiguous()?);
        let s = {
            let (gg, gu) = (g.read_storage("swiglu")?, u.read_storage("swiglu")?);
            backend::swiglu((&gg, g.layout()), (&gu, u.layout()))?
        };
        match s {
            Some(s) => Ok(Tensor::from_storage(s, g.shape())),
            None => super::fallback::swiglu(&g, &u),
        }
    }

    /// The backward of [`Tensor::swiglu`] from `dy`: `(dgate, dup)` in one pass.
    pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        let _prof = crate::profile::scope("swiglu_backward");
        check("swiglu_backward (gate vs up)", gate, up)?;
        check("swiglu_backward (gate vs dy)", gate, dy)?;
        let (g, u, d) = (gate.contiguous()?, up.contiguous()?, dy.contiguous()?);
        let op = "swiglu_backward";
        let r = {
            let (gg, gu, gd) = (
                g.read_storage(op)?,
                u.read_storage(op)?,
                d.read_storage(op)?,
            );
            backend::swiglu_backward((&gg, g.layout()), (&gu, u.layout()), (&gd, d.layout()))?
        };
        match r {
            Some((dg, du)) => Ok((
                Tensor::from_storage(dg, g.shape()),
                Tensor::from_storage(du, g.shape()),
            )),
            None => super::fallback::swiglu_backward(&g, &u, &d),
        }
    }
}
