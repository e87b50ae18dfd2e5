//! The pipeline's time for one step from the simulator ([`crate::pipeline::simulate()`]) with
//! per-stage costs, made cheap enough to run for thousands of candidates: results are cached by
//! schedule and costs, and a long step (more than three rounds of `P` micro-batches) is
//! simulated at `2 P` and `3 P` micro-batches and extended linearly (in the steady state every
//! further round of `P` micro-batches adds the same time to a 1F1B, interleaved, GPipe or
//! zero-bubble schedule; the test checks the extension against a full simulation).

use std::collections::HashMap;

use crate::pipeline::{simulate, Costs, Schedule, ScheduleKind};

/// Per-rank costs of one micro-batch through one chunk, seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    /// Forward, per rank.
    pub forward: Vec<f64>,
    /// Input-gradient backward (with any recomputation), per rank.
    pub backward_input: Vec<f64>,
    /// Weight-gradient backward, per rank.
    pub backward_weight: Vec<f64>,
    /// One point-to-point transfer between neighbouring stages.
    pub p2p: f64,
}

/// A pipeline to time.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineRun {
    /// The schedule's kind.
    pub kind: ScheduleKind,
    /// Stages (ranks).
    pub stages: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Chunks per rank.
    pub chunks: usize,
    /// The costs.
    pub costs: StageCosts,
}

type Key = (ScheduleKind, usize, usize, usize, Vec<u64>);

/// Simulates pipelines, remembering the results.
#[derive(Debug, Default)]
pub struct BubbleCache {
    seen: HashMap<Key, f64>,
    /// Simulations run (not found in the cache).
    pub simulations: usize,
}

impl BubbleCache {
    /// An empty cache.
    pub fn new() -> BubbleCache {
        BubbleCache::default()
    }

    fn simulate(&mut self, run: &PipelineRun, microbatches: usize) -> Result<f64, String> {
        let c = &run.costs;
        let bits: Vec<u64> = c
            .forward
            .iter()
            .chain(&c.backward_input)
            .chain(&c.backward_weight)
            .chain(std::iter::once(&c.p2p))
            .map(|x| x.to_bits())
            .collect();
        let key = (run.kind, run.stages, run.chunks, microbatches, bits);
        if let Some(&t) = self.seen.get(&key) {
            return Ok(t);
        }
        let chunks = (run.kind == ScheduleKind::Interleaved).then_some(run.chunks);
        let schedule = Schedule::generate(run.kind, run.stages, microbatches, chunks)
            .map_err(|e| e.to_string())?;
        let costs = Costs::per_stage(
            c.forward.clone(),
            c.backward_input.clone(),
            c.backward_weight.clone(),
            c.p2p,
        );
        let report = simulate(&schedule, &costs).map_err(|e| e.to_string())?;
        self.simulations += 1;
        self.seen.insert(key, report.makespan);
        Ok(report.makespan)
    }

    /// The time from the first forward to the last backward of `run` (see the
    /// [module docs](self)).
    pub fn makespan(&mut self, run: &PipelineRun) -> Result<f64, String> {
        let (p, m) = (run.stages, run.microbatches);
        if m <= 3 * p {
            return self.simulate(run, m);
        }
        let two = self.simulate(run, 2 * p)?;
        let three = self.simulate(run, 3 * p)?;
        Ok(three + (three - two) * (m - 3 * p) as f64 / p as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: ScheduleKind, p: usize, m: usize, v: usize) -> PipelineRun {
        // Uneven stages: the first and the last carry an embedding and a head.
        let mut f = vec![1.0; p];
        f[0] = 1.2;
        f[p - 1] = 1.5;
        let b: Vec<f64> = f.iter().map(|x| 1.1 * x).collect();
        PipelineRun {
            kind,
            stages: p,
            microbatches: m,
            chunks: v,
            costs: StageCosts {
                forward: f,
                backward_input: b.clone(),
                backward_weight: b,
                p2p: 0.05,
            },
        }
    }

    #[test]
    fn extending_a_long_step_matches_simulating_it() {
        for (kind, v) in [
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZeroBubble, 1),
        ] {
            let r = run(kind, 4, 32, v);
            let full = BubbleCache::new().simulate(&r, 32).unwrap();
            let ext = BubbleCache::new().makespan(&r).unwrap();
            assert!((ext / full - 1.0).abs() < 1e-9, "{kind}: {ext} vs {full}");
        }
    }

    #[test]
    fn one_f_one_b_with_equal_stages_has_megatron_s_bubble() {
        // P stages, M micro-batches, forward 1, backward 2, free transfers: (M + P - 1) x 3.
        let r = PipelineRun {
            kind: ScheduleKind::OneFOneB,
            stages: 4,
            microbatches: 40,
            chunks: 1,
            costs: StageCosts {
                forward: vec![1.0],
                backward_input: vec![1.0],
                backward_weight: vec![1.0],
                p2p: 0.0,
            },
        };
        let t = BubbleCache::new().makespan(&r).unwrap();
        assert!((t - 3.0 * 43.0).abs() < 1e-9, "{t}");
    }
}
