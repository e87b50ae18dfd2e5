//! Pipeline schedules as data: for every rank an ordered list of [`Action`]s, and the generators
//! [`Schedule::gpipe`], [`Schedule::one_f_one_b`], [`Schedule::interleaved`] and
//! [`Schedule::zero_bubble`].
//!
//! # Stages, chunks and virtual stages
//!
//! The model is cut into `stages * chunks` pieces, the *virtual stages*. With `P` stages (ranks)
//! and `V` chunks per rank, chunk `c` of rank `p` is virtual stage `c * P + p` (Megatron's
//! interleaving); with one chunk the virtual stages are the ranks. A microbatch goes forward
//! through the virtual stages in order: the activation computed by virtual stage `s` is sent to
//! the rank holding `s + 1`, and the gradient with respect to the input of `s + 1` comes back.
//! When both virtual stages sit on the same rank (only with one rank and several chunks) nothing
//! is sent: the rank hands the tensor to itself.
//!
//! # Communication
//!
//! A [`Action::SendActivation`] / [`Action::RecvActivation`] (or gradient) pair is one
//! point-to-point transfer. Each side names its *own* chunk: the sender the chunk that produced
//! the tensor (virtual stage `s`), the receiver the chunk that consumes it (`s + 1` for an
//! activation, `s - 1` for a gradient), and each names the other rank as `peer`. The simulator
//! ([`simulate()`](super::simulate::simulate)) treats the pair as a rendezvous: a send completes
//! only once the peer has posted the matching receive, as a blocking send of a large message
//! does on a real backend.
//!
//! The generators order the transfers so that no schedule they build can deadlock under that
//! rule: they time the compute actions with unit costs (forward, input and weight backward 1,
//! full backward 2, transfers free), give every transfer the time its tensor is ready, and sort
//! each rank's list by one global key (time, then transfers before compute, then sender,
//! receiver, kind, microbatch, chunk). Both ends of a transfer see it at the same key, so the
//! transfer with the smallest pending key can always go ahead.
//!
//! The executor ([`execute()`](super::execute::execute)) runs transfers in *groups*, like
//! NCCL's `ncclGroupStart` / `ncclGroupEnd`: a maximal run of consecutive transfer actions in a
//! rank's list is one group; the executor posts every send and receive of the group, then waits
//! for all of them (the receives first, in list order, then the sends). A receive needs only its
//! sender to have posted; a rendezvous send completes when its receiver takes the message, which
//! the receiver does while waiting for its group's receives. So two ranks may send to each other
//! in the same step (each group holding a send to the other and the receive from it), which one
//! transfer at a time deadlocks under rendezvous, and grouping never blocks a rank that one
//! transfer at a time would not. The simulator does not model grouping: it checks the stricter
//! one-transfer-at-a-time rule above, so a schedule it accepts also runs grouped.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// One step of one rank's schedule. `microbatch` counts from 0, `chunk` is the rank's local
/// chunk (0 without interleaving).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of the rank's `chunk` on `microbatch`; keeps the activations for the backward.
    Forward {
        /// Microbatch index.
        microbatch: usize,
        /// Local chunk.
        chunk: usize,
    },
    /// Full backward: input gradient and weight gradient together (costs B + W).
    Backward {
        /// Microbatch index.
        microbatch: usize,
        /// Local chunk.
        chunk: usize,
    },
    /// The input-gradient half of a split backward ("B" in the zero-bubble paper): all the
    /// previous stage needs.
    BackwardInput {
        /// Microbatch index.
        microbatch: usize,
        /// Local chunk.
        chunk: usize,
    },
    /// The weight-gradient half of a split backward ("W"): needs the chunk's
    /// [`Action::BackwardInput`] on the same microbatch first; nobody waits for it.
    BackwardWeight {
        /// Microbatch index.
        microbatch: usize,
        /// Local chunk.
        chunk: usize,
    },
    /// Send the activation computed by `chunk` on `microbatch` to `peer`.
    SendActivation {
        /// The receiving rank.
        peer: usize,
        /// Microbatch index.
        microbatch: usize,
        /// The sender's chunk that produced the activation.
        chunk: usize,
    },
    /// Receive from `peer` the input activation of `chunk` on `microbatch`.
    RecvActivation {
        /// The sending rank.
        peer: usize,
        /// Microbatch index.
        microbatch: usize,
        /// The receiver's chunk that consumes the activation.
        chunk: usize,
    },
    /// Send the gradient with respect to the input of `chunk` on `microbatch` to `peer`.
    SendGradient {
        /// The receiving rank.
        peer: usize,
        /// Microbatch index.
        microbatch: usize,
        /// The sender's chunk whose input gradient this is.
        chunk: usize,
    },
    /// Receive from `peer` the gradient with respect to the output of `chunk` on `microbatch`.
    RecvGradient {
        /// The sending rank.
        peer: usize,
        /// Microbatch index.
        microbatch: usize,
        /// The receiver's chunk that consumes the gradient.
        chunk: usize,
    },
}

