//! The pipeline executor: runs one rank's action list of any [`Schedule`] (GPipe, 1F1B,
//! interleaved, zero-bubble or hand-made) on the rank's model chunks over the pipeline group,
//! and a [`PipelineGrads`] helper that finishes a step (tied-table gradient sum, clipping across
//! stages, optimizer step).
//!
//! # What runs
//!
//! With `P` pipeline ranks and `V = schedule.chunks` chunks per rank, rank `p` holds `V`
//! [`ModelStage`]s: `stages[c]` is virtual stage `c * P + p` (see
//! [`schedule`](super::schedule)); virtual stage 0 holds the embedding, virtual stage `P V - 1`
//! the head. [`execute`] walks `schedule.ranks[pp.rank()]` in order:
//!
//! * **Forward** of microbatch `m` on chunk `c`: virtual stage 0 reads `microbatches[m].batch`,
//!   a later one its input activation as a fresh leaf: received, or, when the previous virtual
//!   stage sits on the same rank (only with one rank and several chunks; the schedule then has
//!   no transfer for the pair), that chunk's output handed over without a copy. The forward runs
//!   in `ForwardCtx::new(step, microbatches[m].first_row)`, the context the single device runs
//!   that microbatch in, so dropout draws the same masks, with the loss scale of the backward
//!   ([`ForwardCtx::scope_scaled`]: an auxiliary loss added through the backward, on any stage,
//!   is scaled as the last stage's loss is). The output (hidden states, or the loss
//!   on the last virtual stage) is kept for the backward.
//! * **Backward** (full): the last virtual stage runs the backward of `loss / M` (the step's
//!   loss is the mean over microbatches, as gradient accumulation on one device computes it),
//!   the others `backward_with` the gradient of their output (received, or handed over by the
//!   next chunk on the same rank). Gradients accumulate into the chunk's parameters across
//!   microbatches; the caller zeroes them before the step.
//! * **BackwardInput** (the zero-bubble schedule's B): the same root, but
//!   [`Var::backward_input`] computes only the gradient of the chunk's input leaf (what the
//!   previous virtual stage waits for; nothing on virtual stage 0) and keeps the parameters'
//!   part for later. **BackwardWeight** (W) runs that part
//!   ([`DeferredWeightGrads::run`](meshgrad_autograd::DeferredWeightGrads::run)): the parameters
//!   get the same gradients, bit for bit, as from a full backward.
//! * **Transfers**: the forward's output goes to the rank of the next virtual stage, the
//!   gradient of the input leaf back to the rank of the previous one, with
//!   [`Communicator::send`] and [`Communicator::recv`], grouped as below.
//!
//! Every action is recorded in the [`Timeline`] when one is given (a transfer group as one span
//! per transfer, see below). [`execute`] returns the step's mean loss on every pipeline rank
//! (the last virtual stage's rank computes it and broadcasts it over the group). It checks the
//! schedule ([`check_supported`]) and the chunks' specs before anything runs, and, at the end,
//! that every forward got its backward and every split backward its weight half.
//!
//! # Grouped point-to-point
//!
//! A maximal run of consecutive transfer actions in a rank's list is one *group*, like NCCL's
//! `ncclGroupStart` / `ncclGroupEnd`: the executor posts every send and receive of the group (in
//! list order, as one [`Communicator::batch_p2p`]), then waits for all of them — the receives first, in list order, then the sends.
//! A receive needs only its sender to have posted the send; a rendezvous send
//! ([`RunOptions::rendezvous`](crate::comm::RunOptions::rendezvous)) completes once its receiver
//! has taken the message, which the receiver does while waiting for its own group's receives.
//! So two ranks that send to each other in the same step (the two directions of interleaving's
//! ring with two ranks, a forward and a backward crossing) do not deadlock, and grouping never
//! blocks a rank that the same transfers one by one would not block. The group's spans: one per
//! transfer, in the order waited (the first also covers the posting).
//!
//! A schedule that does deadlock (under rendezvous sends: every rank of a cycle waiting for a
//! transfer its peer posts only later) fails when the backend's timeout expires, with the rank,
//! every action of its group, the action whose wait failed and the backend's error:
//! `pipeline rank 1: transfer group [recv activation(mb 0, chunk 0) from rank 0]: recv
//! activation(mb 0, chunk 0) from rank 0: rank 1: recv #0 from rank 0 on group [0,1]: rank 0
//! did not send within 1s`.
//!
//! # Finishing the step
//!
//! [`PipelineGrads::step`]: virtual stage 0 and the last virtual stage each hold a copy of the
//! tied table ([`ModelStage::tied_parameters`]); their gradients are summed (first copy plus
//! last) so both copies take the same summed gradient and, with the same optimizer state, the
//! same update. With several ranks the copies sit on ranks 0 and `P - 1`, which sum them with an
//! all-reduce on a sub-group of just those two ranks (made once, in [`PipelineGrads::new`], by
//! those two ranks only — [`Communicator::new_group`] is not collective); with one rank and
//! several chunks both copies are local and summed in place. The global gradient norm is the
//! square root of the per-rank sums of squares over every local chunk's parameters,
//! all-reduced over the pipeline group, with the tied table counted once (the embedding's copy).
//! Then each rank steps its own optimizer (over all its chunks' parameters).
//!
//! # Reference mode
//!
//! [`execute_with`] runs the same schedule with a given factor on each microbatch's loss and
//! calls back as soon as a microbatch's parameter gradients on a chunk are complete, so that the
//! caller can take them out and add the microbatches in its own order;
//! [`PipelineGrads::reduce_tied_grads_by_microbatch`] adds the tied copies' gradients per
//! microbatch, as one device's backward does, before their tree sum, and
//! [`PipelineGrads::exact_grad_sq_sum`] gives the norm as an order-free exact sum.

