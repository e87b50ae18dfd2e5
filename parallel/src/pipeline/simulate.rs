//! The simulator: runs any [`Schedule`] against per-action costs, checks it, and measures it.
//!
//! # What is checked
//!
//! Every rank works through its list in order. A compute action runs as soon as the rank is free,
//! provided what it needs is already on the rank:
//!
//! * a forward of virtual stage `s > 0` needs the activation of `s - 1` (received by a matching
//!   [`Action::RecvActivation`], or computed on the same rank when `s - 1` lives there);
//! * a backward (full or input half) needs its own forward and, unless `s` is the last virtual
//!   stage, the gradient from `s + 1` (received, or computed on the same rank);
//! * a weight backward needs the input backward of the same microbatch and chunk.
//!
//! A requirement that is not met when the rank reaches the action can never be met (only the
//! rank itself changes what it holds), so the schedule is rejected
//! ([`ScheduleError::Invalid`]), as it is for a forward or backward done twice (a full backward
//! after a split one counts), a send of something the rank has not computed or has already sent,
//! a transfer to the wrong rank or an index out of range.
//!
//! Transfers are rendezvous and grouped: a maximal run of consecutive transfers in a rank's list
//! is one group, posted at once (NCCL's `ncclGroupStart` / `ncclGroupEnd`, the executor's rule
//! too). A send and its receive complete together once both ranks have posted the groups that
//! hold them; the transfer starts when the later of the two was posted and takes the p2p cost,
//! and a rank leaves its group when every transfer in it has completed. So two ranks that send
//! to each other in one group each do not wait for one another, but a rank whose group waits
//! for a partner that sits behind a compute action of its own is blocked; when no rank can move
//! while actions remain, the run ends in [`ScheduleError::Deadlock`], which names every blocked
//! rank, the transfer it waits on and where its peer is. So every send must meet exactly one
//! receive. At the end every (microbatch, virtual stage) must have had exactly one forward and
//! its backward (one full backward, or one input and one weight backward), else
//! [`ScheduleError::Missing`].
//!
//! # What is measured
//!
//! * `makespan`: when the last rank finishes.
//! * `busy[p]`: the time rank `p` spends computing (transfers are not counted as busy).
//! * `bubble`: `1 - sum(busy) / (P * makespan)`, the idle fraction of the `P * makespan`
//!   rank-time (time blocked in or spent on transfers counts as idle).
//! * `peak_activations[p]`: the most (microbatch, chunk) pairs rank `p` holds between a forward
//!   and the end of the backward that frees its stashed activations: the full backward, or for a
//!   split backward the *input* backward (B). This is the 1F1B-style activation count.
//! * `peak_held[p]`: the same, counting until the *weight* backward (W) instead: after B, W still
//!   needs the chunk's saved layer inputs and the output gradients (a part of the activations,
//!   smaller than the whole stash, see the zero-bubble paper's memory table). Equal to
//!   `peak_activations` for schedules without split backwards.
//!
//! A count goes up when a forward starts and down when the freeing backward ends.

use std::collections::HashSet;
use std::fmt;

use super::schedule::{Action, Schedule};

/// Per-action costs (time units). Every vector holds one figure per rank (pipeline stage), or a
/// single figure for all ranks; each chunk of a rank costs its rank's figure. A full backward
/// costs `backward_input + backward_weight`.
#[derive(Clone, Debug, PartialEq)]
pub struct Costs {
    /// Forward of one chunk on one microbatch.
    pub forward: Vec<f64>,
    /// Input-gradient backward (B).
    pub backward_input: Vec<f64>,
    /// Weight-gradient backward (W).
    pub backward_weight: Vec<f64>,
    /// One point-to-point transfer (0 for free communication).
    pub p2p: f64,
}

impl Costs {
    /// The same costs on every rank.
    pub fn uniform(forward: f64, backward_input: f64, backward_weight: f64, p2p: f64) -> Costs {
        Costs {
            forward: vec![forward],
            backward_input: vec![backward_input],
            backward_weight: vec![backward_weight],
            p2p,
        }
    }

