//! The time and memory of one training step of one candidate: a layout with its schedule,
//! chunks, micro-batch size, recomputation and sequence parallelism, on a cluster.
//!
//! The step is the pipeline's time plus what the data-parallel ranks and the optimizer add
//! after it:
//!
//! * **Per micro-batch and block** ([`super::compute`]): the forward's GEMMs and element-wise
//!   work; the backward twice that (half of it the input gradient, half the weight gradient,
//!   which a zero-bubble schedule moves); recomputation adds one forward to the backward. The
//!   cluster's [`ComputeScale`] multiplies the block's, the embedding's and the head's compute
//!   (a measured correction; 1 unless a per-layer profile set it).
//! * **Tensor parallelism** is on the critical path: two all-reduces of the block's activations
//!   (`rows x T x C` values) in the forward and two in the backward (and two more in a
//!   recomputed forward); with sequence parallelism each all-reduce becomes an all-gather and a
//!   reduce-scatter of the same tensor, which cost the same (ring) time.
//! * **ZeRO-3 (fsdp)** gathers each block's parameters before its forward and again before its
//!   backward, and reduce-scatters its gradient after it, once per micro-batch; the next block's
//!   gather is prefetched, so only what exceeds the block's compute is exposed.
//! * **Pipeline**: the per-stage forward and backward costs (the first stage adds the embedding,
//!   the last the head) and the point-to-point time of one activation (`rows x T x C` values,
//!   divided by `tp` under sequence parallelism) go to the simulator ([`super::bubble`]); the
//!   bubble is the makespan less the busiest stage's work. The pipeline's exposed
//!   communication is the makespan less that of the same pipeline with free transfers. Ranks
//!   that share one machine's cores (`Cluster::one_machine`) have no bubble: an idle stage
//!   leaves its cores to the others, and the step takes the stages' mean work.
//! * **Data parallelism**: gradients (in the working precision) are reduced in buckets of
//!   [`BUCKET_BYTES`] during the last micro-batch's backward, so only the part that does not fit
//!   under that backward, and at least the last bucket, is exposed: an all-reduce over the
//!   replicas (dp), or a reduce-scatter over the shard group then an all-reduce of the shard
//!   over the replicas (zero1, zero2 and hybrids; zero2 reduce-scatters every micro-batch, under
//!   its backward). ZeRO-1 and ZeRO-2 all-gather the updated parameters after the step
//!   (exposed).
//! * **Optimizer**: AdamW streams [`OPTIMIZER_BYTES`] bytes per local parameter (its shard under
//!   ZeRO) through device memory.
//!
//! Memory is [`super::memory::estimate_training`]'s, the preflight check's formula; a candidate
//! fits when the largest rank's bytes fit in a device (or, for ranks that share one machine's
//! memory as threads, when the total does).
//!
//! Left out: compute slowed by overlapping communication, kernel launch gaps, data loading,
//! uneven layer splits beyond rounding up, the attention's causal half-skipping, stragglers.

pub use meshgrad_autograd::distributed::CpMode;
use meshgrad_nn::ModelShape;

use super::bubble::{BubbleCache, PipelineRun, StageCosts};
use super::comm::{self, Topology};
use super::compute::{Attention, ComputeScale, MicroBatch};
use super::device::DeviceKind;
use super::flops::training_step;
use super::memory::{
    estimate_training, in_flight, MemoryEstimate, Precision, Retention, TrainingRun,
};
use crate::layout::{ParallelLayout, ZeroStage};
use crate::pipeline::ScheduleKind;

/// Bytes of a data-parallel gradient bucket (DDP's default).
pub const BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0;

/// Bytes AdamW moves per parameter: reads the f32 gradient, the two moments and the master
/// weight (16), writes the moments and the weight (12), and under mixed precision writes the
/// 2-byte working copy.
pub const OPTIMIZER_BYTES: f64 = 28.0;

/// What is trained, and with what precision.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// The model; its `positions` is the sequence length of every row.
    pub model: ModelShape,
    /// Rows per optimizer step, over all data-parallel ranks.
    pub global_batch: usize,
    /// Parameters' and activations' precision.
    pub precision: Precision,
    /// The attention kernel.
    pub attention: Attention,
    /// Which activations the framework keeps (meshgrad's graph by default).
    pub retention: Retention,
}

/// The devices a run has.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// Their kind.
    pub device: DeviceKind,
    /// How many.
    pub devices: usize,
    /// Devices per node.
    pub devices_per_node: usize,
    /// Whether the ranks share one machine (threads of one process, as `meshgrad train
    /// --layout` runs them on a CPU, or processes of `meshgrad launch` on it): its memory, so
    /// that the total must fit, as the preflight check requires (otherwise each rank's own);
    /// and its cores, so that a pipeline rank idle in the bubble leaves them to the others (the
    /// step takes the stages' mean work, not the busiest stage's work plus a bubble).
    pub one_machine: bool,
    /// The measured correction of the compute (1 unless a per-layer profile set it).
    pub compute_scale: ComputeScale,
}