use std::collections::HashMap;
use std::sync::Arc;

use meshgrad_autograd::{DeferredWeightGrads, ForwardCtx, Var};
use meshgrad_nn::optim::{clip_grads_with_norm, grad_sq_sum, Optimizer};
use meshgrad_nn::ModelStage;
use meshgrad_tensor::exact_sum::ExactSum;
use meshgrad_tensor::{Error, Result, Tensor};

use super::schedule::{Action, Schedule};
use super::trace::{record_opt, SpanKind, Timeline};
use crate::comm::{all_reduce_scalar, Communicator, P2pOp, P2pWork, ReduceOp};
use meshgrad_tensor::tree_sum::tree_split;

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
/// `microbatches` microbatches: the sizes agree, and every action names a microbatch and a chunk
/// that exist, and every transfer the rank of the virtual stage it connects to (not the rank
/// itself). One-line errors.
pub fn check_supported(schedule: &Schedule, world: usize, microbatches: usize) -> Result<()> {
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
    if schedule.chunks == 0 {
        meshgrad_tensor::bail!("pipeline executor: the schedule has no chunk per rank");
    }
    let total = schedule.virtual_stages();
    for (p, actions) in schedule.ranks.iter().enumerate() {
        for a in actions {
            let bad = |why: String| {
                Error::msg(format!("pipeline executor: rank {p}'s action {a}: {why}"))
            };
            if a.microbatch() >= microbatches {
                return Err(bad(format!("there are {microbatches} microbatches")));
            }
            if a.chunk() >= schedule.chunks {
                return Err(bad(format!(
                    "there are {} chunks per rank",
                    schedule.chunks
                )));
            }
            let vs = schedule.virtual_stage(p, a.chunk());
            // The virtual stage at the other end of a transfer.
            let other = match a {
                Action::SendActivation { .. } | Action::RecvGradient { .. } => {
                    (vs + 1 < total).then_some(vs + 1)
                }
                Action::RecvActivation { .. } | Action::SendGradient { .. } => vs.checked_sub(1),
                _ => continue,
            };
            let Some(other) = other else {
                return Err(bad(format!(
                    "virtual stage {vs} has no {} neighbour",
                    if matches!(
                        a,
                        Action::SendActivation { .. } | Action::RecvGradient { .. }
                    ) {
                        "next"
                    } else {
                        "previous"
                    }
                )));
            };
            let (q, _) = schedule.locate(other);
            if a.peer() != Some(q) || q == p {
                return Err(bad(format!(
                    "virtual stage {other} is on rank {q}{}",
                    if q == p {
                        " itself (hand-offs within a rank need no transfer)"
                    } else {
                        ""
                    }
                )));
            }
        }
    }
    Ok(())
}

/// Checks that `stages` are the chunks of pipeline rank `rank` of `world`: chunk `c` is virtual
/// stage `c * world + rank`, which holds the embedding exactly when it is 0 and the head exactly
/// when it is the last.
fn check_stages<S: ModelStage>(stages: &[S], rank: usize, world: usize) -> Result<()> {
    if stages.is_empty() {
        meshgrad_tensor::bail!("pipeline executor: pipeline rank {rank} holds no chunk");
    }
    let total = world * stages.len();
    for (c, stage) in stages.iter().enumerate() {
        let vs = c * world + rank;
        let spec = stage.spec();
        if spec.embedding != (vs == 0) || spec.head != (vs + 1 == total) {
            meshgrad_tensor::bail!(
                "pipeline executor: pipeline rank {rank} of {world} holds {spec} as chunk {c} \
                 (virtual stage {vs} of {total}), but virtual stage 0 must hold the embedding \
                 and virtual stage {} the head (and no other)",
                total - 1
            );
        }
    }
    Ok(())
}

/// A callback of the executor with `(microbatch, chunk)` (see [`ExecuteOptions`]).
pub type MicrobatchHook<'a> = &'a mut dyn FnMut(usize, usize) -> Result<()>;

