//! How a rank completes a step across the ranks of its layout, once its schedule has run: the
//! tied table's copies, the data-parallel reduction, the global gradient norm and clipping, the
//! optimizer step (plain or mixed precision), and the mean loss. One type for every layout: one
//! device is a layout of one rank, one stage and no data parallelism.
//!
//! * the layout's data-parallel wrapper ([`DataParallel`], chosen by
//!   [`DataParallel::for_layout`]) averages the gradients over the data-parallel group, during
//!   each chunk's last backward (or weight pass) of the step where it may
//!   ([`DataParallel::reduces_during_backward`]: [`Ddp`]'s buckets, the sharded wrapper's
//!   reduce-scatters on a stage without a tied table's copy; never in reference mode), the rest
//!   after the schedule;
//! * the copies of the tied embedding / head table on the first and the last pipeline stage add
//!   their gradients ([`PipelineGrads::reduce_tied_grads`]; nothing to do with one stage), in the
//!   order [`DataParallel::finish_pipeline`] gives (after [`Ddp`]'s averages, before the shards
//!   are cut);
//! * the global gradient norm adds every stage's sum of squares (the tied table once) over the
//!   pipeline group (its shards' under ZeRO), and clipping scales every stage's gradients by the
//!   same factor;
//! * each rank steps its optimizer (or its shard of it).
//!
//! [`Ddp`]: meshgrad_parallel::Ddp

use std::sync::Arc;

use anyhow::Result;
use meshgrad_nn::optim::AdamW;
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::{PipelineGrads, SpanKind, Timeline};
use meshgrad_parallel::{Communicator, DataParallel, ReduceOp, ScaledStep};

use crate::step_loop::GradSync;

/// A rank's end of a step (see the [module docs](self)).
pub(crate) struct RankSync<'a> {
    pub(crate) grads: &'a PipelineGrads,
    pub(crate) wrapper: &'a DataParallel,
    pub(crate) dp: Arc<dyn Communicator>,
    pub(crate) timeline: &'a Timeline,
    /// Per local chunk, the microbatch of the schedule's last action adding to its weight
    /// gradients ([`Schedule::last_weight_gradients`](meshgrad_parallel::pipeline::Schedule::last_weight_gradients)).
    pub(crate) last_weight_gradients: Vec<Option<usize>>,
    /// Reference mode: the tied copies' gradients were already added per microbatch (in the
    /// step, [`PipelineGrads::reduce_tied_grads_by_microbatch`]), and no reduction overlaps a
    /// backward.
    pub(crate) reference: bool,
}

impl RankSync<'_> {
    /// Whether the data-parallel reduction may run during the backward: outside reference mode,
    /// when the wrapper allows it ([`DataParallel::reduces_during_backward`]).
    fn overlaps(&self) -> bool {
        !self.reference && self.wrapper.reduces_during_backward(self.grads)
    }

    /// Before an action that adds to the weight gradients of `chunk` on microbatch `mb`: the
    /// wrapper reduces during the chunk's last such action ([`Schedule::last_weight_gradients`])
    /// when it [`overlaps`](Self::overlaps), and accumulates locally otherwise.
    ///
    /// [`Schedule::last_weight_gradients`]: meshgrad_parallel::pipeline::Schedule::last_weight_gradients
    pub(crate) fn before_grads(&self, mb: usize, chunk: usize) {
        let last = self.last_weight_gradients.get(chunk).copied().flatten();
        self.wrapper.set_sync(self.overlaps() && last == Some(mb));
    }
}

impl GradSync for RankSync<'_> {
    /// Clears the gradients before a step's first backward.
    fn zero_grad(&self, opt: &AdamW) {
        self.wrapper.zero_grad(opt);
        self.wrapper.set_sync(false);
    }

    /// Completes the gradients after the schedule: the tied copies and the data-parallel
    /// reduction ([`DataParallel::finish_pipeline`]).
    fn finish(&self) -> Result<()> {
        self.timeline
            .record(SpanKind::Optimizer, "reduce gradients", || -> Result<()> {
                Ok(self.wrapper.finish_pipeline(self.grads, !self.reference)?)
            })
    }

    /// The mean of `local` over the data-parallel group (losses).
    fn mean(&self, local: f64) -> Result<f64> {
        Ok(all_reduce_scalar(self.dp.as_ref(), local, ReduceOp::Avg)?)
    }

    /// Clips the global gradient norm to `max_norm`; returns the norm before clipping.
    fn clip(&self, max_norm: f64) -> Result<f64> {
        let norm = self.wrapper.grad_norm(self.grads)?;
        self.wrapper
            .clip_grads_with_norm(self.grads, max_norm, norm)?;
        Ok(norm)
    }

    /// Reference mode's gradient norm: the square root of an order-free exact sum of squares
    /// over every stage's gradients (their shards under ZeRO), so no layout changes its bits.
    fn exact_norm(&self) -> Result<f64> {
        Ok(self.wrapper.exact_grad_norm(self.grads)?)
    }

    /// Scales the gradients as clipping to `max_norm` does when the global norm is `norm`.
    fn clip_with_norm(&self, max_norm: f64, norm: f64) -> Result<()> {
        Ok(self
            .wrapper
            .clip_grads_with_norm(self.grads, max_norm, norm)?)
    }

    /// The optimizer step with learning rate `lr`: the run's AdamW, or the sharded wrapper's
    /// shard of it.
    fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
        self.timeline
            .record(SpanKind::Optimizer, "optimizer step", || {
                Ok(self.wrapper.step(opt, lr)?)
            })
    }

    /// The optimizer step of a bf16 / f16 run whose loss was multiplied by `scale` (1 for bf16):
    /// the global norm of the unscaled gradients over every stage (the tied table once), then,
    /// unless it is NaN or infinite (every rank sees the same norm), the step with the clipping
    /// to `max_norm` (0: none) and the unscaling applied in f32 ([`DataParallel::step_scaled`]).
    /// Returns the norm, and whether the step was taken (false: nothing was changed).
    fn step_mixed(
        &self,
        opt: &mut AdamW,
        lr: f64,
        max_norm: f64,
        scale: f64,
    ) -> Result<(f64, bool)> {
        let norm = self.wrapper.unscaled_grad_norm(self.grads, scale)?;
        if !norm.is_finite() {
            return Ok((norm, false));
        }
        let step = ScaledStep {
            lr,
            max_norm,
            norm,
            scale,
        };
        self.timeline
            .record(SpanKind::Optimizer, "optimizer step", || -> Result<()> {
                Ok(self.wrapper.step_scaled(opt, step)?)
            })?;
        Ok((norm, true))
    }
}
