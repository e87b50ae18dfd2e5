//! Timelines of a real pipeline run: what each rank did and when, written as a Chrome trace and
//! measured against the simulator.
//!
//! A [`Timeline`] belongs to one rank. The executor wraps every action in
//! [`Timeline::record`] (forward, backward, send, receive) and the training loop wraps the
//! optimizer step; the spans keep wall-clock start and end times measured from one origin that
//! every rank of a run shares, so the ranks' spans line up. Every layout runs through the
//! executor (one without pipelining as one stage), so every layout has timelines; the layers'
//! own transfers (ring attention hops under context parallelism, the all-to-alls of expert
//! parallelism) are [`SpanKind::Collective`] spans nested in the pass that made them, recorded
//! through `meshgrad_autograd::distributed::Collectives::traced` by the groups
//! [`crate::tp::context_parallel_traced`] and [`crate::tp::expert_parallel_traced`] build.
//!
//! # Chrome trace
//!
//! [`write_chrome_trace`] writes the timelines in the Trace Event Format that
//! [Perfetto](https://ui.perfetto.dev) and `chrome://tracing` load ([`chrome_trace`] builds the
//! JSON value). All ranks are threads of one process (`pid` 0, `tid` = rank, named `rank N` by
//! `thread_name` metadata and ordered by `thread_sort_index`): Perfetto then shows the ranks as
//! adjacent tracks of one expanded group, one above the other on the same time axis, where one
//! process per rank would give each rank its own collapsed process group to open one by one.
//! Every span is a complete event (`"ph": "X"`, `ts` and `dur` in microseconds from the shared
//! origin) named by its label (`F3`, `<g3`) with its kind as `cat` (`forward`, `recv`, ...);
//! the gaps between a rank's spans, from the earliest start to the latest end over all ranks,
//! are complete events named and categorised `idle` (gaps under [`MIN_IDLE_S`] are left out).
//!
//! # Idle measurement
//!
//! [`measure_idle`] gives the measured counterpart of the simulator's
//! [`SimReport::bubble`](super::SimReport::bubble), defined the same way: over the window from
//! the earliest start to the latest end of the schedule's spans (every kind but
//! [`SpanKind::Optimizer`]) across the `P` ranks, the busy time of a rank is the time of its
//! forward and backward spans (full, input and weight halves; [`SpanKind::is_schedule_compute`]),
//! and
//!
//! ```text
//! idle = 1 - sum(busy) / (P * window)
//! ```
//!
//! so transfers, time blocked in a receive and gaps between actions all count as idle, as they
//! do in the simulator, whose makespan runs from the start of the step to the end of the last
//! rank's last action. The optimizer step is not part of a schedule: its spans neither count as
//! busy nor widen the window. Measure one step at a time, as the simulator does: clear the
//! timelines ([`Timeline::clear`]) before the step, or take the step's spans with
//! [`measure_idle_between`] (instants from [`Timeline::now_s`]); an optimizer step inside the
//! window would count as idle. [`measured_costs`] turns a timeline's mean forward and backward
//! times into per-stage [`Costs`] to simulate the same schedule with, for a side-by-side line.
//!
//! ## Shared cores skew the measured figure
//!
//! In-process ranks are threads, and the machines these tests run on have two cores shared by
//! all ranks (and by whatever else runs there). On a real model a rank's forward or backward is
//! CPU work, so when more ranks compute at once than there are cores, each compute span
//! stretches by the contention: the rank is counted busy while it waits for a core. That reads
//! as *less* idle than the schedule has on dedicated devices, and as longer spans: with 4 ranks
//! on 2 cores the steady phase of 1F1B, where every rank computes, runs at about half speed and
//! takes a larger share of the window than it would, while the ramps, where fewer ranks compute,
//! run closer to full speed, so their idle time weighs less. Per-stage costs taken from such a
//! run ([`measured_costs`]) are the contended ones, averaged over phases of different
//! contention, so a simulation with them only roughly reproduces the run. Kernels that use
//! several threads of their own skew it further. In the other direction, a rank woken by a
//! transfer may wait for a core before it goes on, which counts as idle. The measured figure is
//! then a measure of the machine's contention as much as of the schedule. Stages that *sleep*
//! instead of computing (`parallel/tests/pipeline_trace.rs`) do not compete for cores, so there
//! the measured idle isolates the executor's own overhead (transfers, bookkeeping, wake-ups):
//! on an otherwise idle machine it is within about 0.01 of the simulated bubble.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use meshgrad_tensor::Result;
use serde_json::{json, Value};

