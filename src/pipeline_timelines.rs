//! What the ranks of a pipeline did and when: every rank's [`Timeline`] and step windows, the
//! measured idle fraction printed after a pipeline run, and, in a job of processes, the
//! gathering of every rank's timeline on world rank 0 (for the idle figure and `--trace`).

use std::sync::Mutex;

use anyhow::{Context, Result};
use meshgrad_parallel::pipeline::{measure_idle_between, Span, SpanKind, Timeline};
use meshgrad_parallel::{Communicator, ParallelLayout};
use meshgrad_tensor::{Device, Tensor};

/// When a rank ran one step's schedule: `(global rank, step, start, end)`, seconds from the
/// run's origin.
pub(crate) type StepWindow = (usize, usize, f64, f64);

/// The measured idle fraction of the pipeline of global rank 0 (its `pp` ranks; the other
/// pipelines of a composed layout do the same work) over each step's window, from the first
/// of its ranks starting the schedule to the last finishing it: the mean over the steps after
/// the first, which warms up (the first step's figure when there is only one).
pub(crate) fn measured_idle_after_warmup(
    timelines: &[Timeline],
    layout: &ParallelLayout,
    windows: &[StepWindow],
) -> f64 {
    // The mesh is [pp, dp_replicate, dp_shard, tp], tp fastest: pipeline stage p of the first
    // pipeline is global rank p * (world / pp).
    let stride = layout.world_size() / layout.pp();
    let ranks: Vec<usize> = (0..layout.pp()).map(|p| p * stride).collect();
    let pipeline: Vec<Timeline> = ranks.iter().map(|&r| timelines[r].clone()).collect();
    let steps = windows.iter().map(|w| w.1 + 1).max().unwrap_or(0);
    let idle: Vec<f64> = (0..steps)
        .filter_map(|step| {
            let mine = windows
                .iter()
                .filter(|w| w.1 == step && ranks.contains(&w.0));
            let from = mine.clone().map(|w| w.2).reduce(f64::min)?;
            let to = mine.map(|w| w.3).reduce(f64::max)?;
            measure_idle_between(&pipeline, from, to).map(|r| r.idle)
        })
        .collect();
    let counted = if idle.len() > 1 {
        &idle[1..]
    } else {
        &idle[..]
    };
    if counted.is_empty() {
        return f64::NAN;
    }
    counted.iter().sum::<f64>() / counted.len() as f64
}

/// Where the ranks record what they did: every rank's [`Timeline`] and step windows, in this
/// process.
pub(crate) struct Timelines<'a> {
    pub(crate) all: &'a [Timeline],
    pub(crate) windows: &'a Mutex<Vec<StepWindow>>,
    /// Whether this process records only its own rank (MPI): the ranks then send theirs to
    /// world rank 0 after the run ([`gather_timelines`]).
    pub(crate) gather: bool,
}

/// The kinds of span, in the order [`gather_timelines`] numbers them.
const SPAN_KINDS: [SpanKind; 7] = [
    SpanKind::Forward,
    SpanKind::Backward,
    SpanKind::BackwardInput,
    SpanKind::BackwardWeight,
    SpanKind::Send,
    SpanKind::Recv,
    SpanKind::Optimizer,
];

/// In a job of processes: every rank sends its spans and step windows to world rank 0, which adds them to
/// its copies of their timelines, so that the measured idle fraction and `--trace` cover every
/// rank as with threads. Each process has its own clock: times travel as seconds after `sync_s`,
/// the moment the rank left the barrier before the first step on its own clock, and rank 0 adds
/// its own `sync_s` (so the ranks are aligned to within a barrier's exit skew).
pub(crate) fn gather_timelines(
    world: &dyn Communicator,
    t: &Timelines<'_>,
    sync_s: f64,
) -> Result<()> {
    let rank = world.rank();
    if rank != 0 {
        let spans = t.all[rank].spans();
        let mut nums = Vec::with_capacity(1 + 3 * spans.len());
        nums.push(spans.len() as f64);
        for s in &spans {
            let kind = SPAN_KINDS.iter().position(|k| *k == s.kind).unwrap_or(0);
            nums.extend([kind as f64, s.start_s - sync_s, s.end_s - sync_s]);
        }
        let windows = t.windows.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for w in windows.iter().filter(|w| w.0 == rank) {
            nums.extend([w.1 as f64, w.2 - sync_s, w.3 - sync_s]);
        }
        let mut labels: Vec<u8> = spans
            .iter()
            .map(|s| s.label.as_str())
            .collect::<Vec<_>>()
            .join("\n")
            .into_bytes();
        // Never an empty message.
        labels.push(b'\n');
        let n = nums.len();
        world
            .send(&Tensor::from_vec(nums, n, Device::Cpu)?, 0)?
            .wait()?;
        let n = labels.len();
        world
            .send(&Tensor::from_vec(labels, n, Device::Cpu)?, 0)?
            .wait()?;
        return Ok(());
    }
    for src in 1..world.world_size() {
        let nums = world.recv(src)?.wait()?.to_vec::<f64>()?;
        let labels = String::from_utf8(world.recv(src)?.wait()?.to_vec::<u8>()?)
            .context("pipeline timelines: span labels")?;
        let n_spans = nums.first().copied().unwrap_or(0.0) as usize;
        let mut labels = labels.split('\n');
        let (spans, windows) = nums[1..].split_at((3 * n_spans).min(nums.len() - 1));
        for s in spans.chunks_exact(3) {
            t.all[src].push(Span {
                kind: SPAN_KINDS[(s[0] as usize).min(SPAN_KINDS.len() - 1)],
                label: labels.next().unwrap_or_default().to_string(),
                start_s: s[1] + sync_s,
                end_s: s[2] + sync_s,
            });
        }
        let mut mine = t.windows.lock().unwrap_or_else(|e| e.into_inner());
        for w in windows.chunks_exact(3) {
            mine.push((src, w[0] as usize, w[1] + sync_s, w[2] + sync_s));
        }
    }
    Ok(())
}
