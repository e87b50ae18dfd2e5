//! The fused backward of SiLU and clamp, `dy * f'(x)`: the argument struct [`UnaryBackward`],
//! its paths (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the tensor op behind
//! [`Tensor::silu_backward`] and [`Tensor::clamp_backward`] (whose forwards are basic unary
//! ops). The CPU kernel is `meshgrad_kernels::cpu::unary_backward`, the CUDA one `unary_bwd_<t>`
//! of `kernels/cuda/unary_backward.cu`; the autograd rules are `Var::silu` and `Var::clamp`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use meshgrad_derive::FusedArgs;
use meshgrad_kernels::ops::UnaryGrad;

use super::{fused_op, run};
use crate::ops::float_only;
use crate::ops::same_kind;
use crate::{Error, Result, Tensor};

/// `dy * f'(x)` elementwise for `f` one of [`UnaryGrad`], in `x`'s dtype. Operands contiguous,
/// of one shape.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct UnaryBackward<T> {
    /// The forward's input.
    pub x: T,
    /// The gradient of the output.
    pub dy: T,
    /// Which derivative.
    pub op: UnaryGrad,
}

fused_op!(UnaryBackward, "unary_backward", backward, |a| a.x.shape());

impl Tensor {
    /// `dy * f'(x)` for the forward input `self` (float, shaped like `dy`); `name` names the op
    /// in errors and profiles.
    pub(crate) fn unary_backward(
        &self,
        dy: &Tensor,
        op: UnaryGrad,
        name: &'static str,
    ) -> Result<Tensor> {
        let _prof = crate::profile::scope(name);
        same_kind(name, self, dy)?;
        float_only(name, self)?;
        if self.shape() != dy.shape() {
            return Err(Error::shape_mismatch(name, self.shape(), dy.shape()));
        }
        let (x, dy) = (self.contiguous()?, dy.contiguous()?);
        run(&UnaryBackward { x: &x, dy: &dy, op })
    }
}