impl Action {
    /// The microbatch the action is about.
    pub fn microbatch(&self) -> usize {
        match *self {
            Action::Forward { microbatch, .. }
            | Action::Backward { microbatch, .. }
            | Action::BackwardInput { microbatch, .. }
            | Action::BackwardWeight { microbatch, .. }
            | Action::SendActivation { microbatch, .. }
            | Action::RecvActivation { microbatch, .. }
            | Action::SendGradient { microbatch, .. }
            | Action::RecvGradient { microbatch, .. } => microbatch,
        }
    }

    /// The rank-local chunk the action is about.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. }
            | Action::SendActivation { chunk, .. }
            | Action::RecvActivation { chunk, .. }
            | Action::SendGradient { chunk, .. }
            | Action::RecvGradient { chunk, .. } => chunk,
        }
    }

    /// The other rank of a transfer; `None` for compute.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Action::SendActivation { peer, .. }
            | Action::RecvActivation { peer, .. }
            | Action::SendGradient { peer, .. }
            | Action::RecvGradient { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// Forward or (part of a) backward, as opposed to a transfer.
    pub fn is_compute(&self) -> bool {
        self.peer().is_none()
    }

    /// A short label for grids: `F3`, `B3` (full or input backward), `W3`; with `chunks > 1`
    /// the chunk follows a dot (`F3.1`). Transfers: `>a3` / `<a3` (send / receive an
    /// activation), `>g3` / `<g3` (gradient).
    pub fn label(&self, chunks: usize) -> String {
        let tag = match self {
            Action::Forward { .. } => "F",
            Action::Backward { .. } | Action::BackwardInput { .. } => "B",
            Action::BackwardWeight { .. } => "W",
            Action::SendActivation { .. } => ">a",
            Action::RecvActivation { .. } => "<a",
            Action::SendGradient { .. } => ">g",
            Action::RecvGradient { .. } => "<g",
        };
        if chunks > 1 {
            format!("{tag}{}.{}", self.microbatch(), self.chunk())
        } else {
            format!("{tag}{}", self.microbatch())
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mb, c) = (self.microbatch(), self.chunk());
        match *self {
            Action::Forward { .. } => write!(f, "forward(mb {mb}, chunk {c})"),
            Action::Backward { .. } => write!(f, "backward(mb {mb}, chunk {c})"),
            Action::BackwardInput { .. } => write!(f, "backward-input(mb {mb}, chunk {c})"),
            Action::BackwardWeight { .. } => write!(f, "backward-weight(mb {mb}, chunk {c})"),
            Action::SendActivation { peer, .. } => {
                write!(f, "send activation(mb {mb}, chunk {c}) to rank {peer}")
            }
            Action::RecvActivation { peer, .. } => {
                write!(f, "recv activation(mb {mb}, chunk {c}) from rank {peer}")
            }
            Action::SendGradient { peer, .. } => {
                write!(f, "send gradient(mb {mb}, chunk {c}) to rank {peer}")
            }
            Action::RecvGradient { peer, .. } => {
                write!(f, "recv gradient(mb {mb}, chunk {c}) from rank {peer}")
            }
        }
    }
}

/// Which generator built a schedule (or [`ScheduleKind::Custom`] for a hand-made one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all (full) backwards ("simple" in SageMaker).
    GPipe,
    /// One forward, one backward (PipeDream-Flush).
    OneFOneB,
    /// Megatron's interleaved 1F1B over several chunks per rank.
    Interleaved,
    /// Zero-bubble, in the style of ZB-H1: split backward, weight gradients fill the bubbles.
    ZeroBubble,
    /// Built by hand.
    Custom,
}

