//! Timelines of a real pipeline run: what each rank did and when.
//!
//! A [`Timeline`] belongs to one rank. The executor wraps every action in
//! [`Timeline::record`] (forward, backward, send, receive) and the training loop wraps the
//! optimizer step; the spans keep wall-clock start and end times measured from one origin that
//! every rank of a run shares, so the ranks' spans line up.

use std::sync::{Arc, Mutex};
use std::time::Instant;

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
        }
    }

    /// Whether the span computes (forward, backward, optimizer) rather than waits on a transfer.
    pub fn is_compute(&self) -> bool {
        !matches!(self, SpanKind::Send | SpanKind::Recv)
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

    /// Seconds from the origin to now.
    pub fn now_s(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
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