    /// One figure per rank in each vector.
    pub fn per_stage(
        forward: Vec<f64>,
        backward_input: Vec<f64>,
        backward_weight: Vec<f64>,
        p2p: f64,
    ) -> Costs {
        Costs {
            forward,
            backward_input,
            backward_weight,
            p2p,
        }
    }

    fn pick(v: &[f64], rank: usize) -> f64 {
        if v.len() == 1 {
            v[0]
        } else {
            v[rank]
        }
    }

    /// The cost of compute `action` on `rank`.
    pub fn of(&self, action: &Action, rank: usize) -> f64 {
        let f = Self::pick(&self.forward, rank);
        let b = Self::pick(&self.backward_input, rank);
        let w = Self::pick(&self.backward_weight, rank);
        match action {
            Action::Forward { .. } => f,
            Action::Backward { .. } => b + w,
            Action::BackwardInput { .. } => b,
            Action::BackwardWeight { .. } => w,
            _ => self.p2p,
        }
    }
}

/// One executed action: what, and when.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slot {
    /// The action.
    pub action: Action,
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// What a run of the simulator measured (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Pipeline stages (ranks).
    pub stages: usize,
    /// Chunks per rank.
    pub chunks: usize,
    /// When the last rank finishes.
    pub makespan: f64,
    /// Compute time per rank.
    pub busy: Vec<f64>,
    /// Idle fraction: `1 - sum(busy) / (P * makespan)`.
    pub bubble: f64,
    /// Peak (microbatch, chunk) activations held per rank, freed by the full or input backward.
    pub peak_activations: Vec<usize>,
    /// Peak (microbatch, chunk) pairs per rank whose weight backward is still to come.
    pub peak_held: Vec<usize>,
    /// Every rank's executed actions (compute and transfers) with their times, in order.
    pub timeline: Vec<Vec<Slot>>,
}

impl SimReport {
    /// The largest of `peak_activations`.
    pub fn max_peak_activations(&self) -> usize {
        self.peak_activations.iter().copied().max().unwrap_or(0)
    }

    /// The compute of the timeline as a grid, one line per time step of length `step` and one
    /// column per rank: each cell is the compute action covering the start of that step
    /// ([`Action::label`]: `F3`, `B3`, `W3`, `F3.1`) or `.` when the rank computes nothing then.
    /// Meant for costs that are multiples of `step` (a full backward of cost 2 fills two cells).
    pub fn grid(&self, step: f64) -> String {
        let steps = (self.makespan / step - 1e-9).ceil().max(0.0) as usize;
        let cells: Vec<Vec<String>> = (0..steps)
            .map(|i| {
                let t = (i as f64 + 0.5) * step;
                self.timeline
                    .iter()
                    .map(|slots| {
                        slots
                            .iter()
                            .find(|s| s.action.is_compute() && s.start <= t && t < s.end)
                            .map(|s| s.action.label(self.chunks))
                            .unwrap_or_else(|| ".".into())
                    })
                    .collect()
            })
            .collect();
        let heads: Vec<String> = (0..self.stages).map(|p| format!("rank{p}")).collect();
        let width = cells
            .iter()
            .flatten()
            .chain(&heads)
            .map(|c| c.len())
            .max()
            .unwrap_or(1);
        let tw = steps.saturating_sub(1).to_string().len().max(1);
        let mut out = String::new();
        let row = |first: &str, cols: &[String]| {
            let mut line = format!("{first:>tw$}");
            for c in cols {
                line.push_str(&format!("  {c:<width$}"));
            }
            line.trim_end().to_string()
        };
        out.push_str(&row("t", &heads));
        out.push('\n');
        for (i, r) in cells.iter().enumerate() {
            out.push_str(&row(&i.to_string(), r));
            out.push('\n');
        }
        out
    }
}

