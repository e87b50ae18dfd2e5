//! One SGD-with-momentum step in place: the argument struct [`Sgd`], its paths (`cpu.rs`,
//! `cuda.rs`, `fallback.rs`) and the tensor op [`Tensor::sgd_step_`]. The CPU kernel is
//! `meshgrad_kernels::cpu::sgd::sgd_step`, the CUDA one `sgd_grad_<g>` of
//! `kernels/cuda/sgd.cu`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use meshgrad_derive::FusedArgs;

use super::{fused_op, run};
use crate::{Result, Tensor};

/// One SGD-with-momentum step (PyTorch semantics) from `grad` on `param` and its momentum
/// buffer `buf`, both updated in place (contiguous, one shape; the dtypes each path takes are
/// in its file).
#[derive(Debug, FusedArgs)]
pub(crate) struct Sgd<T, W> {
    /// The gradient.
    pub grad: T,
    /// The parameter.
    pub param: W,
    /// The momentum buffer.
    pub buf: W,
    /// The learning rate.
    pub lr: f64,
    /// The momentum factor.
    pub momentum: f64,
    /// The weight decay (L2, added to the gradient).
    pub weight_decay: f64,
    /// Whether this is the first step (the buffer is set to the gradient).
    pub first_step: bool,
}

fused_op!(Sgd<_, _>, "sgd_step", step, in_place);

impl Tensor {
    /// One SGD-with-momentum step in place (PyTorch semantics, see the kernel).
    pub fn sgd_step_(
        &self,
        grad: &Tensor,
        buf: &Tensor,
        lr: f64,
        momentum: f64,
        weight_decay: f64,
        first_step: bool,
    ) -> Result<()> {
        let _prof = crate::profile::scope("sgd_step");
        self.check_flat(&[grad, buf], "sgd_step")?;
        run(&Sgd {
            grad,
            param: self,
            buf,
            lr,
            momentum,
            weight_decay,
            first_step,
        })
    }
}