/// What [`execute_with`] does beyond [`execute`]: reference mode's loss scale and per-microbatch
/// gradients.
#[derive(Default)]
pub struct ExecuteOptions<'a> {
    /// The factor the last virtual stage multiplies each microbatch's loss by before its
    /// backward; `None`: `1 / M` over the `M` microbatches (gradient accumulation's mean).
    pub loss_scale: Option<f64>,
    /// Called with `(microbatch, chunk)` as soon as that microbatch's parameter gradients on
    /// that chunk are complete: after its Backward, or after its BackwardWeight when the
    /// backward is split (the input half leaves the parameters alone). The chunk's parameters'
    /// `.grad` then hold every microbatch whose backward has finished and that the callback did
    /// not take out; a callback that takes them out each time sees that microbatch alone.
    pub on_grads: Option<MicrobatchHook<'a>>,
    /// Called with `(microbatch, chunk)` just before a pass that adds to the chunk's parameter
    /// gradients: its Backward, or its BackwardWeight when the backward is split. A
    /// data-parallel wrapper turns its gradient synchronisation on here for the last
    /// microbatch only, so its reductions overlap that backward.
    pub before_grads: Option<MicrobatchHook<'a>>,
}

/// One rank's state during [`execute`], keyed by (microbatch, chunk).
struct RankRun<'a, 'f, S: ModelStage> {
    stages: &'a [S],
    /// The backward's factor on the last virtual stage's loss.
    loss_scale: f64,
    /// See [`ExecuteOptions::on_grads`].
    on_grads: Option<MicrobatchHook<'f>>,
    /// See [`ExecuteOptions::before_grads`].
    before_grads: Option<MicrobatchHook<'f>>,
    schedule: &'a Schedule,
    microbatches: &'a [Microbatch<S::Batch>],
    step: u64,
    rank: usize,
    /// The input activation leaf (received or handed over), until its gradient leaves.
    inputs: HashMap<(usize, usize), Var>,
    /// The forward's output, until the backward.
    outputs: HashMap<(usize, usize), Var>,
    /// The received gradient of the output, until the backward.
    grads: HashMap<(usize, usize), Tensor>,
    /// The weight half of a split backward, until its BackwardWeight.
    deferred: HashMap<(usize, usize), DeferredWeightGrads>,
    /// The loss of each microbatch (on the last virtual stage's rank).
    losses: Vec<Option<f64>>,
}

impl<S: ModelStage> RankRun<'_, '_, S> {
    fn err(&self, a: &Action, what: impl std::fmt::Display) -> Error {
        Error::msg(format!("pipeline rank {}: {a}: {what}", self.rank))
    }

    fn last_stage(&self) -> usize {
        self.schedule.virtual_stages() - 1
    }

    /// Runs a forward, a backward or one of its halves.
    fn compute(&mut self, a: &Action) -> Result<()> {
        let (m, c) = (a.microbatch(), a.chunk());
        let vs = self.schedule.virtual_stage(self.rank, c);
        match *a {
            Action::Forward { .. } => {
                let hidden = if vs == 0 {
                    None
                } else {
                    let (q, cq) = self.schedule.locate(vs - 1);
                    if q == self.rank {
                        // Handed over by the previous chunk on this rank: no transfer.
                        let prev = self.outputs.get(&(m, cq)).ok_or_else(|| {
                            self.err(a, format!("the forward of chunk {cq} has not run"))
                        })?;
                        let leaf = Var::leaf(prev.tensor().clone());
                        self.inputs.insert((m, c), leaf);
                    }
                    Some(
                        self.inputs
                            .get(&(m, c))
                            .ok_or_else(|| self.err(a, "its input activation was not received"))?
                            .clone(),
                    )
                };
                let mb = &self.microbatches[m];
                // The loss scale the backward applies, for layers whose auxiliary losses reach
                // the backward on their own (a mixture of experts' load balancing).
                let out = ForwardCtx::new(self.step, mb.first_row)
                    .scope_scaled(self.loss_scale, || {
                        self.stages[c].forward_stage(&mb.batch, hidden.as_ref())
                    })?;
                if vs == self.last_stage() {
                    self.losses[m] = Some(out.tensor().item()?);
                }
                if self.outputs.insert((m, c), out).is_some() {
                    return Err(self.err(a, "the forward already ran"));
                }
            }
            Action::Backward { .. } => {
                let (root, grad) = self.backward_root(a)?;
                if let Some(f) = self.before_grads.as_mut() {
                    f(m, c)?;
                }
                match grad {
                    None => root.backward()?,
                    Some(g) => root.backward_with(g)?,
                }
                if let Some(f) = self.on_grads.as_mut() {
                    f(m, c)?;
                }
            }
            Action::BackwardInput { .. } => {
                let (root, grad) = self.backward_root(a)?;
                let inputs: Vec<Var> = self.inputs.get(&(m, c)).cloned().into_iter().collect();
                if vs > 0 && inputs.is_empty() {
                    return Err(self.err(a, "no input activation"));
                }
                let weights = root.backward_input(grad, &inputs)?;
                self.deferred.insert((m, c), weights);
            }
            Action::BackwardWeight { .. } => {
                let weights = self
                    .deferred
                    .remove(&(m, c))
                    .ok_or_else(|| self.err(a, "its backward-input has not run"))?;
                if let Some(f) = self.before_grads.as_mut() {
                    f(m, c)?;
                }
                weights.run()?;
                if let Some(f) = self.on_grads.as_mut() {
                    f(m, c)?;
                }
            }
            _ => return Err(self.err(a, "not a compute action")),
        }
        Ok(())
    }