impl FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" => Ok(ScheduleKind::Interleaved),
            "zb" => Ok(ScheduleKind::ZeroBubble),
            _ => Err(format!(
                "unknown schedule kind {s:?} (expected gpipe, 1f1b, interleaved or zb)"
            )),
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubble => "zb",
            ScheduleKind::Custom => "custom",
        })
    }
}

/// Bad generator arguments (no stages, no microbatches, ...): a one-line message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleArgError(pub String);

impl fmt::Display for ScheduleArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ScheduleArgError {}

/// A pipeline schedule: `ranks[p]` is what rank `p` does, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The generator that built it.
    pub kind: ScheduleKind,
    /// Pipeline stages = ranks (`P`).
    pub stages: usize,
    /// Microbatches per step (`M`).
    pub microbatches: usize,
    /// Model chunks per rank (`V`; 1 without interleaving).
    pub chunks: usize,
    /// Each rank's actions, in order.
    pub ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// `stages * chunks`.
    pub fn virtual_stages(&self) -> usize {
        self.stages * self.chunks
    }

    /// The virtual stage of `rank`'s `chunk`: `chunk * stages + rank`.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// The rank holding virtual stage `stage`, and its chunk there.
    pub fn locate(&self, stage: usize) -> (usize, usize) {
        (stage % self.stages, stage / self.stages)
    }

    /// For each of `rank`'s chunks, the microbatch of its last action that adds to the weight
    /// gradients ([`Action::Backward`] or [`Action::BackwardWeight`]; `None` for a chunk
    /// without one). A data-parallel reduction that overlaps the backward starts with that
    /// action: nothing adds to the chunk's gradients after it.
    pub fn last_weight_gradients(&self, rank: usize) -> Vec<Option<usize>> {
        let mut last = vec![None; self.chunks];
        for a in self.ranks.get(rank).map_or(&[][..], Vec::as_slice) {
            if let Action::Backward { microbatch, chunk }
            | Action::BackwardWeight { microbatch, chunk } = *a
            {
                if let Some(l) = last.get_mut(chunk) {
                    *l = Some(microbatch);
                }
            }
        }
        last
    }

    /// The schedule `kind` builds (`chunks` only for [`ScheduleKind::Interleaved`]; the others
    /// refuse anything but `None` or `Some(1)`; interleaved defaults to 2 chunks).
    pub fn generate(
        kind: ScheduleKind,
        stages: usize,
        microbatches: usize,
        chunks: Option<usize>,
    ) -> Result<Schedule, ScheduleArgError> {
        if kind != ScheduleKind::Interleaved && chunks.is_some_and(|v| v != 1) {
            return Err(ScheduleArgError(format!(
                "--chunks is only for the interleaved schedule, not {kind}"
            )));
        }
        match kind {
            ScheduleKind::GPipe => Schedule::gpipe(stages, microbatches),
            ScheduleKind::OneFOneB => Schedule::one_f_one_b(stages, microbatches),
            ScheduleKind::Interleaved => {
                Schedule::interleaved(stages, microbatches, chunks.unwrap_or(2))
            }
            ScheduleKind::ZeroBubble => Schedule::zero_bubble(stages, microbatches),
            ScheduleKind::Custom => Err(ScheduleArgError(
                "a custom schedule is built by hand, not generated".into(),
            )),
        }
    }

    /// GPipe: every rank runs all its forwards (microbatches 0..M), then all its full backwards
    /// (0..M). Every rank holds all M microbatches' activations at its peak.
    pub fn gpipe(stages: usize, microbatches: usize) -> Result<Schedule, ScheduleArgError> {
        check_sizes(stages, microbatches, 1)?;
        let orders = (0..stages)
            .map(|_| {
                let mut o: Vec<Action> = (0..microbatches).map(|m| fwd(m, 0)).collect();
                o.extend((0..microbatches).map(|m| bwd(m, 0)));
                o
            })
            .collect();
        Ok(assemble(
            ScheduleKind::GPipe,
            stages,
            microbatches,
            1,
            orders,
        ))
    }

    /// 1F1B (PipeDream-Flush): rank `p` runs `min(P - 1 - p, M)` warm-up forwards, then
    /// alternates one forward and one full backward, then runs the remaining backwards
    /// (cool-down). Rank `p` holds at most `min(P - p, M)` microbatches' activations.
    pub fn one_f_one_b(stages: usize, microbatches: usize) -> Result<Schedule, ScheduleArgError> {
        check_sizes(stages, microbatches, 1)?;
        let orders = (0..stages)
            .map(|p| {
                let warmup = (stages - 1 - p).min(microbatches);
                one_f_one_b_order(warmup, microbatches, |k| fwd(k, 0), |k| bwd(k, 0))
            })
            .collect();
        Ok(assemble(
            ScheduleKind::OneFOneB,
            stages,
            microbatches,
            1,
            orders,
        ))
    }

    /// Megatron's interleaved 1F1B with `chunks` (V) model chunks per rank; needs `M` divisible
    /// by `P`. Rank `p` walks through its `M * V` (microbatch, chunk) forwards in Megatron's
    /// order (groups of `P` microbatches, chunk by chunk: the `k`-th is chunk `(k / P) % V` of
    /// microbatch `(k / (P V)) P + k % P`) and its backwards in the same order with the chunks
    /// reversed, with `(P - 1 - p) * 2 + (V - 1) * P` warm-up forwards (all of them when that
    /// reaches `M * V`; with `V = 1`, 1F1B's `P - 1 - p`), then one forward one full backward,
    /// then the cool-down backwards.
    ///
    /// With unit chunk costs and free transfers the simulator gives Megatron's bubble,
    /// `(P - 1) / (V M + P - 1)`, for P = 1, 3, 4 (tested up to M = 16, V = 4). With P = 2 it
    /// does not: both directions of the ring join the same two ranks, and under rendezvous
    /// transfers a rank that finishes a chunk waits for the other to finish its own (Megatron
    /// overlaps them with batched non-blocking send/receive, which these actions do not model),
    /// so the bubble is larger, above 1F1B's (7/31 for M = 4, V = 2).
    pub fn interleaved(
        stages: usize,
        microbatches: usize,
        chunks: usize,
    ) -> Result<Schedule, ScheduleArgError> {
        check_sizes(stages, microbatches, chunks)?;
        if !microbatches.is_multiple_of(stages) {
            return Err(ScheduleArgError(format!(
                "the interleaved schedule needs the microbatches ({microbatches}) divisible by \
                 the stages ({stages})"
            )));
        }
        let (p_, v) = (stages, chunks);
        let total = microbatches * v;
        let mb_of = |k: usize| (k / (p_ * v)) * p_ + k % p_;
        let orders = (0..stages)
            .map(|p| {
                let warmup = if v == 1 {
                    p_ - 1 - p
                } else {
                    (p_ - 1 - p) * 2 + (v - 1) * p_
                };
                let warmup = warmup.min(total);
                one_f_one_b_order(
                    warmup,
                    total,
                    |k| fwd(mb_of(k), (k / p_) % v),
                    |k| bwd(mb_of(k), v - 1 - (k / p_) % v),
                )
            })
            .collect();
        Ok(assemble(
            ScheduleKind::Interleaved,
            stages,
            microbatches,
            chunks,
            orders,
        ))
    }

    /// A zero-bubble schedule in the style of ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline
    /// Parallelism"): every backward is split into [`Action::BackwardInput`] (B), which the
    /// previous stage waits for, and [`Action::BackwardWeight`] (W), which nobody waits for, so
    /// the W's can be moved into what would be bubbles.
    ///
    /// The order is built by list scheduling with unit costs (F = B = W = 1, free transfers):
    /// whenever rank `p` is free it runs, in this priority, the next forward if its input has
    /// arrived and the rank then holds at most `P - p` microbatches between their forward and
    /// their B (1F1B's activation bound for that rank) and at most `P` between their forward and
    /// their W; else the oldest B whose gradient has arrived; else the oldest pending W. So peak
    /// activations (forward to B) equal 1F1B's on every rank, and every rank holds at most `P`
    /// microbatches whose W is still to come (1F1B's rank 0 peak): the later stages delay their
    /// W's, as in ZB-H1. With F = B = W and `M >= P` the makespan is `3 M + P - 1` time units
    /// against 1F1B's `3 (M + P - 1)`: the bubble is a third of 1F1B's in time, `(P - 1) /
    /// (3 M + P - 1)` as a fraction (checked in the tests for several P and M).
    pub fn zero_bubble(stages: usize, microbatches: usize) -> Result<Schedule, ScheduleArgError> {
        check_sizes(stages, microbatches, 1)?;
        let (p_, m_) = (stages, microbatches);
        // End times of F and B per (rank, microbatch).
        let mut f_end = vec![vec![None::<u64>; m_]; p_];
        let mut b_end = vec![vec![None::<u64>; m_]; p_];
        let mut next_f = vec![0usize; p_];
        let mut next_b = vec![0usize; p_];
        let mut next_w = vec![0usize; p_];
        let mut busy_until = vec![0u64; p_];
        let mut orders: Vec<Vec<Action>> = vec![Vec::new(); p_];
        let mut t = 0u64;
        while (0..p_).any(|p| next_w[p] < m_) {
            for p in 0..p_ {
                if busy_until[p] > t {
                    continue;
                }
                let ready = |e: Option<u64>| e.is_some_and(|e| e <= t);
                let b = next_b[p];
                let b_ready =
                    b < next_f[p] && ready(f_end[p][b]) && (p + 1 == p_ || ready(b_end[p + 1][b]));
                let f = next_f[p];
                let f_ready = f < m_
                    && (p == 0 || ready(f_end[p - 1][f]))
                    && f - next_b[p] < p_ - p
                    && f - next_w[p] < p_;
                let w_ready = next_w[p] < next_b[p] && ready(b_end[p][next_w[p]]);
                if f_ready {
                    orders[p].push(fwd(f, 0));
                    f_end[p][f] = Some(t + 1);
                    next_f[p] += 1;
                } else if b_ready {
                    orders[p].push(Action::BackwardInput {
                        microbatch: b,
                        chunk: 0,
                    });
                    b_end[p][b] = Some(t + 1);
                    next_b[p] += 1;
                } else if w_ready {
                    orders[p].push(Action::BackwardWeight {
                        microbatch: next_w[p],
                        chunk: 0,
                    });
                    next_w[p] += 1;
                } else {
                    continue;
                }
                busy_until[p] = t + 1;
            }
            t += 1;
        }
        Ok(assemble(
            ScheduleKind::ZeroBubble,
            stages,
            microbatches,
            1,
            orders,
        ))
    }
}

