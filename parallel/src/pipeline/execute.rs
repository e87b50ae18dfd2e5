//! A first pipeline executor: runs one rank's action list of a [`Schedule`] on a
//! [`ModelStage`] over the pipeline group, and a [`PipelineGrads`] helper that finishes a step
//! (tied-table gradient sum, clipping across stages, optimizer step).
//!
//! # What runs
//!
//! [`execute`] walks `schedule.ranks[pp.rank()]` in order:
//!
//! * **Forward** of microbatch `m`: the first stage reads `microbatches[m].batch`, a later stage
//!   the activation it received, as a fresh leaf. The forward runs in
//!   `ForwardCtx::new(step, microbatches[m].first_row)`, the context the single device runs that
//!   microbatch in, so dropout draws the same masks. The output (hidden states, or the loss on
//!   the last stage) is kept for the backward.
//! * **SendActivation / RecvActivation**: the forward's output goes to `peer` with
//!   [`Communicator::send`] (buffered: it completes at once) and is received with
//!   [`Communicator::recv`].
//! * **Backward** of microbatch `m`: the last stage runs the backward of `loss / M` (the step's
//!   loss is the mean over microbatches, as gradient accumulation on one device computes it),
//!   the others `backward_with` the gradient they received for their output. Gradients
//!   accumulate into the stage's parameters across microbatches; the caller zeroes them before
//!   the step.
//! * **SendGradient / RecvGradient**: the gradient of the received activation leaf (the
//!   stage's input) goes back to the previous stage.
//!
//! Only one chunk per rank and full backwards for now: interleaved schedules (`chunks > 1`) and
//! split backwards ([`Action::BackwardInput`] / [`Action::BackwardWeight`], the zero-bubble
//! schedule) are refused with a one-line error before anything runs.
//!
//! [`execute`] returns the step's mean loss on every pipeline rank (the last stage computes it
//! and broadcasts it over the group).
//!
//! # Finishing the step
//!
//! [`PipelineGrads::step`]: the first and the last stage each hold a copy of the tied table
//! ([`ModelStage::tied_parameters`]); their gradients are summed with an all-reduce on a
//! sub-group of just those two ranks (made once, in [`PipelineGrads::new`], by those two ranks
//! only — [`Communicator::new_group`] is not collective), so both copies take the same summed
//! gradient and, with the same optimizer state, the same update. The global gradient norm is the
//! square root of the per-stage sums of squares all-reduced over the pipeline group, with the
//! tied table counted once (by the first stage). Then each rank steps its own optimizer.

use std::collections::HashMap;
use std::sync::Arc;

use meshgrad_autograd::{ForwardCtx, Var};
use meshgrad_nn::optim::{clip_grads_with_norm, grad_sq_sum, Optimizer};
use meshgrad_nn::ModelStage;
use meshgrad_tensor::{Result, Tensor};

use super::schedule::{Action, Schedule, ScheduleKind};
use super::trace::{record_opt, SpanKind, Timeline};
use crate::comm::{all_reduce_scalar, Communicator, ReduceOp};

/// One microbatch of a step as the stages read it, with the global index of its first row (the
/// [`ForwardCtx`] the single device runs it in).
#[derive(Clone, Debug)]
pub struct Microbatch<B> {
    /// The microbatch (every stage gets the same one and reads its part).
    pub batch: B,
    /// Global index of the microbatch's first row in the step's batch.
    pub first_row: u64,
}

/// Checks that this executor can run `schedule` on a pipeline group of `world` ranks with
/// `microbatches` microbatches: one chunk per rank, full backwards only. One-line errors.
pub fn check_supported(schedule: &Schedule, world: usize, microbatches: usize) -> Result<()> {
    if schedule.chunks != 1 || schedule.kind == ScheduleKind::Interleaved {
        meshgrad_tensor::bail!(
            "pipeline executor: the {} schedule with {} chunks per rank is not supported yet \
             (one chunk per rank only)",
            schedule.kind,
            schedule.chunks
        );
    }
    if let Some(a) = schedule.ranks.iter().flatten().find(|a| {
        matches!(
            a,
            Action::BackwardInput { .. } | Action::BackwardWeight { .. }
        )
    }) {
        meshgrad_tensor::bail!(
            "pipeline executor: the {} schedule splits the backward ({a}); split backwards are \
             not supported yet",
            schedule.kind
        );
    }
    if schedule.stages != world || schedule.ranks.len() != world {
        meshgrad_tensor::bail!(
            "pipeline executor: the schedule has {} stages but the pipeline group has {world} \
             ranks",
            schedule.stages
        );
    }
    if schedule.microbatches != microbatches {
        meshgrad_tensor::bail!(
            "pipeline executor: the schedule runs {} microbatches but {microbatches} were given",
            schedule.microbatches
        );
    }
    Ok(())
}