    /// The root of a backward and its gradient: `loss / M` (gradient 1; `loss * loss_scale`
    /// under [`execute_with`]) on the last virtual
    /// stage, else the output and the gradient received or handed over by the next chunk.
    fn backward_root(&mut self, a: &Action) -> Result<(Var, Option<Tensor>)> {
        let (m, c) = (a.microbatch(), a.chunk());
        let vs = self.schedule.virtual_stage(self.rank, c);
        let out = self
            .outputs
            .remove(&(m, c))
            .ok_or_else(|| self.err(a, "the forward has not run"))?;
        if vs == self.last_stage() {
            return Ok((out.mul_scalar(self.loss_scale)?, None));
        }
        let (q, cq) = self.schedule.locate(vs + 1);
        let g = if q == self.rank {
            let next = self.inputs.remove(&(m, cq)).ok_or_else(|| {
                self.err(a, format!("chunk {cq} has no input activation to take"))
            })?;
            next.grad()
                .ok_or_else(|| self.err(a, format!("the backward of chunk {cq} has not run")))?
        } else {
            self.grads
                .remove(&(m, c))
                .ok_or_else(|| self.err(a, "the output gradient was not received"))?
        };
        Ok((out, Some(g)))
    }

    /// What a send carries: the forward's output, or the input leaf's gradient (the leaf is
    /// released).
    fn payload(&mut self, a: &Action) -> Result<Tensor> {
        let key = (a.microbatch(), a.chunk());
        match a {
            Action::SendActivation { .. } => Ok(self
                .outputs
                .get(&key)
                .ok_or_else(|| self.err(a, "the forward has not run"))?
                .tensor()
                .clone()),
            _ => {
                let input = self
                    .inputs
                    .remove(&key)
                    .ok_or_else(|| self.err(a, "no input activation"))?;
                input
                    .grad()
                    .ok_or_else(|| self.err(a, "the input got no gradient (backward not run?)"))
            }
        }
    }

    /// Stores what a receive brought.
    fn deliver(&mut self, a: &Action, t: Tensor) {
        let key = (a.microbatch(), a.chunk());
        match a {
            Action::RecvActivation { .. } => {
                self.inputs.insert(key, Var::leaf(t));
            }
            _ => {
                self.grads.insert(key, t);
            }
        }
    }

    /// Runs one group of transfers (see the [module docs](self)): posts them all in list
    /// order, then waits for the receives, then for the sends; one span per transfer.
    fn transfer_group(
        &mut self,
        group: &[Action],
        pp: &dyn Communicator,
        timeline: Option<&Timeline>,
    ) -> Result<()> {
        let rank = self.rank;
        let group_err = |a: &Action, e: Error| {
            let all: Vec<String> = group.iter().map(|a| a.to_string()).collect();
            Error::msg(format!(
                "pipeline rank {rank}: transfer group [{}]: {a}: {e}",
                all.join("; ")
            ))
        };
        let is_send = |a: &Action| {
            matches!(
                a,
                Action::SendActivation { .. } | Action::SendGradient { .. }
            )
        };
        // Receives first, then sends, each in list order.
        let (sends, mut order): (Vec<usize>, Vec<usize>) =
            (0..group.len()).partition(|&i| is_send(&group[i]));
        order.extend(sends);
        let mut posted: Vec<Option<P2pWork>> = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            let a = &group[i];
            let kind = if is_send(a) {
                SpanKind::Send
            } else {
                SpanKind::Recv
            };
            let chunks = self.schedule.chunks;
            record_opt(
                timeline,
                kind,
                || a.label(chunks),
                || -> Result<()> {
                    if k == 0 {
                        let mut ops = Vec::with_capacity(group.len());
                        for b in group {
                            let peer = b
                                .peer()
                                .ok_or_else(|| group_err(b, Error::msg("not a transfer")))?;
                            ops.push(if is_send(b) {
                                P2pOp::Send {
                                    tensor: self.payload(b)?,
                                    peer,
                                }
                            } else {
                                P2pOp::Recv { peer }
                            });
                        }
                        let works = pp.batch_p2p(ops).map_err(|e| {
                            let all: Vec<String> = group.iter().map(|a| a.to_string()).collect();
                            Error::msg(format!(
                                "pipeline rank {rank}: transfer group [{}]: posting the group: {e}",
                                all.join("; ")
                            ))
                        })?;
                        posted.extend(works.into_iter().map(Some));
                    }
                    match posted[i].take() {
                        Some(P2pWork::Send(w)) => w.wait().map_err(|e| group_err(a, e)),
                        Some(P2pWork::Recv(w)) => {
                            let t = w.wait().map_err(|e| group_err(a, e))?;
                            self.deliver(a, t);
                            Ok(())
                        }
                        None => Err(group_err(a, Error::msg("was not posted"))),
                    }
                },
            )?;
        }
        Ok(())
    }

    /// After the last action: every forward got its backward, every split backward its weight
    /// half, every input activation's gradient left, every microbatch has its loss (on the last
    /// virtual stage's rank). Returns the microbatches' losses on that rank, nothing elsewhere.
    fn finish(self) -> Result<Vec<f64>> {
        let rank = self.rank;
        let left = |what: &str, keys: Vec<&(usize, usize)>| -> Result<()> {
            if let Some(&&(m, c)) = keys.iter().min() {
                meshgrad_tensor::bail!(
                    "pipeline rank {rank}: the schedule ran no {what} of microbatch {m} on chunk \
                     {c}"
                );
            }
            Ok(())
        };
        left("backward", self.outputs.keys().collect())?;
        left("backward-weight", self.deferred.keys().collect())?;
        left("send of the input gradient", self.inputs.keys().collect())?;
        if rank + 1 != self.schedule.stages {
            return Ok(Vec::new());
        }
        self.losses
            .iter()
            .enumerate()
            .map(|(m, l)| {
                l.ok_or_else(|| {
                    Error::msg(format!(
                        "pipeline rank {rank}: the schedule ran no forward of microbatch {m} on \
                         the last virtual stage"
                    ))
                })
            })
            .collect()
    }
}

