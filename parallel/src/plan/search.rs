//! Every valid way to run a training step on `N` devices, ranked by predicted step time.
//!
//! The layouts: every `tp` that divides `N` and the attention heads, up to the devices of one
//! node (tensor parallelism across nodes puts its all-reduces, which are on the critical path,
//! on the network); every `pp` that divides what is left, up to the layers; every context-parallel
//! `cp` that divides what is left, splits the sequence into `2 cp` chunks and keeps `tp x cp`
//! inside a node; the rest,
//! `d = N / (tp pp cp)`, as plain data parallelism (`dp=d`), or sharded over `s` ranks and
//! replicated `d / s` times for every divisor `s > 1` of `d` (ZeRO-1, ZeRO-2, ZeRO-3: `zero1=s`,
//! `dp=r,zero2=s`, `fsdp=s`, `hsdp=rxs`; with cp also `s = 1`, ZeRO then sharding over the cp
//! ranks); for a mixture of experts each of those with every expert-parallel `ep > 1` dividing
//! the experts and the `d x cp` data-parallel ranks that the layout accepts. For each: sequence parallelism on and off (with `tp > 1`, not for a
//! mixture of experts); with a pipeline the GPipe, 1F1B, zero-bubble and interleaved schedules (2, 3, 4, 6 or 8
//! chunks); every micro-batch size up to [`SearchOptions::max_microbatch_size`] that divides a
//! data-parallel rank's rows; recomputation of every block or of none. Candidates that fail
//! [`Candidate::check`] or do not fit are dropped; the rest are ranked by step time, and the best
//! candidate of each layout (with its sequence parallelism) is kept.

use std::collections::HashMap;

use meshgrad_nn::ModelShape;

use super::bubble::BubbleCache;
use super::cost::{Candidate, CostModel, CpMode, Estimate};
use crate::layout::{ParallelLayout, ZeroStage};
use crate::pipeline::ScheduleKind;

/// What to search.
#[derive(Clone, Copy, Debug)]
pub struct SearchOptions {
    /// How many ranked layouts to keep.
    pub top: usize,
    /// The largest micro-batch tried.
    pub max_microbatch_size: usize,
    /// Whether to try ZeRO sharding (zero1, zero2, fsdp, hsdp); without it only `dp`.
    pub sharding: bool,
    /// Whether to try sequence parallelism.
    pub sequence_parallel: bool,
    /// Whether to try context parallelism (`cp > 1`).
    pub context_parallel: bool,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            top: 5,
            max_microbatch_size: 16,
            sharding: true,
            sequence_parallel: true,
            context_parallel: true,
        }
    }
}

/// What a search found.
#[derive(Clone, Debug)]
pub struct SearchResult {
    /// The best candidate of each of the best layouts, fastest first.
    pub best: Vec<Estimate>,
    /// Candidates that passed the checks.
    pub valid: usize,
    /// Pipeline simulations run.
    pub simulations: usize,
    /// Of those, the ones that fit.
    pub fitting: usize,
    /// When nothing fits: the candidate that needs the least memory per device.
    pub smallest: Option<Estimate>,
}