fn check_stage<S: ModelStage>(stage: &S, pp: &dyn Communicator) -> Result<()> {
    let (rank, world) = (pp.rank(), pp.world_size());
    let spec = stage.spec();
    if spec.embedding != (rank == 0) || spec.head != (rank + 1 == world) {
        meshgrad_tensor::bail!(
            "pipeline executor: pipeline rank {rank} of {world} holds stage {spec}, but the first \
             rank must hold the embedding and the last the head (and no other)"
        );
    }
    Ok(())
}

/// Runs this rank's actions of `schedule` (see the [module docs](self)) for training step `step`
/// on `stage` over the pipeline group `pp` (group rank `p` runs stage `p`). Gradients accumulate
/// into the stage's parameters. Every action is recorded in `timeline` when one is given.
/// Returns the mean loss over the microbatches, on every rank.
pub fn execute<S: ModelStage>(
    stage: &S,
    schedule: &Schedule,
    pp: &dyn Communicator,
    microbatches: &[Microbatch<S::Batch>],
    step: u64,
    timeline: Option<&Timeline>,
) -> Result<f64> {
    let (rank, world) = (pp.rank(), pp.world_size());
    check_supported(schedule, world, microbatches.len())?;
    check_stage(stage, pp)?;
    let m_count = microbatches.len();
    let last = rank + 1 == world;
    let err = |a: &Action, what: &str| {
        meshgrad_tensor::Error::msg(format!("pipeline rank {rank}: {a}: {what}"))
    };
    // Per microbatch: the received input leaf, the forward's output, the received gradient.
    let mut inputs: HashMap<usize, Var> = HashMap::new();
    let mut outputs: HashMap<usize, Var> = HashMap::new();
    let mut grads: HashMap<usize, Tensor> = HashMap::new();
    let mut losses: Vec<Option<f64>> = vec![None; m_count];
    let chunks = schedule.chunks;
    for a in &schedule.ranks[rank] {
        let kind = match a {
            Action::Forward { .. } => SpanKind::Forward,
            Action::Backward { .. } => SpanKind::Backward,
            Action::BackwardInput { .. } => SpanKind::BackwardInput,
            Action::BackwardWeight { .. } => SpanKind::BackwardWeight,
            Action::SendActivation { .. } | Action::SendGradient { .. } => SpanKind::Send,
            Action::RecvActivation { .. } | Action::RecvGradient { .. } => SpanKind::Recv,
        };
        record_opt(
            timeline,
            kind,
            || a.label(chunks),
            || -> Result<()> {
                let m = a.microbatch();
                let mb = microbatches
                    .get(m)
                    .ok_or_else(|| err(a, "no such microbatch"))?;
                match *a {
                    Action::Forward { .. } => {
                        let hidden =
                            if rank == 0 {
                                None
                            } else {
                                Some(inputs.get(&m).ok_or_else(|| {
                                    err(a, "its input activation was not received")
                                })?)
                            };
                        let out = ForwardCtx::new(step, mb.first_row)
                            .scope(|| stage.forward_stage(&mb.batch, hidden))?;
                        if last {
                            losses[m] = Some(out.tensor().item()?);
                        }
                        outputs.insert(m, out);
                    }
                    Action::SendActivation { peer, .. } => {
                        let out = outputs
                            .get(&m)
                            .ok_or_else(|| err(a, "the forward has not run"))?;
                        pp.send(out.tensor(), peer)?.wait()?;
                    }
                    Action::RecvActivation { peer, .. } => {
                        let t = pp.recv(peer)?.wait()?;
                        inputs.insert(m, Var::leaf(t));
                    }
                    Action::RecvGradient { peer, .. } => {
                        grads.insert(m, pp.recv(peer)?.wait()?);
                    }
                    Action::Backward { .. } => {
                        let out = outputs
                            .remove(&m)
                            .ok_or_else(|| err(a, "the forward has not run"))?;
                        if last {
                            out.mul_scalar(1.0 / m_count as f64)?.backward()?;
                        } else {
                            let g = grads
                                .remove(&m)
                                .ok_or_else(|| err(a, "the output gradient was not received"))?;
                            out.backward_with(g)?;
                        }
                    }
                    Action::SendGradient { peer, .. } => {
                        let input = inputs
                            .remove(&m)
                            .ok_or_else(|| err(a, "no input activation"))?;
                        let g = input.grad().ok_or_else(|| {
                            err(a, "the input got no gradient (backward not run?)")
                        })?;
                        pp.send(&g, peer)?.wait()?;
                    }
                    Action::BackwardInput { .. } | Action::BackwardWeight { .. } => {
                        return Err(err(a, "split backwards are not supported yet"));
                    }
                }
                Ok(())
            },
        )?;
    }
    let local = if last {
        let mut sum = 0.0;
        for (m, l) in losses.iter().enumerate() {
            sum += l.ok_or_else(|| {
                meshgrad_tensor::Error::msg(format!(
                    "pipeline rank {rank}: the schedule ran no forward of microbatch {m}"
                ))
            })?;
        }
        sum / m_count as f64
    } else {
        0.0
    };
    // The last stage's mean loss on every rank (the others add zeros: exact).
    all_reduce_scalar(pp, local, ReduceOp::Sum)
}