impl Cluster {
    /// `devices` of `device` in nodes of `devices_per_node` (default: the device kind's, or
    /// all of them when they are fewer and divide it: one partial node). Devices that do not
    /// fill whole nodes are an error in one line.
    pub fn new(
        device: DeviceKind,
        devices: usize,
        devices_per_node: Option<usize>,
        one_machine: bool,
    ) -> Result<Cluster, String> {
        let mut g = devices_per_node.unwrap_or(device.devices_per_node);
        if devices_per_node.is_none() && devices > 0 && devices < g && g.is_multiple_of(devices) {
            g = devices;
        }
        if devices == 0 || g == 0 || !devices.is_multiple_of(g) {
            return Err(format!(
                "--devices {devices} is not a multiple of --devices-per-node {g} (whole nodes \
                 only)"
            ));
        }
        Ok(Cluster {
            device,
            devices,
            devices_per_node: g,
            one_machine,
            compute_scale: ComputeScale::default(),
        })
    }
}

/// One way to run the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Candidate {
    /// The layout.
    pub layout: ParallelLayout,
    /// Sequence parallelism (with `tp > 1`).
    pub sequence_parallel: bool,
    /// How attention meets the keys of the other context-parallel ranks (with `cp > 1`): the
    /// ring, or one all-gather of the keys and values.
    pub cp_mode: CpMode,
    /// The pipeline schedule (`1f1b` without a pipeline).
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank (1 except for the interleaved schedule).
    pub chunks: usize,
    /// Rows per micro-batch.
    pub microbatch_size: usize,
    /// Recompute every block's activations in the backward.
    pub recompute: bool,
}

impl Candidate {
    /// Micro-batches per data-parallel rank and step for a global batch, or why the batch does
    /// not split.
    pub fn microbatches(&self, global_batch: usize) -> Result<usize, String> {
        let dp = self.layout.data_parallel_degree();
        let m = self.microbatch_size;
        if m == 0 || global_batch == 0 || !global_batch.is_multiple_of(dp * m) {
            return Err(format!(
                "layout {}: the global batch of {global_batch} rows does not split into {dp} \
                 data-parallel ranks x micro-batches of {m} rows",
                self.layout
            ));
        }
        Ok(global_batch / dp / m)
    }

    /// Checks the candidate against the model and the cluster; errors are one line.
    pub fn check(&self, w: &Workload, cluster: &Cluster) -> Result<usize, String> {
        let l = &self.layout;
        if l.world_size() != cluster.devices {
            return Err(format!(
                "layout {l}: its degrees multiply to {} devices, but there are {}",
                l.world_size(),
                cluster.devices
            ));
        }
        let micro = self.microbatches(w.global_batch)?;
        let s = &w.model;
        let (tp, pp) = (l.tp(), l.pp());
        if !s.n_head.is_multiple_of(tp) || !s.n_kv_head.is_multiple_of(tp) {
            return Err(format!(
                "layout {l}: tp={tp} does not divide the {} attention heads ({} key/value)",
                s.n_head, s.n_kv_head
            ));
        }
        if self.sequence_parallel && tp == 1 {
            return Err(format!("layout {l}: sequence parallelism needs tp > 1"));
        }
        let (cp, ep) = (l.cp(), l.ep());
        if cp > 1 && !s.positions.is_multiple_of(2 * cp) {
            return Err(format!(
                "layout {l}: cp={cp} does not split the sequence of {} tokens into {} chunks",
                s.positions,
                2 * cp
            ));
        }
        if ep > 1 && (s.n_experts == 0 || !s.n_experts.is_multiple_of(ep)) {
            return Err(format!(
                "layout {l}: ep={ep} does not divide the model's {} experts",
                s.n_experts
            ));
        }
        if pp * self.chunks > s.n_layer {
            return Err(format!(
                "layout {l}: {pp} stages x {} chunks is more than the {} layers",
                self.chunks, s.n_layer
            ));
        }
        match self.schedule {
            ScheduleKind::Interleaved
                if pp > 1 && (self.chunks < 2 || !micro.is_multiple_of(pp)) =>
            {
                return Err(format!(
                    "layout {l}: the interleaved schedule needs 2 or more chunks and the \
                     {micro} micro-batches divisible by pp={pp}"
                ));
            }
            ScheduleKind::Interleaved if pp > 1 => {}
            ScheduleKind::Custom => return Err("a custom schedule cannot be planned".into()),
            _ if self.chunks != 1 => {
                return Err(format!(
                    "--chunks is only for the interleaved schedule, not {}",
                    self.schedule
                ));
            }
            _ => {}
        }
        Ok(micro)
    }
}