fn fwd(microbatch: usize, chunk: usize) -> Action {
    Action::Forward { microbatch, chunk }
}

fn bwd(microbatch: usize, chunk: usize) -> Action {
    Action::Backward { microbatch, chunk }
}

fn check_sizes(stages: usize, microbatches: usize, chunks: usize) -> Result<(), ScheduleArgError> {
    if stages == 0 {
        return Err(ScheduleArgError("a pipeline needs at least 1 stage".into()));
    }
    if microbatches == 0 {
        return Err(ScheduleArgError(
            "a pipeline needs at least 1 microbatch".into(),
        ));
    }
    if chunks == 0 {
        return Err(ScheduleArgError(
            "a pipeline needs at least 1 chunk per stage".into(),
        ));
    }
    // Every microbatch of every chunk has up to three actions (forward, input backward, weight
    // backward) on its rank: bound their number before a list of them is allocated.
    let actions = stages
        .checked_mul(microbatches)
        .and_then(|n| n.checked_mul(chunks))
        .and_then(|n| n.checked_mul(3));
    match actions {
        Some(n) if n <= MAX_SCHEDULE_ACTIONS => Ok(()),
        _ => Err(ScheduleArgError(format!(
            "{stages} stages x {microbatches} microbatches x {chunks} chunk(s) is too large a \
             schedule: it would hold more than {MAX_SCHEDULE_ACTIONS} actions"
        ))),
    }
}

