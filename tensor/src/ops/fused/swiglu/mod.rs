//! SwiGLU (`silu(gate) * up`, Llama's MLP gate), forward and backward: the argument structs
//! [`Swiglu`] and [`SwigluBackward`], their paths (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the
//! tensor ops [`Tensor::swiglu`] and [`Tensor::swiglu_backward`]. The CPU kernels are
//! `meshgrad_kernels::cpu::swiglu`, the CUDA ones `swiglu_fwd_<t>` / `swiglu_bwd_<t>` of
//! `kernels/cuda/swiglu.cu`; the autograd rule is `Var::swiglu`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, run};
use crate::ops::float_only;
use crate::ops::same_kind;
use crate::{Error, Result, Tensor};
use meshgrad_derive::FusedArgs;

/// `silu(gate) * up` elementwise, in `gate`'s dtype. Operands contiguous, of one shape.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct Swiglu<T> {
    /// The gate, passed through SiLU.
    pub gate: T,
    /// The value it gates.
    pub up: T,
}

/// The backward of [`Swiglu`] from `dy`: `(dgate, dup)` in `gate`'s dtype. Operands
/// contiguous, of one shape.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct SwigluBackward<T> {
    /// The forward's gate.
    pub gate: T,
    /// The forward's `up`.
    pub up: T,
    /// The gradient of the output.
    pub dy: T,
}

fused_op!(Swiglu, "swiglu", forward, |a| a.gate.shape());

fused_op!(SwigluBackward, "swiglu_backward", backward, |a| (S, S) => (
    a.gate.shape(),
    a.gate.shape()
));

/// Checks `other` against `gate`: same device, dtype and shape, a float dtype.
fn check(op: &'static str, gate: &Tensor, other: &Tensor) -> Result<()> {
    same_kind(op, gate, other)?;
    float_only(op, gate)?;
    if gate.shape() != other.shape() {
        return Err(Error::shape_mismatch(op, gate.shape(), other.shape()));
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
        run(&Swiglu { gate: &g, up: &u })
    }

    /// The backward of [`Tensor::swiglu`] from `dy`: `(dgate, dup)` in one pass.
    pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        let _prof = crate::profile::scope("swiglu_backward");
        check("swiglu_backward (gate vs up)", gate, up)?;
        check("swiglu_backward (gate vs dy)", gate, dy)?;
        let (g, u, d) = (gate.contiguous()?, up.contiguous()?, dy.contiguous()?);
        run(&SwigluBackward {
            gate: &g,
            up: &u,
            dy: &d,
        })
    }
}