/// Seconds of one step, split by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    /// Compute of the busiest pipeline stage (all of it without a pipeline).
    pub compute: f64,
    /// Exposed tensor-parallel communication.
    pub tp: f64,
    /// Exposed ZeRO-3 gathers and reduce-scatters during the micro-batches.
    pub shard: f64,
    /// Exposed pipeline transfers.
    pub pp: f64,
    /// Exposed context-parallel ring transfers (keys and values, and their gradients).
    pub cp: f64,
    /// Exposed expert-parallel all-to-alls (tokens to their experts and back).
    pub ep: f64,
    /// Pipeline bubble (idle time of the busiest stage, transfers left out).
    pub bubble: f64,
    /// Exposed data-parallel gradient reduction and parameter gathers.
    pub dp: f64,
    /// The optimizer step.
    pub optimizer: f64,
    /// The whole step.
    pub step: f64,
}

/// What one candidate costs.
#[derive(Clone, Debug)]
pub struct Estimate {
    /// The candidate.
    pub candidate: Candidate,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// The preflight check's memory estimate.
    pub memory: MemoryEstimate,
    /// Whether it fits (see the [module docs](self)).
    pub fits: bool,
    /// The step's time.
    pub time: StepTime,
    /// Tokens per second per device.
    pub tokens_per_s_per_device: f64,
    /// Model FLOP utilisation: the step's operations without recomputation over the peak.
    pub mfu: f64,
    /// FLOP/s per device counting recomputation (the Megatron-LM paper's figure).
    pub flops_per_device: f64,
}

impl Estimate {
    /// The largest part of the step, in words: `compute (71% of the step)`.
    pub fn bottleneck(&self) -> String {
        let t = &self.time;
        let parts = [
            (t.compute, "compute"),
            (t.tp, "tensor-parallel communication"),
            (t.shard, "ZeRO-3 parameter gathers"),
            (t.pp, "pipeline transfers"),
            (t.cp, "context-parallel ring transfers"),
            (t.ep, "expert-parallel all-to-alls"),
            (t.bubble, "pipeline bubble"),
            (t.dp, "data-parallel gradient reduction"),
            (t.optimizer, "optimizer step"),
        ];
        let (v, what) = parts
            .iter()
            .copied()
            .fold((f64::MIN, ""), |a, b| if b.0 > a.0 { b } else { a });
        format!(
            "{what} ({:.0}% of the step)",
            100.0 * v / t.step.max(1e-300)
        )
    }
}

/// Per micro-batch and block, seconds: forward and backward, split in compute and exposed
/// communication.
struct BlockCost {
    compute_f: f64,
    compute_b: f64,
    tp_f: f64,
    tp_b: f64,
    shard_f: f64,
    shard_b: f64,
    cp_f: f64,
    cp_b: f64,
    ep_f: f64,
    ep_b: f64,
}

/// The parameters of one block's matrices on one rank of `tp` tensor-parallel and `ep`
/// expert-parallel ranks (a mixture of experts' experts and router are whole under `tp`, the
/// experts divided by `ep`).
fn block_params(s: &ModelShape, tp: usize, ep: usize) -> f64 {
    let c = s.n_embd as f64;
    let kv = (s.n_embd / s.n_head.max(1) * s.n_kv_head) as f64;
    let mats = if s.gated_mlp { 3.0 } else { 2.0 };
    let mlp = mats * c * s.ffn as f64;
    let attention = 2.0 * c * c + 2.0 * c * kv;
    if s.n_experts > 0 {
        let e = s.n_experts as f64;
        attention / tp as f64 + c * e + e * mlp / ep.max(1) as f64
    } else {
        (attention + mlp) / tp as f64
    }
}

/// The cost of one candidate (see the [module docs](self)).
pub struct CostModel<'a> {
    /// What is trained.
    pub workload: &'a Workload,
    /// On what.
    pub cluster: &'a Cluster,
}

