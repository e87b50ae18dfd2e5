//! The strategy seam: what a rank's model is wrapped in for its layout's data parallelism, chosen
//! in one place ([`DataParallel::for_layout`]) for every model and every training loop.
//!
//! * one data-parallel rank (one device, `tp=T`, `pp=P`): nothing; the gradients are whole;
//! * `dp=N` (nothing sharded): [`Ddp`] over the mesh's data-parallel group, its bucketed
//!   all-reduces launched during the backward of the step's last microbatch;
//! * `ep=E` (with `dp`, `zero1/2`, `fsdp` or `hsdp`): [`ExpertDataParallel`]: the layout's
//!   wrapper for every parameter but the experts, and for those, over the ranks holding the
//!   same experts, [`Ddp`] (with `dp`) or a second [`ShardedDataParallel`] at the layout's ZeRO
//!   stage (see [`crate::expert_dp`]);
//! * `zero1/2=N`, `fsdp=N`, `hsdp=RxS`, `dp=R,zero1=S`, ...: [`ShardedDataParallel`] over the
//!   mesh's shard topology, which also owns the optimizer state (its shard of it) and steps.
//!
//! A loop drives every variant the same way: [`DataParallel::set_sync`] before each backward
//! (on for the last microbatch only, or off throughout when the loop reduces after the
//! schedule), [`DataParallel::finish`] after the last, then the global norm
//! ([`DataParallel::grad_norm`], [`DataParallel::exact_grad_norm`]), clipping
//! ([`DataParallel::clip_grads_with_norm`]) and the step ([`DataParallel::step`],
//! [`DataParallel::step_scaled`]): the run's AdamW on whole gradients, or the sharded wrapper's
//! shard of it (the wrapper is itself an [`Optimizer`], so a loop of one's own can hold it
//! where it holds an optimizer).

use meshgrad_nn::optim::{clip_grads_with_norm, AdamW, Optimizer};
use meshgrad_nn::Module;
use meshgrad_tensor::Result;

use crate::comm::all_reduce_scalar;
use crate::expert_dp::ExpertDataParallel;
use crate::pipeline::PipelineGrads;
use crate::ReduceOp;

use crate::zero::{ShardConfig, ShardedDataParallel};
use crate::{Ddp, DdpConfig, LayoutMesh};

/// A rank's data-parallel wrapper (see the [module docs](self)).
pub enum DataParallel {
    /// One data-parallel rank: nothing to reduce.
    Local,
    /// Replicated parameters and optimizer, gradients averaged by [`Ddp`].
    Ddp(Ddp),
    /// ZeRO-1/2/3 over the layout's shard topology.
    Sharded(ShardedDataParallel),
    /// Expert parallelism: experts reduced apart from the other parameters.
    Experts(Box<ExpertDataParallel>),
}

/// DDP for parameters a step may leave without a gradient on every rank (a mixture of experts'
/// experts that no token reached): they keep none, so the optimizer skips them as on one device.
pub(crate) fn sometimes_unused() -> DdpConfig {
    DdpConfig {
        find_unused_parameters: true,
        ..DdpConfig::default()
    }
}

impl DataParallel {
    /// The wrapper of `module` (whose optimizer is `opt`) on this rank of `mesh`: sharded when
    /// the layout names a ZeRO stage, [`Ddp`] over the data-parallel group when that group has
    /// more than one rank, nothing otherwise. [`Ddp`] broadcasts rank 0's parameters.
    pub fn for_layout(mesh: &LayoutMesh, module: &dyn Module, opt: &AdamW) -> Result<Self> {
        if mesh.ep_group().is_some() {
            let experts = meshgrad_nn::moe::expert_parameter_names(module);
            if experts.is_empty() {
                meshgrad_tensor::bail!(
                    "layout {}: expert parallelism (ep) needs a model with a mixture of experts; \
                     this one has no experts",
                    mesh.layout()
                );
            }
            return Ok(DataParallel::Experts(Box::new(ExpertDataParallel::new(
                mesh, module, &experts, opt,
            )?)));
        }
        let has_experts = !meshgrad_nn::moe::expert_parameter_names(module).is_empty();
        Ok(match mesh.layout().zero() {
            Some(stage) => DataParallel::Sharded(ShardedDataParallel::new(
                module,
                opt.param_groups().to_vec(),
                *opt.config(),
                mesh.shard_topology()?,
                // Experts that a rank's tokens did not reach have no gradient there.
                ShardConfig {
                    sometimes_unused: has_experts,
                    ..ShardConfig::new(stage)
                },
            )?),
            // Experts that no rank's tokens reached keep no gradient, as on one device.
            None if mesh.dp_degree() > 1 => DataParallel::Ddp(Ddp::new(
                module.named_parameters(),
                mesh.dp_group(),
                if has_experts {
                    sometimes_unused()
                } else {
                    DdpConfig::default()
                },
            )?),
            None => DataParallel::Local,
        })
    }

