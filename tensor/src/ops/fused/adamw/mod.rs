//! One AdamW step in place: the argument struct [`AdamW`], its paths (`cpu.rs`, `cuda.rs`,
//! `fallback.rs`) and the tensor ops [`Tensor::adamw_step_`] and [`Tensor::adamw_step_many`].
//! The CPU kernel is `meshgrad_kernels::cpu::adamw::adamw_step`, the CUDA one `adamw_grad_<g>`
//! of `kernels/cuda/adamw.cu`; `nn`'s optimizer calls the tensor ops.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use meshgrad_derive::FusedArgs;
use meshgrad_kernels::ops::AdamWStep;

use super::{fused_op, run};
use crate::{Result, Tensor};

/// One AdamW step from `grad` on `param` and its moments `m`, `v`, all updated in place
/// (contiguous, one shape; the dtypes each path takes are in its file).
#[derive(Debug, FusedArgs)]
pub(crate) struct AdamW<T, W> {
    /// The gradient.
    pub grad: T,
    /// The parameter.
    pub param: W,
    /// The first moment.
    pub m: W,
    /// The second moment.
    pub v: W,
    /// The hyper-parameters and the step number (from 1).
    pub hp: AdamWStep,
}

fused_op!(AdamW<_, _>, "adamw_step", step, in_place);

impl Tensor {
    /// One AdamW step on many parameters at once (the "foreach" form of
    /// [`Tensor::adamw_step_`]): each item is `(param, grad, m, v, hyper-parameters)`, updated
    /// exactly as `adamw_step_` would, with the parameters spread over rayon tasks (the update is
    /// elementwise, so the results do not depend on the split). Returns one result per item, in
    /// order.
    pub fn adamw_step_many(
        items: &[(&Tensor, &Tensor, &Tensor, &Tensor, AdamWStep)],
    ) -> Vec<Result<()>> {
        use rayon::prelude::*;
        let _prof = crate::profile::scope("adamw_step");
        // Released storage is materialised here, on the calling thread, never in a task.
        let ready: Vec<Result<()>> = items
            .iter()
            .map(|(p, g, m, v, _)| {
                [*p, *g, *m, *v]
                    .iter()
                    .try_for_each(|t| t.ensure_materialized())
            })
            .collect();
        let ctx = crate::alloc::AllocContext::capture();
        items
            .par_iter()
            .zip(ready)
            .map(|((p, g, m, v, hp), r)| ctx.run(|| r.and_then(|()| p.adamw_step_(g, m, v, hp))))
            .collect()
    }

    /// One AdamW step in place: `self` is the parameter, `m` and `v` the moment buffers (all
    /// contiguous, of one dtype and shape).
    pub fn adamw_step_(&self, grad: &Tensor, m: &Tensor, v: &Tensor, hp: &AdamWStep) -> Result<()> {
        let _prof = crate::profile::scope("adamw_step");
        self.check_flat(&[grad, m, v], "adamw_step")?;
        run(&AdamW {
            grad,
            param: self,
            m,
            v,
            hp: *hp,
        })
    }
}