use super::simulate::Costs;

/// What a span of a [`Timeline`] was doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// A forward of one microbatch on one chunk.
    Forward,
    /// A full backward.
    Backward,
    /// The input-gradient half of a split backward.
    BackwardInput,
    /// The weight-gradient half of a split backward.
    BackwardWeight,
    /// A point-to-point send (or a group of them).
    Send,
    /// A point-to-point receive (or a group of them).
    Recv,
    /// The optimizer step (with the gradient reductions before it).
    Optimizer,
    /// A transfer of a layer's collective inside a forward or backward (a ring attention hop,
    /// an expert-parallel all-to-all), nested in that pass's span.
    Collective,
}

impl SpanKind {
    /// Lower-case name (`forward`, `backward-input`, `send`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Backward => "backward",
            SpanKind::BackwardInput => "backward-input",
            SpanKind::BackwardWeight => "backward-weight",
            SpanKind::Send => "send",
            SpanKind::Recv => "recv",
            SpanKind::Optimizer => "optimizer",
            SpanKind::Collective => "collective",
        }
    }

    /// Whether the span computes (forward, backward, optimizer) rather than waits on a transfer.
    pub fn is_compute(&self) -> bool {
        !matches!(self, SpanKind::Send | SpanKind::Recv | SpanKind::Collective)
    }

    /// Whether the span is a compute action of a schedule (forward, full backward, input or
    /// weight backward): the busy time of [`measure_idle`], as of the simulator's bubble. The
    /// optimizer step is not.
    pub fn is_schedule_compute(&self) -> bool {
        matches!(
            self,
            SpanKind::Forward
                | SpanKind::Backward
                | SpanKind::BackwardInput
                | SpanKind::BackwardWeight
        )
    }
}

/// One recorded span, in seconds from the timeline's origin.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// What it was.
    pub kind: SpanKind,
    /// A label naming the action (`F3`, `B3.1`, `send activation(mb 3, chunk 0) to rank 1`).
    pub label: String,
    /// Start, seconds after the origin.
    pub start_s: f64,
    /// End, seconds after the origin.
    pub end_s: f64,
}

/// The spans one rank recorded (cheap to clone: clones share the spans).
#[derive(Clone, Debug)]
pub struct Timeline {
    rank: usize,
    origin: Instant,
    spans: Arc<Mutex<Vec<Span>>>,
}