    /// Whether the following backward passes reduce their gradients (off: they accumulate
    /// locally until a backward with sync on, or [`DataParallel::finish`]).
    pub fn set_sync(&self, on: bool) {
        match self {
            DataParallel::Local => {}
            DataParallel::Ddp(ddp) => ddp.set_sync(on),
            DataParallel::Sharded(sdp) => sdp.set_sync(on),
            DataParallel::Experts(e) => e.set_sync(on),
        }
    }

    /// Clears the gradients before a step: the optimizer's, or the sharded wrapper's.
    pub fn zero_grad(&self, opt: &AdamW) {
        match self {
            DataParallel::Sharded(sdp) => sdp.zero_grad(),
            DataParallel::Experts(e) => e.zero_grad(opt),
            _ => opt.zero_grad(),
        }
    }

    /// Whether this rank's reduction may run during the backward of the last microbatch (the
    /// alternative: after the schedule, [`DataParallel::finish_pipeline`]). [`Ddp`] always may:
    /// on a pipeline, the tied table's copies are added after their averages
    /// ([`DataParallel::finish_pipeline`]), as the sum of averages is the average of the sums.
    /// The sharded wrapper may unless this rank holds a copy of a tied table (on the first or
    /// the last pipeline stage): the copies must be added before the gradients are cut into
    /// shards. Every rank of a data-parallel group is on the same stage, so the group agrees.
    pub fn reduces_during_backward(&self, grads: &PipelineGrads) -> bool {
        match self {
            DataParallel::Local => false,
            DataParallel::Ddp(_) => true,
            DataParallel::Sharded(_) => !grads.holds_tied_copy(),
            DataParallel::Experts(e) => e.dense().reduces_during_backward(grads),
        }
    }

    /// Completes a pipeline step's gradients: adds the tied table's copies on the first and the
    /// last stage ([`PipelineGrads::reduce_tied_grads`], unless `add_tied` is false: reference
    /// mode adds them per microbatch) and the data-parallel reduction ([`DataParallel::finish`]),
    /// in the order the wrapper needs: [`Ddp`] averages each copy first (its buckets may have
    /// been reduced during the backward), the sharded wrapper adds the copies before it cuts
    /// the gradients into shards.
    pub fn finish_pipeline(&self, grads: &PipelineGrads, add_tied: bool) -> Result<()> {
        let tied_after = match self {
            DataParallel::Experts(e) => matches!(e.dense(), DataParallel::Ddp(_)),
            _ => matches!(self, DataParallel::Ddp(_)),
        };
        if add_tied && !tied_after {
            grads.reduce_tied_grads()?;
        }
        self.finish()?;
        if add_tied && tied_after {
            grads.reduce_tied_grads()?;
        }
        Ok(())
    }

    /// Completes the step's reduction (turning sync on first): every bucket or shard not
    /// reduced during the backward is reduced now, and every rank holds the averaged gradients
    /// (whole, or its shard).
    pub fn finish(&self) -> Result<()> {
        self.set_sync(true);
        match self {
            DataParallel::Local => Ok(()),
            DataParallel::Ddp(ddp) => ddp.finish(),
            DataParallel::Sharded(sdp) => sdp.finish(),
            DataParallel::Experts(e) => e.finish(),
        }
    }

    /// The sharded wrapper, when the layout shards (under expert parallelism, the dense
    /// parameters' one).
    pub fn sharded(&self) -> Option<&ShardedDataParallel> {
        match self {
            DataParallel::Sharded(sdp) => Some(sdp),
            DataParallel::Experts(e) => e.dense().sharded(),
            _ => None,
        }
    }

    /// fsdp/hsdp keep only shards: gathers the full parameters (every rank takes part; under
    /// expert parallelism the experts' wrapper's too), for a checkpoint or a sample. Nothing to
    /// do for the other layouts.
    pub fn summon_full_params(&self) -> Result<()> {
        match self {
            DataParallel::Sharded(sdp) => sdp.summon_full_params(),
            DataParallel::Experts(e) => e.summon_full_params(),
            _ => Ok(()),
        }
    }