/// Runs this rank's actions of `schedule` (see the [module docs](self)) for training step `step`
/// on its chunks `stages` (chunk `c` is virtual stage `c * P + p` on pipeline group rank `p` of
/// `pp`; `stages.len()` must be `schedule.chunks`). Gradients accumulate into the chunks'
/// parameters. Every action is recorded in `timeline` when one is given. Returns the mean loss
/// over the microbatches, on every rank.
pub fn execute<S: ModelStage>(
    stages: &[S],
    schedule: &Schedule,
    pp: &dyn Communicator,
    microbatches: &[Microbatch<S::Batch>],
    step: u64,
    timeline: Option<&Timeline>,
) -> Result<f64> {
    execute_scaled(stages, schedule, pp, microbatches, step, timeline, 1.0)
}

/// [`execute`] whose backwards start from `loss_factor / M` instead of `1 / M` (an f16 run's
/// loss scale `S`: the gradients come out multiplied by `S`). The returned mean loss is the
/// unscaled one.
pub fn execute_scaled<S: ModelStage>(
    stages: &[S],
    schedule: &Schedule,
    pp: &dyn Communicator,
    microbatches: &[Microbatch<S::Batch>],
    step: u64,
    timeline: Option<&Timeline>,
    loss_factor: f64,
) -> Result<f64> {
    let opts = ExecuteOptions {
        loss_scale: Some(loss_factor / microbatches.len().max(1) as f64),
        on_grads: None,
        before_grads: None,
    };
    let losses = execute_with(stages, schedule, pp, microbatches, step, timeline, opts)?;
    mean_loss(pp, &losses)
}

/// The mean of the microbatch losses [`execute_with`] returned on the last stage, on every
/// rank of `pp` (the others add zeros: exact).
pub fn mean_loss(pp: &dyn Communicator, losses: &[f64]) -> Result<f64> {
    let local = if losses.is_empty() {
        0.0
    } else {
        let mut sum = 0.0;
        for l in losses {
            sum += l;
        }
        sum / losses.len() as f64
    };
    all_reduce_scalar(pp, local, ReduceOp::Sum)
}

/// [`execute`] with `opts` (reference mode's loss scale and per-microbatch gradients): returns
/// each microbatch's loss (unscaled) on the rank that holds the last virtual stage, an empty list
/// on the other ranks (no collective after the schedule).
pub fn execute_with<S: ModelStage>(
    stages: &[S],
    schedule: &Schedule,
    pp: &dyn Communicator,
    microbatches: &[Microbatch<S::Batch>],
    step: u64,
    timeline: Option<&Timeline>,
    opts: ExecuteOptions<'_>,
) -> Result<Vec<f64>> {
    let (rank, world) = (pp.rank(), pp.world_size());
    check_supported(schedule, world, microbatches.len())?;
    if stages.len() != schedule.chunks {
        meshgrad_tensor::bail!(
            "pipeline executor: the {} schedule runs {} chunks per rank but pipeline rank {rank} \
             was given {}",
            schedule.kind,
            schedule.chunks,
            stages.len()
        );
    }
    check_stages(stages, rank, world)?;
    let mut run = RankRun {
        stages,
        loss_scale: opts.loss_scale.unwrap_or(1.0 / microbatches.len() as f64),
        on_grads: opts.on_grads,
        before_grads: opts.before_grads,
        schedule,
        microbatches,
        step,
        rank,
        inputs: HashMap::new(),
        outputs: HashMap::new(),
        grads: HashMap::new(),
        deferred: HashMap::new(),
        losses: vec![None; microbatches.len()],
    };
    let actions = &schedule.ranks[rank];
    let mut i = 0;
    while i < actions.len() {
        let a = &actions[i];
        if a.is_compute() {
            let kind = match a {
                Action::Forward { .. } => SpanKind::Forward,
                Action::Backward { .. } => SpanKind::Backward,
                Action::BackwardInput { .. } => SpanKind::BackwardInput,
                _ => SpanKind::BackwardWeight,
            };
            record_opt(
                timeline,
                kind,
                || a.label(schedule.chunks),
                || run.compute(a),
            )?;
            i += 1;
        } else {
            let end = actions[i..]
                .iter()
                .position(|b| b.is_compute())
                .map_or(actions.len(), |n| i + n);
            run.transfer_group(&actions[i..end], pp, timeline)?;
            i = end;
        }
    }
    run.finish()
}

