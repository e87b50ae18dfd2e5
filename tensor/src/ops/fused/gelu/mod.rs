//! GELU's fused backward, `dy * gelu'(x)` in the tanh or erf form: the argument struct
//! [`GeluBackward`], its paths (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the tensor op
//! [`Tensor::gelu_backward`]. The forward, [`Tensor::gelu`], is the basic unary op. The CPU kernel
//! is `meshgrad_kernels::cpu::elementwise::gelu_backward`, the CUDA one `gelu_bwd_<t>` of
//! `kernels/cuda/gelu.cu`; the autograd rule is `Var::gelu`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, run};
use crate::ops::same_kind;
use crate::{GeluKind, Result, Tensor};
use meshgrad_derive::FusedArgs;

/// `dy * gelu'(x)` elementwise, in `x`'s dtype. Operands contiguous, of one shape.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct GeluBackward<T> {
    /// The forward's input.
    pub x: T,
    /// The gradient of the output.
    pub dy: T,
    /// The tanh approximation (else the erf form).
    pub tanh_form: bool,
}

fused_op!(GeluBackward, "gelu_backward", backward, |a| a.x.shape());

impl Tensor {
    /// `dy * gelu'(x)` (the GELU backward, fused).
    pub fn gelu_backward(&self, dy: &Tensor, kind: GeluKind) -> Result<Tensor> {
        let _prof = crate::profile::scope("gelu_backward");
        same_kind("gelu_backward", self, dy)?;
        if self.shape() != dy.shape() {
            return Err(crate::Error::shape_mismatch(
                "gelu_backward",
                self.shape(),
                dy.shape(),
            ));
        }
        let (x, dy) = (self.contiguous()?, dy.contiguous()?);
        run(&GeluBackward {
            x: &x,
            dy: &dy,
            tanh_form: kind == GeluKind::Tanh,
        })
    }
}