    /// The global gradient norm of a step: every stage's gradients (the tied table once) over
    /// the pipeline group of `grads`; under ZeRO, the rank's shards'.
    pub fn grad_norm(&self, grads: &PipelineGrads) -> Result<f64> {
        match self {
            DataParallel::Sharded(sdp) => Ok(sharded_sq_sum(sdp, grads)?.sqrt()),
            DataParallel::Experts(e) => e.grad_norm(grads),
            _ => grads.grad_norm(None),
        }
    }

    /// [`DataParallel::grad_norm`] from an order-free exact sum of squares (reference mode: no
    /// layout changes its bits).
    pub fn exact_grad_norm(&self, grads: &PipelineGrads) -> Result<f64> {
        let sum = match self {
            DataParallel::Sharded(sdp) => {
                let local = sdp.exact_grad_sq_sum_without(&|n| grads.is_left_out_of_norm(n))?;
                grads.exact_sum_over_pipeline(&local)?
            }
            DataParallel::Experts(e) => e.exact_grad_sq_sum(grads)?,
            _ => grads.exact_grad_sq_sum(None)?,
        };
        Ok(sum.value().sqrt())
    }

    /// Scales the gradients (those of `grads`' parameters, or the shards) as clipping to
    /// `max_norm` does when the global norm is `norm`.
    pub fn clip_grads_with_norm(
        &self,
        grads: &PipelineGrads,
        max_norm: f64,
        norm: f64,
    ) -> Result<()> {
        match self {
            DataParallel::Sharded(sdp) => sdp.clip_grads_with_norm(max_norm, norm),
            DataParallel::Experts(e) => e.clip_grads_with_norm(grads, max_norm, norm),
            _ => clip_grads_with_norm(grads.params(), max_norm, norm),
        }
    }

    /// The optimizer step with learning rate `lr`: `opt`, or the sharded wrapper's shard of it
    /// (which owns the state; `opt` is then unused).
    pub fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
        match self {
            DataParallel::Sharded(sdp) => sdp.step(lr),
            DataParallel::Experts(e) => e.step(opt, lr),
            _ => opt.step(lr),
        }
    }

    /// The global norm of a bf16 / f16 step whose loss was multiplied by `scale` (1 for bf16),
    /// unscaled (the shards are unscaled in place; whole gradients are unscaled by the step).
    pub fn unscaled_grad_norm(&self, grads: &PipelineGrads, scale: f64) -> Result<f64> {
        match self {
            DataParallel::Sharded(sdp) => {
                if scale != 1.0 {
                    sdp.scale_grads(1.0 / scale)?;
                }
                Ok(sharded_sq_sum(sdp, grads)?.sqrt())
            }
            DataParallel::Experts(e) => e.unscaled_grad_norm(grads, scale),
            _ => Ok(self.grad_norm(grads)? / scale),
        }
    }

    /// The step of a bf16 / f16 run after [`DataParallel::unscaled_grad_norm`] gave `norm`:
    /// clipping to `max_norm` (0: none) and the unscaling applied in f32, AdamW's gradient
    /// multiplier on whole gradients ([`AdamW::step_scaled`]), the f32 shards otherwise.
    pub fn step_scaled(&self, opt: &mut AdamW, step: ScaledStep) -> Result<()> {
        match self {
            DataParallel::Sharded(sdp) => {
                if step.max_norm > 0.0 {
                    sdp.clip_grads_with_norm(step.max_norm, step.norm)?;
                }
                sdp.step(step.lr)
            }
            DataParallel::Experts(e) => e.step_scaled(opt, step),
            _ => {
                let coef = meshgrad_nn::optim::clip_coef(step.max_norm, step.norm);
                opt.step_scaled(step.lr, coef / step.scale)
            }
        }
    }
}

/// A mixed-precision step ([`DataParallel::step_scaled`]).
#[derive(Clone, Copy, Debug)]
pub struct ScaledStep {
    /// Learning rate.
    pub lr: f64,
    /// Clipping threshold (0: none).
    pub max_norm: f64,
    /// The unscaled global norm.
    pub norm: f64,
    /// The loss scale the gradients carry (1 for bf16).
    pub scale: f64,
}

/// The sum of squares of the shards a rank owns (the tied table once) over the pipeline group.
pub(crate) fn sharded_sq_sum(sdp: &ShardedDataParallel, grads: &PipelineGrads) -> Result<f64> {
    let local = sdp.grad_sq_sum_without(&|n| grads.is_left_out_of_norm(n))?;
    all_reduce_scalar(grads.pipeline_group(), local, ReduceOp::Sum)
}