/// The most actions (forwards, backwards, weight backwards over all ranks) a generated schedule
/// may hold: `stages x microbatches x chunks x 3` is checked against it before anything is
/// allocated (4,194,304: for example 64 stages x 4,096 microbatches x 4 chunks, and far more
/// than any run needs).
pub const MAX_SCHEDULE_ACTIONS: usize = 1 << 22;

/// `warmup` forwards, then forward `warmup + k` and backward `k` for each `k`, then the
/// remaining backwards; `total` forwards and backwards in all.
fn one_f_one_b_order(
    warmup: usize,
    total: usize,
    f: impl Fn(usize) -> Action,
    b: impl Fn(usize) -> Action,
) -> Vec<Action> {
    let mut o: Vec<Action> = (0..warmup).map(&f).collect();
    for k in 0..total - warmup {
        o.push(f(warmup + k));
        o.push(b(k));
    }
    o.extend((total - warmup..total).map(&b));
    o
}

/// Unit cost of a compute action for the generators' timing.
fn unit_cost(a: &Action) -> u64 {
    match a {
        Action::Backward { .. } => 2,
        _ => 1,
    }
}

/// Adds the transfers to per-rank compute orders (see the module docs): times the compute with
/// unit costs and free, non-blocking transfers, then sorts each rank's compute and transfers by
/// one global key.
fn assemble(
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    chunks: usize,
    orders: Vec<Vec<Action>>,
) -> Schedule {
    let p_ = stages;
    let s_ = stages * chunks;
    // End time of F / of the input gradient (B or full backward), per (microbatch, stage).
    let mut f_end: HashMap<(usize, usize), u64> = HashMap::new();
    let mut g_end: HashMap<(usize, usize), u64> = HashMap::new();
    let mut start: Vec<Vec<u64>> = orders.iter().map(|o| vec![0; o.len()]).collect();
    let mut pos = vec![0usize; p_];
    let mut free = vec![0u64; p_];
    loop {
        let mut progressed = false;
        for p in 0..p_ {
            while let Some(a) = orders[p].get(pos[p]) {
                let (mb, s) = (a.microbatch(), a.chunk() * p_ + p);
                let dep = match a {
                    Action::Forward { .. } if s > 0 => f_end.get(&(mb, s - 1)).copied(),
                    Action::Forward { .. } => Some(0),
                    Action::Backward { .. } | Action::BackwardInput { .. } if s + 1 < s_ => {
                        g_end.get(&(mb, s + 1)).copied()
                    }
                    _ => Some(0),
                };
                let Some(dep) = dep else { break };
                let t0 = free[p].max(dep);
                let t1 = t0 + unit_cost(a);
                start[p][pos[p]] = t0;
                free[p] = t1;
                match a {
                    Action::Forward { .. } => {
                        f_end.insert((mb, s), t1);
                    }
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        g_end.insert((mb, s), t1);
                    }
                    _ => {}
                }
                pos[p] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    assert!(
        (0..p_).all(|p| pos[p] == orders[p].len()),
        "pipeline generator built an order that cannot run"
    );
    // (time, class: 0 transfer / 1 compute, sender, receiver, kind, microbatch, stage or index)
    type Key = (u64, u8, usize, usize, u8, usize, usize);
    let mut events: Vec<Vec<(Key, Action)>> = vec![Vec::new(); p_];
    for p in 0..p_ {
        for (i, a) in orders[p].iter().enumerate() {
            events[p].push(((start[p][i], 1, 0, 0, 0, 0, i), *a));
            let (mb, c) = (a.microbatch(), a.chunk());
            let s = c * p_ + p;
            let end = start[p][i] + unit_cost(a);
            match a {
                Action::Forward { .. } if s + 1 < s_ => {
                    let (q, cq) = ((s + 1) % p_, (s + 1) / p_);
                    if q != p {
                        let key = (end, 0, p, q, 0, mb, s);
                        events[p].push((
                            key,
                            Action::SendActivation {
                                peer: q,
                                microbatch: mb,
                                chunk: c,
                            },
                        ));
                        events[q].push((
                            key,
                            Action::RecvActivation {
                                peer: p,
                                microbatch: mb,
                                chunk: cq,
                            },
                        ));
                    }
                }
                Action::Backward { .. } | Action::BackwardInput { .. } if s > 0 => {
                    let (q, cq) = ((s - 1) % p_, (s - 1) / p_);
                    if q != p {
                        let key = (end, 0, p, q, 1, mb, s);
                        events[p].push((
                            key,
                            Action::SendGradient {
                                peer: q,
                                microbatch: mb,
                                chunk: c,
                            },
                        ));
                        events[q].push((
                            key,
                            Action::RecvGradient {
                                peer: p,
                                microbatch: mb,
                                chunk: cq,
                            },
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    let ranks = events
        .into_iter()
        .map(|mut e| {
            e.sort_by_key(|(k, _)| *k);
            e.into_iter().map(|(_, a)| a).collect()
        })
        .collect();
    Schedule {
        kind,
        stages,
        microbatches,
        chunks,
        ranks,
    }
}