impl Timeline {
    /// An empty timeline of `rank`, timed from `origin` (give every rank of a run the same one).
    pub fn new(rank: usize, origin: Instant) -> Self {
        Timeline {
            rank,
            origin,
            spans: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// The rank it belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Seconds from the origin to now (to mark a step's start or end for
    /// [`measure_idle_between`]).
    pub fn now_s(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    /// Adds a span timed elsewhere (for example one of a simulated run, to trace it).
    pub fn push(&self, span: Span) {
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(span);
    }

    /// Runs `f` and records it as a span of `kind` labelled `label`.
    pub fn record<T>(&self, kind: SpanKind, label: impl Into<String>, f: impl FnOnce() -> T) -> T {
        let start = self.origin.elapsed().as_secs_f64();
        let out = f();
        let end = self.origin.elapsed().as_secs_f64();
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Span {
                kind,
                label: label.into(),
                start_s: start,
                end_s: end,
            });
        out
    }

    /// The spans recorded so far, in the order they ended.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets every span (for example after warm-up steps).
    pub fn clear(&self) {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Records `f` in `timeline` when there is one, else just runs it.
pub fn record_opt<T>(
    timeline: Option<&Timeline>,
    kind: SpanKind,
    label: impl FnOnce() -> String,
    f: impl FnOnce() -> T,
) -> T {
    match timeline {
        Some(t) => t.record(kind, label(), f),
        None => f(),
    }
}

/// A rank's spans sorted by start.
fn sorted_spans(timeline: &Timeline) -> Vec<Span> {
    let mut spans = timeline.spans();
    spans.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    spans
}

/// Gaps between a rank's spans shorter than this (one microsecond, the trace's unit) get no idle
/// event in a Chrome trace.
pub const MIN_IDLE_S: f64 = 1e-6;

/// Seconds as microseconds, rounded to the nanosecond (the clock's resolution).
fn micros(seconds: f64) -> f64 {
    (seconds * 1e9).round() / 1e3
}

/// The timelines as a Chrome trace (Trace Event Format) JSON value: one track per rank (`pid` 0,
/// `tid` = rank, named `rank N`), a complete event per span (`name` = label, `cat` = kind name)
/// and an `idle` complete event per gap between a rank's spans within the traced window (see the
/// [module docs](self)).
pub fn chrome_trace(timelines: &[Timeline]) -> Value {
    let ranks: Vec<(usize, Vec<Span>)> = timelines
        .iter()
        .map(|t| (t.rank(), sorted_spans(t)))
        .collect();
    let all = ranks.iter().flat_map(|(_, s)| s);
    let start = all.clone().map(|s| s.start_s).fold(f64::INFINITY, f64::min);
    let end = all.map(|s| s.end_s).fold(f64::NEG_INFINITY, f64::max);
    let mut events = vec![json!({
        "ph": "M", "pid": 0, "name": "process_name", "args": {"name": "meshgrad pipeline"}
    })];
    let idle = |rank: usize, from: f64, to: f64| {
        json!({
            "ph": "X", "pid": 0, "tid": rank, "name": "idle", "cat": "idle",
            "ts": micros(from), "dur": micros(to - from)
        })
    };
    for (rank, spans) in &ranks {
        let rank = *rank;
        events.push(json!({
            "ph": "M", "pid": 0, "tid": rank, "name": "thread_name",
            "args": {"name": format!("rank {rank}")}
        }));
        events.push(json!({
            "ph": "M", "pid": 0, "tid": rank, "name": "thread_sort_index",
            "args": {"sort_index": rank}
        }));
        let mut cursor = start;
        for s in spans {
            if s.start_s - cursor >= MIN_IDLE_S {
                events.push(idle(rank, cursor, s.start_s));
            }
            events.push(json!({
                "ph": "X", "pid": 0, "tid": rank, "name": s.label, "cat": s.kind.name(),
                "ts": micros(s.start_s), "dur": micros(s.end_s - s.start_s)
            }));
            cursor = cursor.max(s.end_s);
        }
        if end - cursor >= MIN_IDLE_S {
            events.push(idle(rank, cursor, end));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// [`chrome_trace`] as compact JSON text.
pub fn chrome_trace_json(timelines: &[Timeline]) -> String {
    chrome_trace(timelines).to_string()
}

/// Writes [`chrome_trace`] of `timelines` to `path` atomically (a temporary file in the same
/// directory, renamed over `path`), for Perfetto or `chrome://tracing`. A one-line error naming
/// `path` when it cannot be written; `path` is then left as it was.
pub fn write_chrome_trace(path: impl AsRef<Path>, timelines: &[Timeline]) -> Result<()> {
    meshgrad_nn::state::write_bytes_atomic(path, chrome_trace_json(timelines).as_bytes())
}

/// Idle time measured from the timelines of one step (see the [module docs](self)): the
/// counterpart of the simulator's [`SimReport::bubble`](super::SimReport::bubble).
#[derive(Clone, Debug, PartialEq)]
pub struct IdleReport {
    /// The ranks, in the order of the timelines given.
    pub ranks: Vec<usize>,
    /// Start of the window: the earliest start of a schedule span (seconds from the origin).
    pub start_s: f64,
    /// End of the window: the latest end of a schedule span.
    pub end_s: f64,
    /// Forward and backward time of each rank in the window, seconds.
    pub busy_s: Vec<f64>,
    /// `1 - sum(busy) / (P * window)`.
    pub idle: f64,
}

impl IdleReport {
    /// Length of the window, seconds (the measured makespan).
    pub fn window_s(&self) -> f64 {
        self.end_s - self.start_s
    }

    /// Each rank's idle fraction of the window, `1 - busy / window`.
    pub fn rank_idle(&self) -> Vec<f64> {
        let w = self.window_s();
        self.busy_s
            .iter()
            .map(|b| if w > 0.0 { 1.0 - b / w } else { 0.0 })
            .collect()
    }
}

impl fmt::Display for IdleReport {
    /// `idle 27.9% over 4 ranks x 0.671 s (rank 0 27.5%, rank 1 ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "idle {:.1}% over {} ranks x {:.3} s (",
            100.0 * self.idle,
            self.ranks.len(),
            self.window_s()
        )?;
        for (i, (r, idle)) in self.ranks.iter().zip(self.rank_idle()).enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}rank {r} {:.1}%", 100.0 * idle)?;
        }
        write!(f, ")")
    }
}

/// The measured idle fraction of every recorded schedule span (see the [module docs](self));
/// `None` when no timeline holds one.
pub fn measure_idle(timelines: &[Timeline]) -> Option<IdleReport> {
    measure_idle_between(timelines, f64::NEG_INFINITY, f64::INFINITY)
}

/// [`measure_idle`] over the spans that start at or after `from_s` and end at or before `to_s`
/// (seconds from the origin, for example [`Timeline::now_s`] before and after a step); `None`
/// when there are none.
pub fn measure_idle_between(timelines: &[Timeline], from_s: f64, to_s: f64) -> Option<IdleReport> {
    let per_rank: Vec<Vec<Span>> = timelines
        .iter()
        .map(|t| {
            t.spans()
                .into_iter()
                .filter(|s| s.kind != SpanKind::Optimizer && s.start_s >= from_s && s.end_s <= to_s)
                .collect()
        })
        .collect();
    let all = per_rank.iter().flatten();
    let start_s = all.clone().map(|s| s.start_s).reduce(f64::min)?;
    let end_s = all.map(|s| s.end_s).fold(start_s, f64::max);
    let busy_s: Vec<f64> = per_rank
        .iter()
        .map(|spans| {
            spans
                .iter()
                .filter(|s| s.kind.is_schedule_compute())
                .map(|s| s.end_s - s.start_s)
                .sum()
        })
        .collect();
    let window = end_s - start_s;
    let idle = if window > 0.0 {
        1.0 - busy_s.iter().sum::<f64>() / (busy_s.len() as f64 * window)
    } else {
        0.0
    };
    Some(IdleReport {
        ranks: timelines.iter().map(Timeline::rank).collect(),
        start_s,
        end_s,
        busy_s,
        idle,
    })
}

/// Per-stage [`Costs`] from the timelines (one per pipeline rank, in rank order, every rank
/// present): each rank's mean forward span and mean backward span in seconds (the mean input and
/// weight halves when the rank split its backwards, else the full backward as `backward_input`
/// and 0 as `backward_weight`), with free transfers (`p2p` 0: a transfer span also holds the time
/// waiting for the peer, so it does not measure the transfer). Simulating the schedule with them
/// gives the bubble the run would have had with no overhead, to print next to
/// [`measure_idle`]'s. `None` when a rank recorded no forward or no backward.
pub fn measured_costs(timelines: &[Timeline]) -> Option<Costs> {
    let mut by_rank: Vec<&Timeline> = timelines.iter().collect();
    by_rank.sort_by_key(|t| t.rank());
    if by_rank.iter().enumerate().any(|(i, t)| t.rank() != i) {
        return None;
    }
    let mean = |spans: &[Span], kind: SpanKind| {
        let d: Vec<f64> = spans
            .iter()
            .filter(|s| s.kind == kind)
            .map(|s| s.end_s - s.start_s)
            .collect();
        (!d.is_empty()).then(|| d.iter().sum::<f64>() / d.len() as f64)
    };
    let (mut forward, mut input, mut weight) = (Vec::new(), Vec::new(), Vec::new());
    for t in by_rank {
        let spans = t.spans();
        forward.push(mean(&spans, SpanKind::Forward)?);
        match (
            mean(&spans, SpanKind::BackwardInput),
            mean(&spans, SpanKind::BackwardWeight),
        ) {
            (Some(b), Some(w)) => {
                input.push(b);
                weight.push(w);
            }
            _ => {
                input.push(mean(&spans, SpanKind::Backward)?);
                weight.push(0.0);
            }
        }
    }
    Some(Costs::per_stage(forward, input, weight, 0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(kind: SpanKind, label: &str, start_s: f64, end_s: f64) -> Span {
        Span {
            kind,
            label: label.into(),
            start_s,
            end_s,
        }
    }

    /// Two ranks, F = 1 and B = 2, one microbatch: rank 0 runs F0 [0,1], sends, waits for the
    /// gradient and runs B0 [5,7]; rank 1 receives, runs F0 [1,2], B0 [2,4], sends back. Then
    /// an optimizer step on each.
    fn two_ranks() -> Vec<Timeline> {
        let t = vec![
            Timeline::new(0, Instant::now()),
            Timeline::new(1, Instant::now()),
        ];
        for s in [
            span(SpanKind::Forward, "F0", 0.0, 1.0),
            span(SpanKind::Send, ">a0", 1.0, 1.0),
            span(SpanKind::Recv, "<g0", 1.0, 5.0),
            span(SpanKind::Backward, "B0", 5.0, 7.0),
            span(SpanKind::Optimizer, "optimizer", 7.5, 8.0),
        ] {
            t[0].push(s);
        }
        for s in [
            span(SpanKind::Recv, "<a0", 0.0, 1.0),
            span(SpanKind::Forward, "F0", 1.0, 2.0),
            span(SpanKind::Backward, "B0", 2.0, 4.0),
            span(SpanKind::Send, ">g0", 4.0, 4.0),
            span(SpanKind::Optimizer, "optimizer", 7.5, 8.0),
        ] {
            t[1].push(s);
        }
        t
    }

    #[test]
    fn idle_is_the_simulators_bubble_definition() {
        let t = two_ranks();
        let r = measure_idle(&t).unwrap();
        // Window [0, 7] (the optimizer is left out), busy 3 on each rank.
        assert_eq!((r.start_s, r.end_s), (0.0, 7.0));
        assert_eq!(r.busy_s, vec![3.0, 3.0]);
        assert!((r.idle - (1.0 - 6.0 / 14.0)).abs() < 1e-12);
        assert_eq!(r.rank_idle(), vec![1.0 - 3.0 / 7.0; 2]);
        assert!(r
            .to_string()
            .starts_with("idle 57.1% over 2 ranks x 7.000 s (rank 0 57.1%"));
        // Only rank 1's first three spans: window [0, 4], busy 0 and 3.
        let r = measure_idle_between(&t, 0.0, 4.0).unwrap();
        assert_eq!(r.busy_s, vec![1.0, 3.0]);
        assert_eq!(r.end_s, 4.0);
        assert!(measure_idle_between(&t, 10.0, 20.0).is_none());
        assert!(measure_idle(&[]).is_none());
        let c = measured_costs(&t).unwrap();
        assert_eq!(
            c,
            Costs::per_stage(vec![1.0; 2], vec![2.0; 2], vec![0.0; 2], 0.0)
        );
    }

    #[test]
    fn chrome_trace_has_a_track_per_rank_and_idle_gaps() {
        let v = chrome_trace(&two_ranks());
        let events = v["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["rank 0", "rank 1"]);
        let complete = |tid: u64, cat: &str| -> Vec<(f64, f64)> {
            events
                .iter()
                .filter(|e| e["ph"] == "X" && e["tid"] == tid && e["cat"] == cat)
                .map(|e| (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()))
                .collect()
        };
        assert_eq!(complete(0, "forward"), vec![(0.0, 1e6)]);
        assert_eq!(complete(1, "backward"), vec![(2e6, 2e6)]);
        // Rank 0 never pauses before the optimizer; rank 1 waits from the end of its send to the
        // optimizer. The window ends with the optimizer (8 s).
        assert_eq!(complete(0, "idle"), vec![(7e6, 0.5e6)]);
        assert_eq!(complete(1, "idle"), vec![(4e6, 3.5e6)]);
        let n = events.iter().filter(|e| e["ph"] == "X").count();
        assert_eq!(n, 10 + 2);
    }

    #[test]
    fn trace_is_written_atomically_and_errors_name_the_path() {
        let dir = std::env::temp_dir().join(format!("meshgrad-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        write_chrome_trace(&path, &two_ranks()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            chrome_trace(&two_ranks())
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left"
        );
        let bad = dir.join("missing").join("trace.json");
        let e = write_chrome_trace(&bad, &two_ranks())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&bad.display().to_string()), "{e}");
        assert!(!e.contains('\n'), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