impl SearchOptions {
    /// The defaults, keeping the best `top` (at least 1).
    pub fn top(top: usize) -> SearchOptions {
        SearchOptions {
            top: top.max(1),
            ..SearchOptions::default()
        }
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every layout of `devices` devices in nodes of `devices_per_node` for `model` (see the
/// [module docs](self)).
pub fn layouts(devices: usize, devices_per_node: usize, model: &ModelShape) -> Vec<ParallelLayout> {
    let node = devices_per_node.max(1);
    let mut out = Vec::new();
    for tp in divisors(devices) {
        if tp > node || !model.n_head.is_multiple_of(tp) {
            continue;
        }
        for pp in divisors(devices / tp) {
            if pp > model.n_layer {
                continue;
            }
            for cp in divisors(devices / tp / pp) {
                // The ring stays inside a node with tensor parallelism; each rank holds two
                // chunks of every row.
                let ring_fits = tp * cp <= node && model.positions.is_multiple_of(2 * cp);
                if cp > 1 && !ring_fits {
                    continue;
                }
                let d = devices / tp / pp / cp;
                let mut add = |r, s, z| {
                    let Ok(l) = ParallelLayout::new(pp, r, s, z, tp).and_then(|l| l.with_cp(cp))
                    else {
                        return;
                    };
                    // Expert parallelism over every degree that divides the experts and the
                    // data-parallel ranks (what the layout refuses is skipped).
                    for ep in divisors(d * cp) {
                        if ep == 1 || (model.n_experts.is_multiple_of(ep) && model.n_experts > 0) {
                            if let Ok(l) = l.with_ep(ep) {
                                out.push(l);
                            }
                        }
                    }
                };
                add(d, 1, None);
                // ZeRO shards over `dp_shard x cp` ranks: with cp, over the ring's ranks alone too.
                for s in divisors(d).into_iter().filter(|&s| s > 1 || cp > 1) {
                    for z in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
                        add(d / s, s, Some(z));
                    }
                }
            }
        }
    }
    out
}

/// The schedules (kind, chunks) a pipeline of `pp` stages tries.
fn schedules(pp: usize, n_layer: usize) -> Vec<(ScheduleKind, usize)> {
    if pp == 1 {
        return vec![(ScheduleKind::OneFOneB, 1)];
    }
    let mut v = vec![
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::ZeroBubble, 1),
    ];
    for chunks in [2, 3, 4, 6, 8] {
        if pp * chunks <= n_layer {
            v.push((ScheduleKind::Interleaved, chunks));
        }
    }
    v
}

/// Every candidate of `layout` for a global batch (see the [module docs](self)).
pub fn candidates(
    layout: ParallelLayout,
    global_batch: usize,
    n_layer: usize,
    opts: &SearchOptions,
) -> Vec<Candidate> {
    let dp = layout.data_parallel_degree();
    if !global_batch.is_multiple_of(dp) {
        return Vec::new();
    }
    let rows = global_batch / dp;
    let sizes: Vec<usize> = divisors(rows)
        .into_iter()
        .filter(|&m| m <= opts.max_microbatch_size)
        .collect();
    let sps: &[bool] = if layout.tp() > 1 && opts.sequence_parallel {
        &[false, true]
    } else {
        &[false]
    };
    let mut out = Vec::new();
    for &(schedule, chunks) in &schedules(layout.pp(), n_layer) {
        for &m in &sizes {
            for &sequence_parallel in sps {
                for recompute in [false, true] {
                    out.push(Candidate {
                        layout,
                        sequence_parallel,
                        cp_mode: CpMode::Ring,
                        schedule,
                        chunks,
                        microbatch_size: m,
                        recompute,
                    });
                }
            }
        }
    }
    out
}

/// Searches every candidate for `model`'s workload and cluster (see the [module docs](self)).
pub fn search(model: &CostModel, opts: &SearchOptions) -> SearchResult {
    let w = model.workload;
    let cl = model.cluster;
    let s = &w.model;
    let mut sims = BubbleCache::new();
    let (mut valid, mut fitting) = (0, 0);
    // The best estimate per (layout, sequence parallelism).
    let mut best: HashMap<(ParallelLayout, bool), Estimate> = HashMap::new();
    let top = opts.top.max(1);
    let mut smallest: Option<(u64, Candidate)> = None;
    for layout in layouts(cl.devices, cl.devices_per_node, s) {
        if (layout.zero().is_some() && !opts.sharding)
            || (layout.cp() > 1 && !opts.context_parallel)
        {
            continue;
        }
        for c in candidates(layout, w.global_batch, s.n_layer, opts) {
            let Ok(micro) = c.check(w, cl) else { continue };
            valid += 1;
            let memory = model.memory(&c, micro);
            if !model.fits(&memory) {
                if smallest.is_none_or(|(b, _)| memory.per_rank < b) {
                    smallest = Some((memory.per_rank, c));
                }
                continue;
            }
            fitting += 1;
            // Beaten by `top` other layouts, or by this layout's best: no need to simulate (so a
            // layout outside the top may keep a candidate that is not its best).
            let key = (c.layout, c.sequence_parallel);
            let mut steps: Vec<f64> = best
                .iter()
                .filter(|(k, _)| **k != key)
                .map(|(_, e)| e.time.step)
                .collect();
            steps.sort_by(f64::total_cmp);
            let mut cutoff = steps.get(top - 1).copied().unwrap_or(f64::INFINITY);
            if let Some(e) = best.get(&key) {
                // Only a step faster than this layout's best changes anything.
                cutoff = cutoff.min(e.time.step);
            }
            let Ok(Some(e)) = model.estimate_within(&c, &mut sims, cutoff) else {
                continue;
            };
            if best.get(&key).is_none_or(|b| e.time.step < b.time.step) {
                best.insert(key, e);
            }
        }
    }
    let mut ranked: Vec<Estimate> = best.into_values().collect();
    ranked.sort_by(|a, b| {
        a.time
            .step
            .total_cmp(&b.time.step)
            .then(a.memory.per_rank.cmp(&b.memory.per_rank))
    });
    ranked.truncate(top);
    // Split the winners' pipeline transfers from their bubbles.
    for e in &mut ranked {
        if let Ok(full) = model.estimate(&e.candidate, &mut sims) {
            *e = full;
        }
    }
    let smallest = match (ranked.is_empty(), smallest) {
        (true, Some((_, c))) => model.estimate(&c, &mut sims).ok(),
        _ => None,
    };
    SearchResult {
        smallest,
        best: ranked,
        valid,
        simulations: sims.simulations,
        fitting,
    }
}

/// The estimates a plan shows: the search's best, or, when nothing fits, the candidate that
/// needs the least memory (marked as not fitting); an error when no candidate is valid.
pub fn plan(model: &CostModel, opts: &SearchOptions) -> Result<Vec<Estimate>, String> {
    let found = search(model, opts);
    match (found.best.is_empty(), found.smallest) {
        (false, _) => Ok(found.best),
        (true, Some(s)) => Ok(vec![s]),
        (true, None) => Err(format!(
            "no layout of {} devices can split a global batch of {} rows",
            model.cluster.devices, model.workload.global_batch
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::compute::Attention;
    use crate::plan::cost::{Cluster, Workload};
    use crate::plan::device::DeviceKind;
    use crate::plan::memory::Precision;
    use meshgrad_nn::GptConfig;

    #[test]
    fn layouts_of_eight_devices() {
        // tp in {1, 2, 4, 8} (8 heads), pp up to the 4 layers, the rest d = 8 / (tp pp):
        // dp=d plus 3 ZeRO stages for each divisor s > 1 of d.
        // d = 8 (tp 1 pp 1): 1 + 3 x 3; d = 4 (tp 1 pp 2, tp 2 pp 1): 1 + 3 x 2 each;
        // d = 2 (tp 1 pp 4, tp 2 pp 2, tp 4 pp 1): 1 + 3 each; d = 1 (tp 2 pp 4, tp 4 pp 2,
        // tp 8 pp 1): 1 each.
        let shape = |positions, n_experts| ModelShape {
            n_head: 8,
            n_layer: 4,
            positions,
            n_experts,
            experts_per_token: 2,
            ..GptConfig {
                vocab_size: 64,
                block_size: 16,
                n_layer: 4,
                n_head: 8,
                n_embd: 16,
                dropout: 0.0,
                bias: true,
                layer_norm_eps: 1e-5,
            }
            .shape()
        };
        // A row of 1 token splits into no cp chunks, and the model has no experts.
        let l = layouts(8, 8, &shape(1, 0));
        assert_eq!(l.len(), 10 + 2 * 7 + 3 * 4 + 3);
        assert!(l.iter().all(|l| l.world_size() == 8));
        // Tensor parallelism stays inside a node of 4.
        assert!(layouts(8, 4, &shape(1, 0)).iter().all(|l| l.tp() <= 4));
        // Context parallelism: cp in {2, 4, 8} where tp x cp fits the node of 8, over the
        // ranks left by tp and pp, each with the data-parallel layouts of what remains.
        let with_cp = layouts(8, 8, &shape(16, 0));
        let cp: Vec<_> = with_cp.iter().filter(|l| l.cp() > 1).collect();
        // (tp, pp) -> remaining r, cp | r with cp > 1, tp cp <= 8, then d = r / cp as dp=d and
        // 3 ZeRO stages for every divisor s of d (1 included: ZeRO over the cp ranks), 1 + 3 x
        // divisors(d): (1,1) r 8: cp 2 (d 4: 10), cp 4 (d 2: 7), cp 8 (d 1: 4); (1,2) and (2,1)
        // r 4: cp 2 (7), cp 4 (4); (1,4), (2,2), (4,1) r 2: cp 2 (4).
        assert_eq!(cp.len(), 21 + 2 * 11 + 3 * 4);
        assert!(cp
            .iter()
            .all(|l| l.world_size() == 8 && l.tp() * l.cp() <= 8));
        // Expert parallelism: 4 experts; ep in {2, 4} dividing the data-parallel ranks, for
        // every data-parallel layout of them (plain, ZeRO, hybrid). With cp the same cp layouts
        // as without experts, each also with every ep dividing the experts and dp x cp.
        let with_ep = layouts(8, 8, &shape(16, 4));
        let (cp_ep, with_ep): (Vec<_>, Vec<_>) = with_ep.into_iter().partition(|l| l.cp() > 1);
        assert_eq!(cp_ep.iter().filter(|l| l.ep() == 1).count(), cp.len());
        let cp_ep: Vec<_> = cp_ep.iter().filter(|l| l.ep() > 1).collect();
        assert!(cp_ep
            .iter()
            .all(|l| 4 % l.ep() == 0 && (l.data_parallel_degree() * l.cp()) % l.ep() == 0));
        // dp=1,cp=2,ep=2 (8 = tp 4 x cp 2) and dp=2,cp=4,ep=4 are among them.
        for spec in ["dp=1,cp=2,tp=4,ep=2", "dp=2,cp=4,ep=4"] {
            let want: ParallelLayout = spec.parse().unwrap();
            assert!(cp_ep.iter().any(|l| **l == want), "{spec}");
        }
        let ep: Vec<_> = with_ep.iter().filter(|l| l.ep() > 1).collect();
        assert!(ep.iter().all(|l| 4 % l.ep() == 0));
        assert!(ep.iter().any(|l| l.zero().is_some()));
        // d = 8 (10 layouts, ep 2 and 4 each), d = 4 (tp 2 or pp 2: 7 layouts, ep 2 and 4
        // each), d = 2 (3 ways, 4 layouts each: ep 2).
        assert_eq!(ep.len(), 10 * 2 + 2 * 7 * 2 + 3 * 4);
    }

    #[test]
    fn the_search_keeps_what_fits_fastest_first() {
        let w = Workload {
            model: GptConfig {
                vocab_size: 51200,
                block_size: 2048,
                n_layer: 24,
                n_head: 32,
                n_embd: 4096,
                dropout: 0.0,
                bias: true,
                layer_norm_eps: 1e-5,
            }
            .shape(),
            global_batch: 64,
            precision: Precision::Bf16,
            attention: Attention::Fused,
            retention: Default::default(),
        };
        let cl = Cluster {
            device: DeviceKind::preset("a100-40gb").unwrap(),
            devices: 16,
            devices_per_node: 8,
            one_machine: false,
            compute_scale: Default::default(),
        };
        let m = CostModel {
            workload: &w,
            cluster: &cl,
        };
        let r = search(&m, &SearchOptions::default());
        assert_eq!(r.best.len(), 5);
        assert!(r.fitting < r.valid);
        for pair in r.best.windows(2) {
            assert!(pair[0].time.step <= pair[1].time.step);
        }
        assert!(r.best.iter().all(|e| e.fits));
        // A 5 B model's 20 bytes per parameter do not fit a 40 GiB device unsharded.
        assert!(r.best.iter().all(|e| e.candidate.layout.zero().is_some()
            || e.candidate.layout.tp() * e.candidate.layout.pp() > 1));
        // The winner is no slower than any candidate of its layout.
        let best = &r.best[0];
        let mut sims = BubbleCache::new();
        for c in candidates(best.candidate.layout, 64, 24, &SearchOptions::default()) {
            if let Ok(e) = m.estimate(&c, &mut sims) {
                if e.fits && c.sequence_parallel == best.candidate.sequence_parallel {
                    assert!(e.time.step >= best.time.step * (1.0 - 1e-12));
                }
            }
        }
    }
}