/// A rank blocked at a transfer when the schedule deadlocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// The blocked rank.
    pub rank: usize,
    /// Position of the action in the rank's list.
    pub index: usize,
    /// The transfer it is blocked on.
    pub action: Action,
    /// Where the peer is: its current action, or `None` when it has finished its list.
    pub peer_at: Option<Action>,
}

/// Why a schedule does not run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScheduleError {
    /// An action that can never run, or is not allowed.
    Invalid {
        /// The rank.
        rank: usize,
        /// Position in the rank's list.
        index: usize,
        /// The action.
        action: Action,
        /// Why.
        reason: String,
    },
    /// No rank can move while actions remain: every unfinished rank is waiting at a transfer
    /// whose partner is elsewhere.
    Deadlock {
        /// The blocked ranks.
        blocked: Vec<Blocked>,
    },
    /// Every list ran to its end, but these (microbatch, virtual stage) computations never
    /// happened.
    Missing {
        /// Descriptions such as `backward of mb 3 at virtual stage 1 (rank 1, chunk 0)`.
        what: Vec<String>,
    },
}

impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::Invalid {
                rank,
                index,
                action,
                reason,
            } => write!(f, "rank {rank}, action {index} ({action}): {reason}"),
            ScheduleError::Deadlock { blocked } => {
                let parts: Vec<String> = blocked
                    .iter()
                    .map(|b| {
                        let peer = b.action.peer().unwrap_or(b.rank);
                        let at = match &b.peer_at {
                            Some(a) => format!("rank {peer} is at {a}"),
                            None => format!("rank {peer} has finished"),
                        };
                        format!(
                            "rank {} blocked at action {} ({}; {at})",
                            b.rank, b.index, b.action
                        )
                    })
                    .collect();
                write!(f, "deadlock: {}", parts.join("; "))
            }
            ScheduleError::Missing { what } => {
                const SHOWN: usize = 4;
                write!(f, "incomplete schedule: missing ")?;
                f.write_str(&what[..what.len().min(SHOWN)].join(", "))?;
                if what.len() > SHOWN {
                    write!(f, " and {} more", what.len() - SHOWN)?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ScheduleError {}

/// What the ranks hold and have done, keyed by (microbatch, virtual stage).
#[derive(Default)]
struct State {
    forward: HashSet<(usize, usize)>,
    input_grad: HashSet<(usize, usize)>,
    weight_grad: HashSet<(usize, usize)>,
    /// Activations received by the consuming stage.
    act_in: HashSet<(usize, usize)>,
    /// Gradients received by the consuming stage.
    grad_in: HashSet<(usize, usize)>,
    act_sent: HashSet<(usize, usize)>,
    grad_sent: HashSet<(usize, usize)>,
}

/// Runs `schedule` with `costs`: checks it and measures it (see the module docs).
///
/// # Panics
///
/// If `schedule.ranks` does not hold one list per stage, or a cost vector has neither one
/// figure nor one per stage.
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<SimReport, ScheduleError> {
    let p_ = schedule.stages;
    let s_ = schedule.virtual_stages();
    let m_ = schedule.microbatches;
    assert_eq!(schedule.ranks.len(), p_, "one action list per stage");
    for v in [
        &costs.forward,
        &costs.backward_input,
        &costs.backward_weight,
    ] {
        assert!(
            v.len() == 1 || v.len() == p_,
            "costs: one figure, or one per stage"
        );
    }
    let mut st = State::default();
    let mut pos = vec![0usize; p_];
    let mut free = vec![0f64; p_];
    let mut busy = vec![0f64; p_];
    let mut live = vec![0usize; p_];
    let mut held = vec![0usize; p_];
    let mut peak_activations = vec![0usize; p_];
    let mut peak_held = vec![0usize; p_];
    let mut timeline: Vec<Vec<Slot>> = vec![Vec::new(); p_];

    fn invalid<T>(
        rank: usize,
        index: usize,
        action: Action,
        reason: String,
    ) -> Result<T, ScheduleError> {
        Err(ScheduleError::Invalid {
            rank,
            index,
            action,
            reason,
        })
    }

    // Checks what `action` on `rank` may do, returning its virtual stage.
    let check_static = |rank: usize, index: usize, a: &Action| -> Result<usize, ScheduleError> {
        if a.microbatch() >= m_ {
            return invalid(rank, index, *a, format!("only {m_} microbatches"));
        }
        if a.chunk() >= schedule.chunks {
            return invalid(
                rank,
                index,
                *a,
                format!("only {} chunks per rank", schedule.chunks),
            );
        }
        let s = schedule.virtual_stage(rank, a.chunk());
        let want = match a {
            Action::SendActivation { .. } if s + 1 < s_ => Some(schedule.locate(s + 1).0),
            Action::RecvActivation { .. } if s > 0 => Some(schedule.locate(s - 1).0),
            Action::SendGradient { .. } if s > 0 => Some(schedule.locate(s - 1).0),
            Action::RecvGradient { .. } if s + 1 < s_ => Some(schedule.locate(s + 1).0),
            _ => None,
        };
        if let Some(peer) = a.peer() {
            match want {
                None => {
                    return invalid(
                        rank,
                        index,
                        *a,
                        format!("virtual stage {s} has no neighbour in that direction"),
                    )
                }
                Some(w) if w == rank => {
                    return invalid(
                        rank,
                        index,
                        *a,
                        format!("virtual stage {s}'s neighbour is on this rank: nothing to send"),
                    )
                }
                Some(w) if w != peer => {
                    return invalid(
                        rank,
                        index,
                        *a,
                        format!("the neighbour of virtual stage {s} is rank {w}, not {peer}"),
                    )
                }
                _ => {}
            }
        }
        Ok(s)
    };

    // Transfer groups: where the group a rank is in ends (exclusive), which of its transfers
    // have completed, and when the last of them did.
    let mut group_end: Vec<Option<usize>> = vec![None; p_];
    let mut done: Vec<Vec<bool>> = schedule
        .ranks
        .iter()
        .map(|l| vec![false; l.len()])
        .collect();
    let mut group_done_at = vec![0f64; p_];
    let group_from = |r: usize, start: usize| -> usize {
        let l = &schedule.ranks[r];
        let mut e = start;
        while e < l.len() && !l[e].is_compute() {
            e += 1;
        }
        e
    };
    // Whether `a` on rank `ra` and `b` on rank `rb` are the two ends of one transfer.
    let pair_matches = |ra: usize, a: &Action, rb: usize, b: &Action| -> bool {
        let (snd, sr, rcv, rr) = match a {
            Action::SendActivation { .. } | Action::SendGradient { .. } => (a, ra, b, rb),
            _ => (b, rb, a, ra),
        };
        match (*snd, *rcv) {
            (
                Action::SendActivation {
                    peer: to,
                    microbatch: m1,
                    chunk: c1,
                },
                Action::RecvActivation {
                    peer: from,
                    microbatch: m2,
                    chunk: c2,
                },
            ) => {
                to == rr
                    && from == sr
                    && m1 == m2
                    && schedule.virtual_stage(sr, c1) + 1 == schedule.virtual_stage(rr, c2)
            }
            (
                Action::SendGradient {
                    peer: to,
                    microbatch: m1,
                    chunk: c1,
                },
                Action::RecvGradient {
                    peer: from,
                    microbatch: m2,
                    chunk: c2,
                },
            ) => {
                to == rr
                    && from == sr
                    && m1 == m2
                    && schedule.virtual_stage(sr, c1) == schedule.virtual_stage(rr, c2) + 1
            }
            _ => false,
        }
    };

    loop {
        let mut progressed = false;
        for r in 0..p_ {
            while let Some(&a) = schedule.ranks[r].get(pos[r]) {
                let i = pos[r];
                let s = check_static(r, i, &a)?;
                let mb = a.microbatch();
                if a.is_compute() {
                    let same_rank = |t: usize| schedule.locate(t).0 == r;
                    let reason = match a {
                        Action::Forward { .. } => {
                            if st.forward.contains(&(mb, s)) {
                                Some("forward done twice".to_string())
                            } else if s > 0
                                && !(if same_rank(s - 1) {
                                    st.forward.contains(&(mb, s - 1))
                                } else {
                                    st.act_in.contains(&(mb, s))
                                })
                            {
                                Some(format!(
                                    "the input activation from virtual stage {} is not here",
                                    s - 1
                                ))
                            } else {
                                None
                            }
                        }
                        Action::Backward { .. } | Action::BackwardInput { .. } => {
                            if st.input_grad.contains(&(mb, s)) {
                                Some("backward done twice".to_string())
                            } else if !st.forward.contains(&(mb, s)) {
                                Some("backward before its forward".to_string())
                            } else if s + 1 < s_
                                && !(if same_rank(s + 1) {
                                    st.input_grad.contains(&(mb, s + 1))
                                } else {
                                    st.grad_in.contains(&(mb, s))
                                })
                            {
                                Some(format!(
                                    "the output gradient from virtual stage {} is not here",
                                    s + 1
                                ))
                            } else {
                                None
                            }
                        }
                        _ => {
                            if st.weight_grad.contains(&(mb, s)) {
                                Some("weight backward done twice".to_string())
                            } else if !st.input_grad.contains(&(mb, s)) {
                                Some("weight backward before the input backward".to_string())
                            } else {
                                None
                            }
                        }
                    };
                    if let Some(reason) = reason {
                        return invalid(r, i, a, reason);
                    }
                    let start = free[r];
                    let end = start + costs.of(&a, r);
                    free[r] = end;
                    busy[r] += end - start;
                    timeline[r].push(Slot {
                        action: a,
                        start,
                        end,
                    });
                    match a {
                        Action::Forward { .. } => {
                            st.forward.insert((mb, s));
                            live[r] += 1;
                            held[r] += 1;
                            peak_activations[r] = peak_activations[r].max(live[r]);
                            peak_held[r] = peak_held[r].max(held[r]);
                        }
                        Action::Backward { .. } => {
                            st.input_grad.insert((mb, s));
                            st.weight_grad.insert((mb, s));
                            live[r] -= 1;
                            held[r] -= 1;
                        }
                        Action::BackwardInput { .. } => {
                            st.input_grad.insert((mb, s));
                            live[r] -= 1;
                        }
                        _ => {
                            st.weight_grad.insert((mb, s));
                            held[r] -= 1;
                        }
                    }
                    pos[r] += 1;
                    progressed = true;
                    continue;
                }
                // A transfer: the rank posts its whole group (the consecutive transfers from
                // here) at once, as NCCL's grouped send/recv does.
                if group_end[r].is_none() {
                    let e = group_from(r, i);
                    for j in i..e {
                        let b = schedule.ranks[r][j];
                        let sj = check_static(r, j, &b)?;
                        let ready = match b {
                            Action::SendActivation { .. } => {
                                st.forward.contains(&(b.microbatch(), sj))
                            }
                            Action::SendGradient { .. } => {
                                st.input_grad.contains(&(b.microbatch(), sj))
                            }
                            _ => true,
                        };
                        if !ready {
                            return invalid(
                                r,
                                j,
                                b,
                                "sends what this rank has not computed".into(),
                            );
                        }
                    }
                    group_end[r] = Some(e);
                    group_done_at[r] = free[r];
                }
                let e = group_end[r].unwrap_or(i);
                for j in i..e {
                    if done[r][j] {
                        continue;
                    }
                    let b = schedule.ranks[r][j];
                    let peer = b.peer().unwrap_or(r);
                    let Some(pe) = group_end[peer] else {
                        continue;
                    };
                    let Some(k) = (pos[peer]..pe).find(|&k| {
                        !done[peer][k] && pair_matches(r, &b, peer, &schedule.ranks[peer][k])
                    }) else {
                        continue;
                    };
                    let other = schedule.ranks[peer][k];
                    let is_send = matches!(
                        b,
                        Action::SendActivation { .. } | Action::SendGradient { .. }
                    );
                    let (snd, snd_rank, snd_index, rcv_rank, rcv_index) = if is_send {
                        (b, r, j, peer, k)
                    } else {
                        (other, peer, k, r, j)
                    };
                    let snd_stage = schedule.virtual_stage(snd_rank, snd.chunk());
                    let rcv_stage = schedule
                        .virtual_stage(rcv_rank, schedule.ranks[rcv_rank][rcv_index].chunk());
                    let mb = b.microbatch();
                    let fresh = match snd {
                        Action::SendActivation { .. } => {
                            st.act_in.insert((mb, rcv_stage));
                            st.act_sent.insert((mb, snd_stage))
                        }
                        _ => {
                            st.grad_in.insert((mb, rcv_stage));
                            st.grad_sent.insert((mb, snd_stage))
                        }
                    };
                    if !fresh {
                        return invalid(snd_rank, snd_index, snd, "sent twice".into());
                    }
                    let t0 = free[r].max(free[peer]);
                    let t1 = t0 + costs.p2p;
                    for (rank, act) in [(r, b), (peer, other)] {
                        timeline[rank].push(Slot {
                            action: act,
                            start: t0,
                            end: t1,
                        });
                        group_done_at[rank] = group_done_at[rank].max(t1);
                    }
                    done[r][j] = true;
                    done[peer][k] = true;
                    progressed = true;
                }
                if (i..e).all(|j| done[r][j]) {
                    free[r] = group_done_at[r];
                    pos[r] = e;
                    group_end[r] = None;
                    progressed = true;
                    continue;
                }
                break;
            }
        }
        if !progressed {
            break;
        }
    }

    // Where each rank waits: the first transfer of its group that has not completed.
    let waiting =
        |r: usize| -> Option<usize> { (pos[r]..schedule.ranks[r].len()).find(|&j| !done[r][j]) };
    let blocked: Vec<Blocked> = (0..p_)
        .filter_map(|r| {
            waiting(r).map(|index| {
                let action = schedule.ranks[r][index];
                let peer = action.peer().unwrap_or(r);
                Blocked {
                    rank: r,
                    index,
                    action,
                    peer_at: waiting(peer).map(|j| schedule.ranks[peer][j]),
                }
            })
        })
        .collect();
    if !blocked.is_empty() {
        return Err(ScheduleError::Deadlock { blocked });
    }

    let mut missing = Vec::new();
    for s in 0..s_ {
        let (rank, chunk) = schedule.locate(s);
        for mb in 0..m_ {
            let place = format!("mb {mb} at virtual stage {s} (rank {rank}, chunk {chunk})");
            if !st.forward.contains(&(mb, s)) {
                missing.push(format!("forward of {place}"));
            }
            if !st.input_grad.contains(&(mb, s)) {
                missing.push(format!("backward of {place}"));
            } else if !st.weight_grad.contains(&(mb, s)) {
                missing.push(format!("weight backward of {place}"));
            }
        }
    }
    if !missing.is_empty() {
        return Err(ScheduleError::Missing { what: missing });
    }

    let makespan = free.iter().copied().fold(0.0, f64::max);
    let total: f64 = busy.iter().sum();
    let bubble = if makespan > 0.0 {
        1.0 - total / (p_ as f64 * makespan)
    } else {
        0.0
    };
    Ok(SimReport {
        stages: p_,
        chunks: schedule.chunks,
        makespan,
        busy,
        bubble,
        peak_activations,
        peak_held,
        timeline,
    })
}