/// [`tree_sum`](meshgrad_tensor::tree_sum::tree_sum) over gradients some of which may be missing (a
/// missing one adds nothing, and a subtree with none is missing), as per-microbatch gradients
/// are summed on one device.
fn tree_sum_options(parts: &[Option<Tensor>]) -> Result<Option<Tensor>> {
    match parts.len() {
        0 => Ok(None),
        1 => Ok(parts[0].clone()),
        n => {
            let left = tree_split(n);
            Ok(
                match (
                    tree_sum_options(&parts[..left])?,
                    tree_sum_options(&parts[left..])?,
                ) {
                    (Some(a), Some(b)) => Some(a.add(&b)?),
                    (a, None) => a,
                    (None, b) => b,
                },
            )
        }
    }
}

/// Finishes a pipeline step on one rank: sums the tied table's gradients between virtual stage
/// 0 and the last virtual stage, clips the global norm across stages and steps the optimizer
/// (see the [module docs](self)).
pub struct PipelineGrads {
    pp: Arc<dyn Communicator>,
    /// Every local chunk's parameters.
    params: Vec<Var>,
    /// The embedding's copies of the tied parameters (on virtual stage 0, if this rank holds it).
    tied_first: Vec<Var>,
    /// The head's copies (on the last virtual stage, if this rank holds it and it differs from
    /// virtual stage 0); left out of the norm.
    tied_last: Vec<Var>,
    /// The names of `tied_last`.
    tied_last_names: Vec<String>,
    /// The group of the first and the last pipeline rank (on those two ranks, when they differ).
    tied_group: Option<Arc<dyn Communicator>>,
}

impl PipelineGrads {
    /// For this rank's chunks `stages` (as given to [`execute`]) on pipeline group `pp`. On the
    /// first and the last rank (when they differ and the stages tie parameters) it creates their
    /// two-rank group; every other rank calls nothing.
    pub fn new<S: ModelStage>(stages: &[S], pp: Arc<dyn Communicator>) -> Result<Self> {
        let (rank, world) = (pp.rank(), pp.world_size());
        check_stages(stages, rank, world)?;
        let tied_of = |stage: &S| -> Result<Vec<Var>> {
            let named = stage.named_parameters();
            stage
                .tied_parameters()
                .iter()
                .map(|n| {
                    named
                        .iter()
                        .find(|(k, _)| k == n)
                        .map(|(_, p)| p.clone())
                        .ok_or_else(|| {
                            Error::msg(format!(
                                "pipeline: tied parameter {n} is not a parameter of the stage"
                            ))
                        })
                })
                .collect()
        };
        let first = stages.iter().find(|s| s.spec().embedding);
        let last = stages.iter().find(|s| s.spec().head && !s.spec().embedding);
        let tied_first = first.map(tied_of).transpose()?.unwrap_or_default();
        let tied_last = last.map(tied_of).transpose()?.unwrap_or_default();
        let tied_last_names = if tied_last.is_empty() {
            Vec::new()
        } else {
            last.map(|s| s.tied_parameters()).unwrap_or_default()
        };
        let local = !tied_first.is_empty() && !tied_last.is_empty();
        if local && tied_first.len() != tied_last.len() {
            meshgrad_tensor::bail!(
                "pipeline: the first chunk ties {} parameters but the last ties {}",
                tied_first.len(),
                tied_last.len()
            );
        }
        let holds_tied = !tied_first.is_empty() || !tied_last.is_empty();
        let tied_group = if holds_tied && !local && world > 1 {
            Some(pp.new_group(&[0, world - 1], "pp-tied")?)
        } else {
            None
        };
        Ok(PipelineGrads {
            params: stages
                .iter()
                .flat_map(|s| s.named_parameters().into_iter().map(|(_, p)| p))
                .collect(),
            tied_first,
            tied_last,
            tied_last_names,
            tied_group,
            pp,
        })
    }

    /// Whether this rank holds a copy of a tied parameter that another stage also holds (the
    /// token table on the first and the last stage): its gradient is complete only after
    /// [`PipelineGrads::reduce_tied_grads`].
    pub fn holds_tied_copy(&self) -> bool {
        let both_here = !self.tied_first.is_empty() && !self.tied_last.is_empty();
        both_here || self.tied_group.is_some()
    }

    /// Sums the tied copies' gradients between virtual stage 0 and the last virtual stage (both
    /// copies get the same bits: the first's gradient plus the last's); nothing elsewhere.
    pub fn reduce_tied_grads(&self) -> Result<()> {
        let grad_or_zeros = |p: &Var| match p.grad() {
            Some(g) => Ok(g),
            None => p.tensor().zeros_like(),
        };
        if !self.tied_first.is_empty() && !self.tied_last.is_empty() {
            for (a, b) in self.tied_first.iter().zip(&self.tied_last) {
                let sum = grad_or_zeros(a)?.add(&grad_or_zeros(b)?)?;
                // Each copy its own buffer: clipping and optimizers update gradients in place.
                a.set_grad(Some(sum.deep_clone()?));
                b.set_grad(Some(sum));
            }
            return Ok(());
        }
        let Some(group) = &self.tied_group else {
            return Ok(());
        };
        for p in self.tied_first.iter().chain(&self.tied_last) {
            let sum = group
                .all_reduce(&grad_or_zeros(p)?, ReduceOp::Sum)?
                .wait()?;
            p.set_grad(Some(sum));
        }
        Ok(())
    }