/// Finishes a pipeline step on one rank: sums the tied table's gradients between the first and
/// the last stage, clips the global norm across stages and steps the optimizer (see the
/// [module docs](self)).
pub struct PipelineGrads {
    pp: Arc<dyn Communicator>,
    params: Vec<Var>,
    /// The tied copies this rank holds (first or last stage of more than one).
    tied: Vec<Var>,
    /// Whether this rank's tied copies are left out of the norm (the last stage's).
    skip_tied_in_norm: bool,
    /// The group of the first and the last pipeline rank (on those two ranks).
    tied_group: Option<Arc<dyn Communicator>>,
}

impl PipelineGrads {
    /// For `stage` on pipeline group `pp`. On the first and the last rank (when they differ and
    /// the stage ties parameters) it creates their two-rank group; every other rank calls
    /// nothing.
    pub fn new<S: ModelStage>(stage: &S, pp: Arc<dyn Communicator>) -> Result<Self> {
        check_stage(stage, pp.as_ref())?;
        let names = stage.tied_parameters();
        let named = stage.named_parameters();
        let mut tied = Vec::new();
        for n in &names {
            let p = named.iter().find(|(k, _)| k == n).ok_or_else(|| {
                meshgrad_tensor::Error::msg(format!(
                    "pipeline: tied parameter {n} is not a parameter of the stage"
                ))
            })?;
            tied.push(p.1.clone());
        }
        let world = pp.world_size();
        let tied_group = if !tied.is_empty() && world > 1 {
            Some(pp.new_group(&[0, world - 1], "pp-tied")?)
        } else {
            None
        };
        Ok(PipelineGrads {
            skip_tied_in_norm: pp.rank() + 1 == world && world > 1,
            params: named.into_iter().map(|(_, p)| p).collect(),
            tied,
            tied_group,
            pp,
        })
    }

    /// Sums the tied copies' gradients between the first and the last stage (both get the same
    /// bits); nothing elsewhere.
    pub fn reduce_tied_grads(&self) -> Result<()> {
        let Some(group) = &self.tied_group else {
            return Ok(());
        };
        for p in &self.tied {
            let g = match p.grad() {
                Some(g) => g,
                None => p.tensor().zeros_like()?,
            };
            let sum = group.all_reduce(&g, ReduceOp::Sum)?.wait()?;
            p.set_grad(Some(sum));
        }
        Ok(())
    }

    /// The global gradient norm across the pipeline (the tied table counted once), after
    /// [`PipelineGrads::reduce_tied_grads`]; a collective on the pipeline group.
    pub fn grad_norm(&self) -> Result<f64> {
        let counted: Vec<Var> = self
            .params
            .iter()
            .filter(|p| !(self.skip_tied_in_norm && self.tied.iter().any(|t| t.id() == p.id())))
            .cloned()
            .collect();
        let local = grad_sq_sum(&counted)?;
        Ok(all_reduce_scalar(self.pp.as_ref(), local, ReduceOp::Sum)?.sqrt())
    }

    /// Sums the tied gradients, clips the global norm to `clip` (when given) and steps
    /// `optimizer` (over this stage's parameters) with learning rate `lr`. Returns the norm
    /// before clipping when clipping.
    pub fn step(
        &self,
        optimizer: &mut dyn Optimizer,
        clip: Option<f64>,
        lr: f64,
    ) -> Result<Option<f64>> {
        self.reduce_tied_grads()?;
        let norm = match clip {
            Some(c) => {
                let norm = self.grad_norm()?;
                clip_grads_with_norm(&self.params, c, norm)?;
                Some(norm)
            }
            None => None,
        };
        optimizer.step(lr)?;
        Ok(norm)
    }
}