impl CostModel<'_> {
    /// The memory estimate of `c`: the preflight check's, plus, for an attention that
    /// materialises its scores ([`Attention::Materialized`], not meshgrad's), the scores' 2-byte
    /// softmax output and 1-byte dropout mask (`3 H T / tp` bytes per token) for every block
    /// of every micro-batch in flight (one block with recomputation), and the scores of the
    /// block being computed (`H T / tp` values per token).
    pub fn memory(&self, c: &Candidate, microbatches: usize) -> MemoryEstimate {
        let mut m = self.preflight_memory(c, microbatches);
        if self.workload.attention == Attention::Materialized {
            let s = &self.workload.model;
            let l = &c.layout;
            let blocks = if c.recompute {
                1
            } else {
                s.n_layer.div_ceil(l.pp()) * in_flight(c.schedule, microbatches, l.pp())
            };
            let scores = (s.n_head * s.positions / l.tp()) as u64;
            let tokens = (c.microbatch_size * s.positions) as u64;
            let extra = (3 * scores)
                .saturating_mul(tokens)
                .saturating_mul(blocks as u64)
                .saturating_add(
                    scores
                        .saturating_mul(tokens)
                        .saturating_mul(self.workload.precision.bytes()),
                );
            m.activations = m.activations.saturating_add(extra);
            m.per_rank = m.per_rank.saturating_add(extra);
            m.total = m.total.saturating_add(extra.saturating_mul(m.ranks as u64));
        }
        m
    }

    /// The memory estimate of `c` exactly as the preflight check of `meshgrad train` makes it.
    pub fn preflight_memory(&self, c: &Candidate, microbatches: usize) -> MemoryEstimate {
        estimate_training(&TrainingRun {
            model: self.workload.model,
            layout: &c.layout,
            batch_size: self.workload.global_batch,
            microbatches,
            schedule: c.schedule,
            sequence_parallel: c.sequence_parallel,
            cp_mode: c.cp_mode,
            checkpoint_blocks: c.recompute,
            reference_row_group: None,
            precision: self.workload.precision,
            retention: self.workload.retention,
        })
    }

    /// Whether `memory` fits the cluster's devices.
    pub fn fits(&self, memory: &MemoryEstimate) -> bool {
        let have = self.cluster.device.memory_bytes();
        !memory.overflowed()
            && if self.cluster.one_machine {
                memory.total <= have
            } else {
                memory.per_rank <= have
            }
    }

    fn micro(&self, c: &Candidate) -> MicroBatch<'_> {
        MicroBatch {
            model: &self.workload.model,
            device: &self.cluster.device,
            precision: self.workload.precision,
            attention: self.workload.attention,
            rows: c.microbatch_size,
            tp: c.layout.tp(),
            sequence_parallel: c.sequence_parallel,
            cp: c.layout.cp(),
        }
    }

    fn block_cost(&self, c: &Candidate, peak: f64, topo: &Topology) -> BlockCost {
        let w = self.workload;
        let l = &c.layout;
        let mb = self.micro(c);
        let fwd = mb.block(peak).total() * self.cluster.compute_scale.block;
        let s = &w.model;
        let bytes = w.precision.bytes() as f64;
        // This rank's tokens of the micro-batch (`1 / cp` of each row).
        let tokens = (c.microbatch_size * s.positions) as f64 / l.cp() as f64;
        let act = tokens * s.n_embd as f64 * bytes;
        let tp_group = topo.group(l.tp(), 1);
        // Two all-reduces (or all-gather + reduce-scatter pairs, which cost the same).
        let tp_pass = 2.0
            * comm::all_reduce(&tp_group, act).min(if c.sequence_parallel {
                comm::all_gather(&tp_group, act) + comm::reduce_scatter(&tp_group, act)
            } else {
                f64::INFINITY
            });
        let recompute = if c.recompute { 1.0 } else { 0.0 };
        let shard_n = l.shard_degree();
        let (shard_f, shard_b) = if l.zero() == Some(ZeroStage::Three) && shard_n > 1 {
            let g = topo.group(shard_n, l.tp());
            let params = block_params(s, l.tp(), l.ep()) * bytes;
            let gather = comm::all_gather(&g, params);
            let scatter = comm::reduce_scatter(&g, params);
            (
                (gather - fwd).max(0.0),
                (gather + scatter - (2.0 + recompute) * fwd).max(0.0),
            )
        } else {
            (0.0, 0.0)
        };
        // Ring attention (not overlapped with the attention it feeds): the forward passes this
        // rank's keys and values `cp - 1` hops; the backward passes them with their gradients
        // `cp - 1` hops and the gradients one more hop home. The keys and values of every query
        // head (grouped-query attention's are repeated before the ring), split by `tp`.
        let kv = s.n_embd as f64 / l.tp() as f64;
        let ring = topo.group(l.cp(), l.tp());
        let hops = l.cp().saturating_sub(1) as f64;
        let kv_bytes = tokens * 2.0 * kv * bytes;
        let ring_f = hops * comm::p2p(&ring, kv_bytes);
        let ring_b = hops * comm::p2p(&ring, 2.0 * kv_bytes) + comm::p2p(&ring, kv_bytes);
        // All-gather attention instead: one all-gather of every rank's keys and values in the
        // forward, one reduce-scatter of their gradients in the backward (not overlapped).
        let all = kv_bytes * l.cp() as f64;
        let (cp_f, cp_b) = match (l.cp() > 1, c.cp_mode) {
            (false, _) => (0.0, 0.0),
            (true, CpMode::Ring) => (ring_f, recompute * ring_f + ring_b),
            (true, CpMode::AllGather) => {
                let gather = comm::all_gather(&ring, all);
                (
                    gather,
                    recompute * gather + comm::reduce_scatter(&ring, all),
                )
            }
        };
        // Expert parallelism: the token copies (`k` per token, `C` wide) go to their experts'
        // ranks and come back, two all-to-alls in the forward and two in the backward.
        let (ep_f, ep_b) = if s.n_experts > 0 && l.ep() > 1 {
            let g = topo.group(l.ep(), l.tp());
            let copies = tokens * s.mlps_per_token() as f64 * s.n_embd as f64 * bytes;
            let pass = 2.0 * comm::all_to_all(&g, copies);
            (pass, (1.0 + recompute) * pass)
        } else {
            (0.0, 0.0)
        };
        BlockCost {
            compute_f: fwd,
            compute_b: (2.0 + recompute) * fwd,
            tp_f: tp_pass,
            tp_b: (1.0 + recompute) * tp_pass,
            shard_f,
            shard_b,
            cp_f,
            cp_b,
            ep_f,
            ep_b,
        }
    }

    /// Estimates `c` (an error when it fails [`Candidate::check`]); `sims` caches pipeline
    /// simulations.
    pub fn estimate(&self, c: &Candidate, sims: &mut BubbleCache) -> Result<Estimate, String> {
        self.estimate_within(c, sims, f64::INFINITY)
            .map(|e| e.expect("no cutoff"))
    }

    /// As [`CostModel::estimate`], but `None` without simulating the pipeline when the step
    /// cannot be shorter than `cutoff` seconds (its work without any bubble already is not);
    /// with a finite `cutoff` the pipeline's transfers are counted in its bubble rather than
    /// split from it (one simulation instead of two).
    pub fn estimate_within(
        &self,
        c: &Candidate,
        sims: &mut BubbleCache,
        cutoff: f64,
    ) -> Result<Option<Estimate>, String> {
        let w = self.workload;
        let cl = self.cluster;
        let micro = c.check(w, cl)?;
        let memory = self.memory(c, micro);
        let peak = cl.device.peak_flops(w.precision).map_err(|e| e.0)?;
        let topo = Topology::new(&cl.device, cl.devices_per_node);
        let l = &c.layout;
        let (tp, pp, v) = (l.tp(), l.pp(), c.chunks);
        let blocks = w.model.n_layer.div_ceil(pp * v) as f64;
        let b = self.block_cost(c, peak, &topo);
        let mb = self.micro(c);
        let scale = cl.compute_scale;
        let (embed, head) = (
            mb.embedding().total() * scale.embedding,
            mb.head(peak).total() * scale.head,
        );

        // Per rank and chunk: forward, input backward, weight backward.
        let block_f = b.compute_f + b.tp_f + b.shard_f + b.cp_f + b.ep_f;
        let block_w = b.compute_f;
        let block_bi = b.compute_b - block_w + b.tp_b + b.shard_b + b.cp_b + b.ep_b;
        let mut forward = vec![blocks * block_f; pp];
        let mut bwd_in = vec![blocks * block_bi; pp];
        let bwd_w = vec![blocks * block_w; pp];
        let v_f = v as f64;
        forward[0] += embed / v_f;
        bwd_in[0] += 2.0 * embed / v_f;
        forward[pp - 1] += head / v_f;
        bwd_in[pp - 1] += 2.0 * head / v_f;
        let act = (c.microbatch_size * w.model.positions * w.model.n_embd) as f64
            * w.precision.bytes() as f64
            / if c.sequence_parallel { tp as f64 } else { 1.0 }
            / l.cp() as f64;
        let pp_group = topo.group(pp, tp * l.cp() * l.data_parallel_degree());
        let p2p = if pp > 1 {
            comm::p2p(&pp_group, act)
        } else {
            0.0
        };

        // Work per rank (all chunks, all micro-batches) and its busiest rank.
        let work: Vec<f64> = (0..pp)
            .map(|r| (micro * v) as f64 * (forward[r] + bwd_in[r] + bwd_w[r]))
            .collect();
        let busiest = (0..pp)
            .max_by(|&a, &b2| work[a].total_cmp(&work[b2]))
            .unwrap_or(0);
        // Data parallelism after the last micro-batch's backward; the optimizer.
        let vf = v as f64;
        let last_backward = bwd_in[busiest] + bwd_w[busiest];
        let dp = self.data_parallel(c, &topo, last_backward * vf);
        let local = self.local_params(c);
        let shard_n = if l.zero().is_some() {
            l.shard_degree()
        } else {
            1
        } as f64;
        let copy = if w.precision == Precision::F32 {
            0.0
        } else {
            2.0
        };
        let optimizer = local / shard_n * (OPTIMIZER_BYTES + copy)
            / (cl.device.memory_bytes_per_s() * super::compute::STREAM_FRACTION);
        if work[busiest] + dp + optimizer >= cutoff {
            return Ok(None);
        }
        let (makespan, free) = if pp > 1 {
            let run = PipelineRun {
                kind: c.schedule,
                stages: pp,
                microbatches: micro,
                chunks: v,
                costs: StageCosts {
                    forward: forward.clone(),
                    backward_input: bwd_in.clone(),
                    backward_weight: bwd_w.clone(),
                    p2p,
                },
            };
            let with = sims.makespan(&run)?;
            // Pruning (a finite cutoff) skips splitting the transfers from the bubble.
            let free = if cutoff.is_finite() {
                with
            } else {
                sims.makespan(&PipelineRun {
                    costs: StageCosts {
                        p2p: 0.0,
                        ..run.costs.clone()
                    },
                    ..run
                })?
            };
            (with, free)
        } else {
            (work[0], work[0])
        };
        // Ranks of one machine share its cores: a stage idle in the bubble lends them to the
        // others, so the pipeline takes the stages' mean work and its exposed transfers.
        let stage_work = if cl.one_machine && pp > 1 {
            work.iter().sum::<f64>() / pp as f64
        } else {
            work[busiest]
        };
        let (makespan, free) = if cl.one_machine && pp > 1 {
            (stage_work + (makespan - free).max(0.0), stage_work)
        } else {
            (makespan, free)
        };

        // The (busiest or mean) stage's work, split by cause.
        let n = (micro * v) as f64 * blocks;
        let tpc = n * (b.tp_f + b.tp_b);
        let shard = n * (b.shard_f + b.shard_b);
        let cpc = n * (b.cp_f + b.cp_b);
        let epc = n * (b.ep_f + b.ep_b);
        let compute = stage_work - tpc - shard - cpc - epc;
        let bubble = (free - stage_work).max(0.0);
        let pp_exposed = (makespan - free).max(0.0);
        let step = makespan + dp + optimizer;
        let time = StepTime {
            compute,
            tp: tpc,
            shard,
            pp: pp_exposed,
            cp: cpc,
            ep: epc,
            bubble,
            dp,
            optimizer,
            step,
        };
        let tokens = (w.global_batch * w.model.positions) as f64;
        let devices = cl.devices as f64;
        let model_flops = training_step(&w.model, w.global_batch, w.model.positions, false);
        let hw_flops = training_step(&w.model, w.global_batch, w.model.positions, c.recompute);
        Ok(Some(Estimate {
            candidate: *c,
            microbatches: micro,
            fits: self.fits(&memory),
            memory,
            time,
            tokens_per_s_per_device: tokens / step / devices,
            mfu: model_flops / (step * devices * peak),
            flops_per_device: hw_flops / (step * devices),
        }))
    }

    /// Parameters one rank holds before ZeRO sharding (its stage's blocks, the embedding and the
    /// head on a rank that has them, divided by `tp`).
    fn local_params(&self, c: &Candidate) -> f64 {
        let s = &self.workload.model;
        let l = &c.layout;
        let blocks = s.n_layer.div_ceil(l.pp()) as f64;
        let edge = (s.vocab_size * s.n_embd) as f64 / l.tp() as f64;
        blocks * block_params(s, l.tp(), l.ep()) + edge
    }

    /// Exposed data-parallel communication after the micro-batches; `window` is the backward
    /// it overlaps with.
    fn data_parallel(&self, c: &Candidate, topo: &Topology, window: f64) -> f64 {
        let w = self.workload;
        let l = &c.layout;
        let bytes = self.local_params(c) * w.precision.bytes() as f64;
        let tp = l.tp();
        let overlapped = |total: f64, last: f64| (total - window).max(last);
        let bucket = bytes.min(BUCKET_BYTES);
        match l.zero() {
            // The context-parallel ranks hold the same parameters: the gradient is averaged
            // over `dp x cp` ranks, and ZeRO shards over `dp_shard x cp` (see
            // `LayoutMesh::shard_topology`).
            None => {
                let g = topo.group(l.dp_replicate() * l.cp(), tp);
                overlapped(comm::all_reduce(&g, bytes), comm::all_reduce(&g, bucket))
            }
            Some(stage) => {
                let shard_n = l.shard_degree();
                let shard = topo.group(shard_n, tp);
                let replicas = topo.group(l.dp_replicate(), tp * shard_n);
                let rs = match stage {
                    // ZeRO-2 and -3 reduce-scatter during every micro-batch's backward.
                    ZeroStage::Two | ZeroStage::Three => 0.0,
                    ZeroStage::One => overlapped(
                        comm::reduce_scatter(&shard, bytes),
                        comm::reduce_scatter(&shard, bucket),
                    ),
                };
                let across = comm::all_reduce(&replicas, bytes / shard_n as f64);
                let gather = match stage {
                    ZeroStage::Three => 0.0,
                    _ => comm::all_gather(&shard, bytes),
                };
                let zero2 = if stage == ZeroStage::Two {
                    (comm::reduce_scatter(&shard, bytes) - window).max(0.0)
                } else {
                    0.0
                };
                rs + across + gather + zero2
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_nn::GptConfig;

    fn workload(batch: usize) -> Workload {
        Workload {
            model: GptConfig {
                vocab_size: 51200,
                block_size: 2048,
                n_layer: 8,
                n_head: 32,
                n_embd: 4096,
                dropout: 0.0,
                bias: true,
                layer_norm_eps: 1e-5,
            }
            .shape(),
            global_batch: batch,
            precision: Precision::Bf16,
            attention: Attention::Fused,
            retention: Default::default(),
        }
    }

    fn cluster(devices: usize) -> Cluster {
        Cluster {
            device: DeviceKind::preset("a100-80gb").unwrap(),
            devices,
            devices_per_node: 8,
            one_machine: false,
            compute_scale: Default::default(),
        }
    }

    fn candidate(spec: &str, m: usize) -> Candidate {
        Candidate {
            layout: spec.parse().unwrap(),
            sequence_parallel: false,
            cp_mode: CpMode::Ring,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            microbatch_size: m,
            recompute: false,
        }
    }

    /// `c` on `cl` running `w`.
    fn estimate(w: &Workload, cl: &Cluster, c: &Candidate) -> Estimate {
        let m = CostModel {
            workload: w,
            cluster: cl,
        };
        m.estimate(c, &mut BubbleCache::new()).unwrap()
    }

    #[test]
    fn a_measured_compute_scale_multiplies_the_compute_and_nothing_else() {
        let w = workload(4);
        let mut cl = cluster(2);
        let c = candidate("tp=2", 1);
        let base = estimate(&w, &cl, &c);
        // Blocks twice as slow as modelled, the embedding and the head as modelled.
        cl.compute_scale.block = 2.0;
        let slow = estimate(&w, &cl, &c);
        let mb = MicroBatch {
            model: &w.model,
            device: &cl.device,
            precision: w.precision,
            attention: w.attention,
            rows: 1,
            tp: 2,
            sequence_parallel: false,
            cp: 1,
        };
        let peak = cl.device.peak_flops(w.precision).unwrap();
        // 4 micro-batches x 8 blocks x (forward + backward = 3 forwards) more.
        let extra = 4.0 * 8.0 * 3.0 * mb.block(peak).total();
        assert!(
            ((slow.time.compute - base.time.compute) / extra - 1.0).abs() < 1e-9,
            "{:?} vs {:?}",
            slow.time,
            base.time
        );
        assert_eq!(slow.time.tp, base.time.tp);
        assert_eq!(slow.memory.per_rank, base.memory.per_rank);
    }

    #[test]
    fn all_gather_attention_trades_memory_for_one_transfer_each_way() {
        let w = workload(8);
        let cl = cluster(8);
        let ring = candidate("dp=2,cp=4", 1);
        let gather = Candidate {
            cp_mode: CpMode::AllGather,
            ..ring
        };
        let (r, g) = (estimate(&w, &cl, &ring), estimate(&w, &cl, &gather));
        // A rank keeps the keys and values up to its later chunk: more activation memory, the
        // same parameters; the compute is the same, only the cp transfers differ.
        assert!(
            g.memory.activations > r.memory.activations,
            "{g:?} vs {r:?}"
        );
        assert_eq!(g.memory.params, r.memory.params);
        assert_eq!(g.time.compute, r.time.compute);
        assert!(g.time.cp > 0.0 && g.time.cp != r.time.cp);
        // Without cp the mode changes nothing.
        let plain = candidate("dp=8", 1);
        let plain_gather = Candidate {
            cp_mode: CpMode::AllGather,
            ..plain
        };
        let (p, pg) = (estimate(&w, &cl, &plain), estimate(&w, &cl, &plain_gather));
        assert_eq!(p.time.step, pg.time.step);
        assert_eq!(p.memory.per_rank, pg.memory.per_rank);
    }

    #[test]
    fn ranks_sharing_one_machines_cores_have_no_pipeline_bubble() {
        let w = workload(8);
        let mut cl = cluster(2);
        let c = candidate("pp=2", 1);
        let apart = estimate(&w, &cl, &c);
        cl.one_machine = true;
        let shared = estimate(&w, &cl, &c);
        // 8 micro-batches over 2 stages under 1F1B: a bubble of one micro-batch's forward and
        // backward per stage, which ranks on one machine spend on the other stage's work.
        assert!(apart.time.bubble > 0.0, "{:?}", apart.time);
        assert_eq!(shared.time.bubble, 0.0);
        // The stages' mean work (the embedding on one, the head on the other) is below the
        // busiest's, and the step loses the bubble.
        assert!(shared.time.compute <= apart.time.compute);
        let saved = apart.time.step - shared.time.step;
        assert!(
            saved >= apart.time.bubble,
            "{:?} vs {:?}",
            shared.time,
            apart.time
        );
    }

    #[test]
    fn tensor_parallel_all_reduces_are_on_the_critical_path() {
        let w = workload(4);
        let cl = cluster(2);
        let e = estimate(&w, &cl, &candidate("tp=2", 1));
        // 4 micro-batches x 8 blocks x 4 all-reduces of 1 x 2048 x 4096 bf16 values (16 MiB)
        // over 2 ranks on NVLink: ring, 2 (n-1) alpha + 2 (n-1)/n B / beta = 6 us + B / 300e9.
        let b = 2048.0 * 4096.0 * 2.0;
        let one = 2.0 * 3e-6 + b / 300e9;
        assert!(
            (e.time.tp / (4.0 * 8.0 * 4.0 * one) - 1.0).abs() < 1e-9,
            "{:?}",
            e.time
        );
        // Recomputation runs two more per block.
        let mut c = candidate("tp=2", 1);
        c.recompute = true;
        let r = estimate(&w, &cl, &c);
        assert!((r.time.tp / (4.0 * 8.0 * 6.0 * one) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn data_parallel_reduction_hides_under_the_backward_but_its_last_bucket() {
        let w = workload(16);
        let cl = cluster(16);
        let e = estimate(&w, &cl, &candidate("dp=16", 1));
        // 16 ranks over two nodes: 25 GB/s each, 10 us. The all-reduce of ~1.8 G bf16 gradients
        // is longer than one micro-batch's backward: exposed is the rest.
        let params = 8.0 * 12.0 * 4096.0 * 4096.0 + 51200.0 * 4096.0;
        let bytes = params * 2.0;
        let ring: f64 = 30.0 * 10e-6 + 2.0 * 15.0 / 16.0 * bytes / 25e9;
        let tree = 2.0 * 4.0 * 10e-6 + 2.0 * bytes / 25e9;
        let window = e.time.compute * 2.0 / 3.0;
        let exposed = ring.min(tree) - window;
        assert!(exposed > 0.0);
        assert!((e.time.dp / exposed - 1.0).abs() < 1e-9, "{:?}", e.time);
        // Without a pipeline: no bubble; the step is the parts' sum.
        let t = &e.time;
        assert_eq!(t.bubble, 0.0);
        assert!((t.compute + t.tp + t.shard + t.dp + t.optimizer - t.step).abs() < 1e-9);
    }

    #[test]
    fn bad_candidates_are_refused_in_one_line() {
        let w = workload(6);
        let cl = cluster(4);
        let m = CostModel {
            workload: &w,
            cluster: &cl,
        };
        let mut sims = BubbleCache::new();
        for (spec, mb, what) in [
            ("dp=2", 1, "multiply to 2 devices"),
            ("dp=4", 1, "does not split"),
            ("dp=2,tp=2", 4, "does not split"),
        ] {
            let e = m.estimate(&candidate(spec, mb), &mut sims).unwrap_err();
            assert!(e.contains(what) && !e.contains('\n'), "{spec}: {e}");
        }
        let w = workload(8);
        let m = CostModel {
            workload: &w,
            cluster: &cl,
        };
        let mut c = candidate("pp=4", 1);
        c.chunks = 2;
        let e = m.estimate(&c, &mut sims).unwrap_err();
        assert!(e.contains("only for the interleaved"), "{e}");
        c.schedule = ScheduleKind::Interleaved;
        c.microbatch_size = 4;
        let e = m.estimate(&c, &mut sims).unwrap_err();
        assert!(e.contains("divisible by pp=4"), "{e}");
    }
}