    /// Reference mode's [`PipelineGrads::reduce_tied_grads`], from each microbatch's own
    /// gradients of the tied copies: `first[m][k]` is microbatch `m`'s gradient of tied
    /// parameter `k` on virtual stage 0, `last[m][k]` the last virtual stage's (on a rank
    /// without such a copy, no list or empty lists). One device's backward of a microbatch adds
    /// the two uses of the table once, elementwise (the head's contribution and the embedding's
    /// are the table's two pending gradients, and float addition commutes), before the
    /// microbatches are summed over their aligned binary tree. So here: the last rank sends its
    /// per-microbatch gradients to the first (on their two-rank group), which adds each
    /// microbatch's pair, sums the microbatches over the aligned binary tree (as
    /// [`tree_sum`](meshgrad_tensor::tree_sum::tree_sum)) and sends the sum back: both copies get the
    /// bits of one device's tree over the same microbatches. Memory: the first and the last rank
    /// keep one table per microbatch until then.
    pub fn reduce_tied_grads_by_microbatch(
        &self,
        first: &[Vec<Option<Tensor>>],
        last: &[Vec<Option<Tensor>>],
    ) -> Result<()> {
        let k = self.tied_first.len().max(self.tied_last.len());
        if k == 0 {
            return Ok(());
        }
        // Microbatch m's gradient of tied parameter i: the head's plus the embedding's.
        let pair = |a: Option<Tensor>, b: Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match (a, b) {
                (Some(a), Some(b)) => Some(a.add(&b)?),
                (a, None) => a,
                (None, b) => b,
            })
        };
        let total = |mb: Vec<Vec<Option<Tensor>>>, i: usize, p: &Var| -> Result<Tensor> {
            let parts: Vec<Option<Tensor>> = mb.into_iter().map(|g| g[i].clone()).collect();
            match tree_sum_options(&parts)? {
                Some(t) => Ok(t),
                None => p.tensor().zeros_like(),
            }
        };
        let check = |what: &str, g: &[Vec<Option<Tensor>>], n: usize| -> Result<()> {
            if g.iter().any(|v| v.len() != n) {
                meshgrad_tensor::bail!(
                    "pipeline: {what} per-microbatch tied gradients: expected {n} per microbatch"
                );
            }
            Ok(())
        };
        check("the first stage's", first, self.tied_first.len())?;
        check("the last stage's", last, self.tied_last.len())?;
        let local = !self.tied_first.is_empty() && !self.tied_last.is_empty();
        if local {
            if first.len() != last.len() {
                meshgrad_tensor::bail!(
                    "pipeline: {} microbatches' tied gradients on the first stage, {} on the last",
                    first.len(),
                    last.len()
                );
            }
            let sums = first
                .iter()
                .zip(last)
                .map(|(f, l)| {
                    f.iter()
                        .zip(l)
                        .map(|(a, b)| pair(a.clone(), b.clone()))
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            for (i, (a, b)) in self.tied_first.iter().zip(&self.tied_last).enumerate() {
                let sum = total(sums.clone(), i, a)?;
                a.set_grad(Some(sum.deep_clone()?));
                b.set_grad(Some(sum));
            }
            return Ok(());
        }
        let Some(group) = &self.tied_group else {
            return Ok(());
        };
        if !self.tied_last.is_empty() {
            // The last rank: its microbatch count and gradients to the first (zeros for a
            // missing one), the sums back.
            group
                .send(
                    &Tensor::from_vec(vec![last.len() as f64], 1, meshgrad_tensor::Device::Cpu)?,
                    0,
                )?
                .wait()?;
            for g in last {
                for (i, t) in g.iter().enumerate() {
                    let t = match t {
                        Some(t) => t.clone(),
                        None => self.tied_last[i].tensor().zeros_like()?,
                    };
                    group.send(&t, 0)?.wait()?;
                }
            }
            for p in &self.tied_last {
                p.set_grad(Some(group.recv(0)?.wait()?));
            }
            return Ok(());
        }
        let n_last = group.recv(1)?.wait()?.to_vec::<f64>()?[0] as usize;
        if n_last != first.len() {
            meshgrad_tensor::bail!(
                "pipeline: {} microbatches' tied gradients on the first stage, {n_last} on the last",
                first.len()
            );
        }
        let mut sums = Vec::with_capacity(first.len());
        for f in first {
            let mut per = Vec::with_capacity(f.len());
            for a in f {
                per.push(pair(Some(group.recv(1)?.wait()?), a.clone())?);
            }
            sums.push(per);
        }
        for (i, p) in self.tied_first.iter().enumerate() {
            let sum = total(sums.clone(), i, p)?;
            group.send(&sum, 1)?.wait()?;
            p.set_grad(Some(sum));
        }
        Ok(())
    }

    /// Reference mode's squared gradient norm across the pipeline (after the tied gradients
    /// are reduced): this rank's parameters' squares, the tied table once, as an order-free
    /// [`ExactSum`] whose words are all-reduced over the pipeline group (exact in any order).
    /// With `apart` (parameters that differ across a group, e.g. the experts under expert
    /// parallelism, and that group), their squares are summed over the group first.
    pub fn exact_grad_sq_sum(&self, apart: Option<ApartParams<'_>>) -> Result<ExactSum> {
        use meshgrad_autograd::distributed::exact_grad_squares;
        // Parameters split by tensor parallelism are combined over their group first.
        let (mine, theirs) = self.split_apart(apart);
        let mut local = exact_grad_squares(&mine)?;
        if let Some(a) = apart {
            local.merge(&exact_sq_sum_over(&theirs, a.group)?);
        }
        self.exact_sum_over_pipeline(&local)
    }

    /// The counted parameters ([`Self::counted`]) split into those not in `apart` and those in.
    fn split_apart(&self, apart: Option<ApartParams<'_>>) -> (Vec<Var>, Vec<Var>) {
        let counted = self.counted();
        match apart {
            None => (counted, Vec::new()),
            Some(a) => counted
                .into_iter()
                .partition(|p| !a.params.iter().any(|q| q.id() == p.id())),
        }
    }

    /// `local` summed over the pipeline group, exactly (its words all-reduced).
    pub fn exact_sum_over_pipeline(&self, local: &ExactSum) -> Result<ExactSum> {
        if self.pp.world_size() == 1 {
            return Ok(local.clone());
        }
        let words = local.to_words();
        let n = words.len();
        let total = self
            .pp
            .all_reduce(
                &Tensor::from_vec(words, n, meshgrad_tensor::Device::Cpu)?,
                ReduceOp::Sum,
            )?
            .wait()?
            .to_vec::<f64>()?;
        ExactSum::from_words(&total)
    }

    /// This rank's parameters that count in the norm: all but the head's copy of the tied table.
    fn counted(&self) -> Vec<Var> {
        self.params
            .iter()
            .filter(|p| !self.tied_last.iter().any(|t| t.id() == p.id()))
            .cloned()
            .collect()
    }

    /// The pipeline group.
    pub(crate) fn pipeline_group(&self) -> &dyn Communicator {
        self.pp.as_ref()
    }

    /// Every local chunk's parameters.
    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// Whether the parameter `name` is one of this rank's tied copies that the global norm
    /// leaves out (the head's copy of a table the first stage also holds): what a sharded norm
    /// must skip too.
    pub fn is_left_out_of_norm(&self, name: &str) -> bool {
        self.tied_last_names.iter().any(|s| s == name)
    }

    /// The global gradient norm across the pipeline (the tied table counted once), after
    /// [`PipelineGrads::reduce_tied_grads`]; a collective on the pipeline group.
    /// With `apart`, those parameters' squares are summed over its group first (see
    /// [`ApartParams`]).
    pub fn grad_norm(&self, apart: Option<ApartParams<'_>>) -> Result<f64> {
        let (mine, theirs) = self.split_apart(apart);
        let mut local = grad_sq_sum(&mine)?;
        if let Some(a) = apart {
            local += all_reduce_scalar(a.group, grad_sq_sum(&theirs)?, ReduceOp::Sum)?;
        }
        Ok(all_reduce_scalar(self.pp.as_ref(), local, ReduceOp::Sum)?.sqrt())
    }

    /// Sums the tied gradients, clips the global norm to `clip` (when given) and steps
    /// `optimizer` (over this rank's chunks' parameters) with learning rate `lr`. Returns the
    /// norm before clipping when clipping.
    pub fn step(
        &self,
        optimizer: &mut dyn Optimizer,
        clip: Option<f64>,
        lr: f64,
    ) -> Result<Option<f64>> {
        self.reduce_tied_grads()?;
        let norm = match clip {
            Some(c) => {
                let norm = self.grad_norm(None)?;
                clip_grads_with_norm(&self.params, c, norm)?;
                Some(norm)
            }
            None => None,
        };
        optimizer.step(lr)?;
        Ok(norm)
    }
}

/// The exact sum of squares of `params`' gradients summed over `group` (its words
/// all-reduced: exact in any order): the squares of parameters each rank of `group` holds
/// its own of ([`ApartParams`]).
pub fn exact_sq_sum_over(params: &[Var], group: &dyn Communicator) -> Result<ExactSum> {
    let words = meshgrad_autograd::distributed::exact_grad_squares(params)?.to_words();
    let n = words.len();
    let t = Tensor::from_vec(words, n, meshgrad_tensor::Device::Cpu)?;
    let summed = group.all_reduce(&t, ReduceOp::Sum)?.wait()?;
    ExactSum::from_words(&summed.to_vec::<f64>()?)
}

/// Parameters whose values differ across the ranks of `group` (each rank holds its own, e.g.
/// its block of a mixture of experts' experts under expert parallelism): a gradient norm sums
/// their squares over the group, where the other parameters are the same on every rank of it.
#[derive(Clone, Copy)]
pub struct ApartParams<'a> {
    /// The parameters.
    pub params: &'a [Var],
    /// The ranks that hold different ones.
    pub group: &'a dyn Communicator,
}
