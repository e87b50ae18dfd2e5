//! What the ranks of a pipeline run did and when, over a whole training run: every rank's
//! [`Timeline`] and the window of each step's schedule on each rank ([`Timelines`]), the
//! measured idle fraction of the pipeline after its first step ([`measured_idle_after_warmup`],
//! which `meshgrad train` prints beside the simulated bubble), and, in a job of processes, the
//! gathering of every rank's timeline on world rank 0 ([`gather_timelines`], for the idle figure
//! and the Chrome trace of every rank).

use std::sync::Mutex;

use meshgrad_tensor::{Device, Error, Result, Tensor};

use super::trace::{measure_idle_between, Span, SpanKind, Timeline};
use crate::{Communicator, ParallelLayout};

/// When a rank ran one step's schedule: `(global rank, step, start, end)`, seconds from the
/// run's origin.
pub type StepWindow = (usize, usize, f64, f64);

/// The measured idle fraction of the pipeline of global rank 0 (its `pp` ranks; the other
/// pipelines of a composed layout do the same work) over each step's window, from the first
/// of its ranks starting the schedule to the last finishing it: the mean over the steps after
/// the first, which warms up (the first step's figure when there is only one).
pub fn measured_idle_after_warmup(
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
pub struct Timelines<'a> {
    /// Every world rank's timeline, by global rank.
    pub all: &'a [Timeline],
    /// Every rank's step windows recorded in this process.
    pub windows: &'a Mutex<Vec<StepWindow>>,
    /// Whether this process records only its own rank (MPI): the ranks then send theirs to
    /// world rank 0 after the run ([`gather_timelines`]).
    pub gather: bool,
}

/// The kinds of span, in the order [`gather_timelines`] numbers them.
const SPAN_KINDS: [SpanKind; 8] = [
    SpanKind::Forward,
    SpanKind::Backward,
    SpanKind::BackwardInput,
    SpanKind::BackwardWeight,
    SpanKind::Send,
    SpanKind::Recv,
    SpanKind::Optimizer,
    SpanKind::Collective,
];

/// In a job of processes: every rank sends its spans and step windows to world rank 0, which adds them to
/// its copies of their timelines, so that the measured idle fraction and `--trace` cover every
/// rank as with threads. Each process has its own clock: times travel as seconds after `sync_s`,
/// the moment the rank left the barrier before the first step on its own clock, and rank 0 adds
/// its own `sync_s` (so the ranks are aligned to within a barrier's exit skew).
pub fn gather_timelines(world: &dyn Communicator, t: &Timelines<'_>, sync_s: f64) -> Result<()> {
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
            .map_err(|e| Error::Msg(format!("pipeline timelines: span labels: {e}")))?;
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

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn forward(start_s: f64, end_s: f64) -> Span {
        Span {
            kind: SpanKind::Forward,
            label: "F0".into(),
            start_s,
            end_s,
        }
    }

    #[test]
    fn idle_after_warmup_skips_the_first_step_and_other_pipelines() {
        // dp=2,pp=2: global ranks 0 and 2 are the first pipeline's stages.
        let layout: ParallelLayout = "dp=2,pp=2".parse().unwrap();
        let origin = Instant::now();
        let t: Vec<Timeline> = (0..4).map(|r| Timeline::new(r, origin)).collect();
        // Step 0 (warm-up): rank 2 idles most of it. Step 1 over [10, 14]: rank 0 busy 4 s,
        // rank 2 busy 2 s, so 1 - 6 / (2 * 4) = 0.25 idle.
        t[0].push(forward(0.0, 1.0));
        t[2].push(forward(0.0, 9.0));
        t[0].push(forward(10.0, 14.0));
        t[2].push(forward(11.0, 13.0));
        // Rank 1, of the other pipeline, is not measured.
        t[1].push(forward(10.0, 10.5));
        let windows = vec![
            (0, 0, 0.0, 1.0),
            (2, 0, 0.0, 9.0),
            (0, 1, 10.0, 14.0),
            (2, 1, 10.5, 13.5),
            (1, 1, 10.0, 20.0),
        ];
        let idle = measured_idle_after_warmup(&t, &layout, &windows);
        assert!((idle - 0.25).abs() < 1e-12, "{idle}");
        // With one step there is nothing after the warm-up: that step's figure.
        let first = measured_idle_after_warmup(&t, &layout, &windows[..2]);
        assert!((first - (1.0 - 10.0 / 18.0)).abs() < 1e-12, "{first}");
        assert!(measured_idle_after_warmup(&t, &layout, &[]).is_nan());
    }
}
