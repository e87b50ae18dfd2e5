//! `meshgrad train --layout pp=P,...`: pipeline-parallel training of the GPT and the BERT, alone
//! or composed with data parallelism (`dp`, `zero1/2`, `fsdp`, `hsdp`) and tensor parallelism
//! (`tp`) on one mesh.
//!
//! Before the ranks start, the model is profiled on this device (each block's, the embedding's
//! and the head's forward + backward time and memory, [`profile_layers`]) and cut into
//! `P x V` contiguous virtual stages by `--partition` (`auto`/`speed`, `memory`, `even` or
//! explicit first blocks); `V` is `--chunks` (interleaved schedule only). Pipeline rank `p`
//! builds only its chunks, virtual stages `c * P + p` (under their global names, with the tensor
//! -parallel plan of its stages and, for `fsdp`/`hsdp`, delayed initialisation), and runs the
//! schedule `--schedule` (gpipe, 1f1b, interleaved or zb) over `--microbatches` microbatches of its
//! data-parallel rows with [`execute_scaled()`] (the f16 loss scale seeding the backwards).
//! After the schedule:
//!
//! * the copies of the tied embedding / head table on the first and the last stage add their
//!   gradients ([`PipelineGrads::reduce_tied_grads`]);
//! * data parallelism averages the gradients over the data-parallel group (without sharding,
//!   all-reduces of 25 MiB buckets of the flattened gradients, all launched before any is
//!   waited for: `all_reduce_coalesced`; the sharded wrapper's reduce-scatter otherwise);
//! * the global gradient norm adds every stage's sum of squares (the tied table once) over the
//!   pipeline group, and clipping scales every stage's gradients by the same factor;
//! * each rank steps its optimizer (or its shard of it).
//!
//! **Reference mode** (`--reference`, see README's "Reference mode") makes a pipeline run the single
//! device's reference run bit for bit:
//!
//! * the microbatches are the data-parallel rank's row groups, one each
//!   (`reference_pipeline_options`: `--microbatches` left at 1 or equal to that count);
//! * the last stage multiplies each microbatch's loss by `1 / G` (`G` row groups in the global
//!   batch) before its backward, and each chunk's gradients of a microbatch are taken out of
//!   `.grad` as soon as they are complete (after its backward, or the zero-bubble schedule's
//!   weight pass; [`ExecuteOptions::on_grads`]) and added over the row groups' aligned binary tree
//!   (`GradTree`), whatever order the schedule finishes them in;
//! * the tied table: one device adds the head's and the embedding's gradient of a row group once,
//!   elementwise, before the tree; so the last stage sends its per-microbatch head gradients to
//!   the first stage, which adds each pair, sums the tree and sends the sum back
//!   ([`PipelineGrads::reduce_tied_grads_by_microbatch`]);
//! * the step's loss is the last stage's tree sum of the row groups' losses, shared over the
//!   pipeline, summed over the data-parallel group (whose float sums add in the same tree and do
//!   not divide) and multiplied by `1 / G`; validation runs each row group forward on its own
//!   and adds the same way;
//! * the gradient norm is an exact sum of squares ([`meshgrad_tensor::exact_sum::ExactSum`]) over
//!   every stage's gradients (their shards under ZeRO; the tied table once), its words
//!   all-reduced over the pipeline group, and every stage clips with it.
//!
//! Validation runs forward through the pipeline ([`forward_only`]). For the checkpoint the
//! sharded and tensor-parallel parameters are gathered within each stage and the stages send
//! theirs to rank 0, which assembles the single-device model. After the run the leader prints
//! `pipeline: partition=<first block of each virtual stage> schedule=<kind>
//! predicted_slowest_ms=<x> simulated_idle=<fraction> measured_idle=<fraction>` and, with
//! `--trace FILE`, writes a Chrome trace of every rank's actions.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use meshgrad_autograd::Var;
use meshgrad_nn::module::Child;
use meshgrad_nn::optim::{clip_grads_with_norm, AdamW, Optimizer};
use meshgrad_nn::tp::{full_state_dict, TensorParallel};
use meshgrad_nn::{ModelStage, Module, StageSpec};
use meshgrad_parallel::comm::{all_reduce_coalesced, all_reduce_scalar, RankCtx};
use meshgrad_parallel::pipeline::partition::{MemoryModel, ModelCosts, Partition, PartitionMethod};
use meshgrad_parallel::pipeline::{
    execute_scaled, execute_with, forward_only, measure_idle_between, profile_layers, simulate,
    write_chrome_trace, Costs, ExecuteOptions, Microbatch, PipelineGrads, ProfileOptions, Schedule,
    ScheduleKind, Span, SpanKind, Timeline,
};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_parallel::zero::{ShardConfig, ShardedDataParallel, ZeroStage};
use meshgrad_parallel::{rank_rows, Communicator, DdpConfig, LayoutMesh, ParallelLayout, ReduceOp};
use meshgrad_tensor::tree_sum::tree_sum_f64;
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::reference::{row_groups, take_grads, GradTree};
use crate::train::{
    drive_loop, optimizer_and_schedule, GradSync, LoopResult, Reporter, RunControl, TrainOptions,
    TrainSummary, Verbosity,
};
use crate::train_parallel::{layout_desc, on_ranks};

/// The pipeline options of `meshgrad train` (`--schedule`, `--chunks`, `--partition`,
/// `--trace`); used when the layout has `pp` above 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineOptions {
    /// The schedule (`--schedule`, default 1f1b).
    pub schedule: ScheduleKind,
    /// Model chunks per rank (`--chunks`, interleaved only; default 2 there, 1 otherwise).
    pub chunks: Option<usize>,
    /// How to cut the model (`--partition`: auto, speed, memory, even or `B0,B1,...`).
    pub partition: String,
    /// Write a Chrome trace of the run here (`--trace`).
    pub trace: Option<PathBuf>,
    /// The most memory the partitioner may give one stage, in bytes (`--max-stage-memory`).
    pub max_stage_memory: Option<u64>,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            schedule: ScheduleKind::OneFOneB,
            chunks: None,
            partition: "auto".into(),
            trace: None,
            max_stage_memory: None,
        }
    }
}

impl PipelineOptions {
    /// Whether any pipeline option differs from its default (refused without `pp` above 1).
    pub fn is_set(&self) -> bool {
        *self != PipelineOptions::default()
    }
}

/// Parses a size in bytes: a whole number with an optional binary unit, `B`, `KiB`, `MiB`,
/// `GiB` or `TiB` (`512MiB`, `1.5GiB`, `4096`).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            anyhow::bail!("size {s:?}: unknown unit {other:?} (expected B, KiB, MiB, GiB or TiB)")
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("size {s:?}: {num:?} is not a number"))?;
    let bytes = v * scale as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        anyhow::bail!("size {s:?} must be at least 1 byte and below 2^64");
    }
    Ok(bytes as u64)
}

/// Refuses pipeline flags (`--schedule`, `--chunks`, `--partition`, `--trace`) when the layout
/// has no pipeline (`pp` is its pipeline degree), in one line.
pub(crate) fn check_pipeline_flags(opts: &TrainOptions, pp: usize) -> Result<()> {
    if pp <= 1 && opts.pipeline.is_set() {
        anyhow::bail!(
            "--schedule, --chunks, --partition and --trace need pipeline parallelism (pp=P with \
             P > 1 in --layout)"
        );
    }
    Ok(())
}

/// What the pipeline loop needs from a model kind (GPT or BERT).
pub(crate) trait PipelineTask: Sync {
    /// The model's stage.
    type Stage: ModelStage + Send + Sync;
    /// The model's name in messages (`GPT`, `BERT`).
    fn name(&self) -> &'static str;
    /// The training config.
    fn cfg(&self) -> &TrainConfig;
    /// Number of blocks (layers) to split.
    fn n_blocks(&self) -> usize;
    /// Builds a stage: its own parameters only, split by `tp` when given, lazily initialised
    /// when `delayed`, recomputing its blocks' activations in the backward when `checkpointing`.
    fn build_stage(
        &self,
        spec: StageSpec,
        tp: Option<TensorParallel>,
        delayed: bool,
        checkpointing: bool,
    ) -> Result<Self::Stage>;
    /// The microbatches of training step `step` for `rows` (this data-parallel rank's), split
    /// `microbatches` ways; `dp` is the data-parallel degree. The executor scales the last
    /// stage's output by `1 / microbatches` for the backward and averages it for the step's loss,
    /// which, averaged over the data-parallel ranks, must be the step's global loss.
    fn train_microbatches(
        &self,
        step: u64,
        rows: Range<u64>,
        microbatches: usize,
        dp: usize,
    ) -> Result<Vec<Microbatch<<Self::Stage as ModelStage>::Batch>>>;
    /// The validation batches of `rows` (this data-parallel rank's).
    fn val_batches(&self, rows: Range<u64>) -> Result<Vec<<Self::Stage as ModelStage>::Batch>>;
    /// The validation loss from the sum of the last stage's outputs over the validation batches
    /// (the same on every rank of a data-parallel group; `dp` averages over it).
    fn val_loss(&self, local_sum: f64, n_batches: usize, dp: &dyn Communicator) -> Result<f64>;
    /// Reference mode: the factor each row group's loss is multiplied by before its backward,
    /// and the step's tree sum of row-group losses after it (`total` row groups in the global
    /// batch). Default (the GPT, a mean over tokens): `1 / total`.
    fn reference_loss_scale(&self, total: usize) -> f64 {
        1.0 / total as f64
    }
    /// Reference mode: validation batch `batch`'s loss from the tree sum of its row groups'
    /// losses over the whole global batch (`total` row groups). Default (the GPT): the sum
    /// divided by `total`.
    fn reference_val_loss(&self, sum: f64, _batch: u64, total: usize) -> Result<f64> {
        Ok(sum / total as f64)
    }
    /// The run's first log line.
    fn header(&self, layout: &str) -> String;
    /// A training microbatch of `rows` rows to profile the layers with.
    fn profile_batch(&self, rows: usize) -> Result<<Self::Stage as ModelStage>::Batch>;
    /// The leader's end of the run, from the full single-device state dict.
    fn finish(
        &self,
        tensors: &[(String, Tensor)],
        rep: Reporter,
        result: LoopResult,
        verbosity: Verbosity,
    ) -> Result<TrainSummary>;
}

/// A rank's chunks as one module (for the optimizer and the sharded wrapper): their parameters
/// under their global names.
struct Chunks<'a, S>(&'a [S]);

impl<S: Module> Module for Chunks<'_, S> {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        for c in self.0 {
            c.visit_children(f);
        }
    }
    fn module_type(&self) -> &'static str {
        "PipelineChunks"
    }
}

/// Profiles every layer of `task`'s model on this device ([`profile_layers`]: a few timed
/// forward + backward passes of each block, the embedding and the head on one microbatch of
/// `rows` rows, single device, no tensor parallelism) for the partitioner.
fn profile_task<T: PipelineTask>(task: &T, rows: usize) -> Result<ModelCosts> {
    let batch = task.profile_batch(rows)?;
    let opts = ProfileOptions::new(1, 3).with_min_sample_ms(2.0);
    let build = |spec: StageSpec| {
        task.build_stage(spec, None, false, false)
            .map_err(|e| meshgrad_tensor::Error::msg(format!("{e:#}")))
    };
    profile_layers(task.n_blocks(), build, &batch, &opts)
        .with_context(|| format!("profiling the {}'s layers for --partition", task.name()))
}

/// The partition and schedule a pipeline run uses, chosen before the ranks start.
pub(crate) struct PipelinePlan {
    pub(crate) schedule: Schedule,
    /// The partition with its predicted costs; `None` on the ranks other than 0 of a job of
    /// processes, which take rank 0's boundaries without profiling (see [`plan_on_world`]).
    pub(crate) partition: Option<Partition>,
    /// The first block of each virtual stage.
    pub(crate) boundaries: Vec<usize>,
    pub(crate) specs: Vec<StageSpec>,
    pub(crate) simulated_idle: f64,
}

impl PipelinePlan {
    /// The run summary's fragment: `partition=0,3,6,9` (the first block of each virtual stage).
    pub(crate) fn fragment(&self) -> String {
        let b: Vec<String> = self.boundaries.iter().map(ToString::to_string).collect();
        format!("partition={}", b.join(","))
    }
}

/// What the pipeline flags and the layout decide without profiling: the schedule and how to
/// partition. Every refusal in one line, the same on every rank.
fn pipeline_shape<T: PipelineTask>(
    task: &T,
    layout: &ParallelLayout,
    opts: &TrainOptions,
) -> Result<(Schedule, PartitionMethod)> {
    let p = layout.pp();
    let po = &opts.pipeline;
    let schedule =
        Schedule::generate(po.schedule, p, opts.microbatches, po.chunks).map_err(|e| {
            let why = if task.cfg().train.reference {
                " (reference mode: one microbatch per row group of a data-parallel rank; choose \
                 them with --row-group)"
            } else {
                ""
            };
            anyhow::anyhow!("--schedule {}: {e}{why}", po.schedule)
        })?;
    let v = schedule.chunks;
    let n = task.n_blocks();
    let stages = p * v;
    if stages > n {
        anyhow::bail!(
            "layout {layout}: {p} pipeline stages x {v} chunks = {stages} virtual stages, but the \
             {} has only {n} blocks (model.n_layer); each virtual stage needs one",
            task.name()
        );
    }
    let method = PartitionMethod::parse_for(&po.partition, stages, n)
        .map_err(|e| anyhow::anyhow!("--partition {}: {e}", po.partition))?;
    Ok((schedule, method))
}

/// Profiles the model, partitions it by `method` for `schedule` and simulates the schedule with
/// the predicted costs: every refusal in one line, before any training.
fn profile_and_partition<T: PipelineTask>(
    task: &T,
    layout: &ParallelLayout,
    opts: &TrainOptions,
    schedule: Schedule,
    method: &PartitionMethod,
) -> Result<PipelinePlan> {
    let p = layout.pp();
    let po = &opts.pipeline;
    let m = opts.microbatches;
    let v = schedule.chunks;
    let stages = p * v;
    let rows = task.cfg().train.batch_size / layout.data_parallel_degree() / m;
    let costs = profile_task(task, rows)?;
    let mut memory = if po.schedule == ScheduleKind::GPipe {
        MemoryModel::gpipe(stages, m)
    } else {
        MemoryModel::one_f_one_b(stages, m)
    };
    if let Some(limit) = po.max_stage_memory {
        memory = memory.with_limit(limit);
    }
    let partition = method.partition(&costs, &memory)?;
    let specs = partition.stage_specs()?;
    // Per-rank costs for the simulator: the mean of the rank's chunks, split 1 : 1 : 1 into
    // forward, input-gradient and weight-gradient time (the profile measures forward +
    // backward together; a backward costs about two forwards).
    let per_rank = |r: usize| -> f64 {
        (0..v)
            .map(|c| partition.stages[c * p + r].time_ms)
            .sum::<f64>()
            / v as f64
            / 3.0
    };
    let third: Vec<f64> = (0..p).map(per_rank).collect();
    let sim = simulate(
        &schedule,
        &Costs::per_stage(third.clone(), third.clone(), third, 0.0),
    )
    .map_err(|e| anyhow::anyhow!("the {} schedule: {e}", po.schedule))?;
    Ok(PipelinePlan {
        schedule,
        boundaries: partition.boundaries.clone(),
        partition: Some(partition),
        specs,
        simulated_idle: sim.bubble,
    })
}

/// The plan in a job of processes (MPI or TCP), where every process is one rank: the profile is timed in each process
/// (by ranks competing for the same cores), so `--partition auto`, `speed` or `memory` could cut
/// the model differently on different ranks. World rank 0 alone profiles and partitions, and
/// broadcasts the first block of each virtual stage; the other ranks build those stages without
/// profiling. An error in rank 0's profiling ends the job.
fn plan_on_world<T: PipelineTask>(
    task: &T,
    layout: &ParallelLayout,
    opts: &TrainOptions,
    schedule: Schedule,
    method: &PartitionMethod,
    world: &dyn Communicator,
) -> Result<PipelinePlan> {
    let stages = layout.pp() * schedule.chunks;
    let rank = world.rank();
    let mine = (rank == 0).then(|| {
        crate::train_parallel::or_abort_job(
            rank,
            profile_and_partition(task, layout, opts, schedule.clone(), method),
        )
    });
    let sent: Vec<f64> = match &mine {
        Some(plan) => plan.boundaries.iter().map(|&b| b as f64).collect(),
        None => vec![0.0; stages],
    };
    let got = world
        .broadcast(&Tensor::from_vec(sent, stages, Device::Cpu)?, 0)?
        .wait()?
        .to_vec::<f64>()?;
    if let Some(plan) = mine {
        return Ok(plan);
    }
    let boundaries: Vec<usize> = got.into_iter().map(|b| b as usize).collect();
    let n = task.n_blocks();
    let counts: Vec<usize> = (0..stages)
        .map(|s| boundaries.get(s + 1).copied().unwrap_or(n) - boundaries[s])
        .collect();
    Ok(PipelinePlan {
        schedule,
        specs: StageSpec::split(n, &counts)?,
        boundaries,
        partition: None,
        simulated_idle: f64::NAN,
    })
}

/// What a pipeline rank reduces its gradients with.
enum Reducer {
    /// No sharding: the gradients all-reduced over the data-parallel group in buckets (a no-op
    /// on one data-parallel rank).
    AllReduce,
    /// ZeRO-1/2/3 over the layout's shard topology.
    Sharded(ShardedDataParallel),
}

/// A pipeline rank's [`GradSync`] (see the [module docs](self)).
struct PipelineSync<'a> {
    grads: &'a PipelineGrads,
    reducer: &'a Reducer,
    params: Vec<Var>,
    dp: Arc<dyn Communicator>,
    pp: Arc<dyn Communicator>,
    timeline: &'a Timeline,
    /// Reference mode: the tied copies' gradients were already added per microbatch (in the
    /// step, [`PipelineGrads::reduce_tied_grads_by_microbatch`]).
    reference: bool,
}

impl GradSync for PipelineSync<'_> {
    fn set_sync(&self, _on: bool) {}

    fn zero_grad(&self, opt: &AdamW) {
        match self.reducer {
            Reducer::AllReduce => opt.zero_grad(),
            Reducer::Sharded(sdp) => {
                sdp.zero_grad();
                // Gradients accumulate over the whole schedule; reduced once in `finish`.
                sdp.set_sync(false);
            }
        }
    }

    fn finish(&self) -> Result<()> {
        self.timeline
            .record(SpanKind::Optimizer, "reduce gradients", || -> Result<()> {
                if !self.reference {
                    self.grads.reduce_tied_grads()?;
                }
                match self.reducer {
                    Reducer::AllReduce => {
                        if self.dp.world_size() > 1 {
                            // Every rank holds gradients for the same parameters of its stage.
                            let (params, grads): (Vec<&Var>, Vec<Tensor>) = self
                                .params
                                .iter()
                                .filter_map(|p| Some((p, p.grad()?)))
                                .unzip();
                            let avg = all_reduce_coalesced(
                                self.dp.as_ref(),
                                &grads,
                                ReduceOp::Avg,
                                DdpConfig::default().bucket_bytes,
                            )?;
                            for (p, g) in params.into_iter().zip(avg) {
                                p.set_grad(Some(g));
                            }
                        }
                    }
                    Reducer::Sharded(sdp) => {
                        sdp.set_sync(true);
                        sdp.finish()?;
                    }
                }
                Ok(())
            })
    }

    fn mean(&self, local: f64) -> Result<f64> {
        Ok(all_reduce_scalar(self.dp.as_ref(), local, ReduceOp::Avg)?)
    }

    fn clip(&self, _params: &[Var], max_norm: f64) -> Result<f64> {
        match self.reducer {
            Reducer::AllReduce => {
                let norm = self.grads.grad_norm()?;
                clip_grads_with_norm(&self.params, max_norm, norm)?;
                Ok(norm)
            }
            Reducer::Sharded(sdp) => {
                let skip = |n: &str| self.grads.left_out_of_norm().iter().any(|s| s == n);
                let local = sdp.grad_sq_sum_without(&skip)?;
                let norm = all_reduce_scalar(self.pp.as_ref(), local, ReduceOp::Sum)?.sqrt();
                sdp.clip_grads_with_norm(max_norm, norm)?;
                Ok(norm)
            }
        }
    }

    fn exact_norm(&self, _params: &[Var]) -> Result<f64> {
        let sum = match self.reducer {
            Reducer::AllReduce => self.grads.exact_grad_sq_sum()?,
            Reducer::Sharded(sdp) => {
                let skip = |n: &str| self.grads.left_out_of_norm().iter().any(|s| s == n);
                let local = sdp.exact_grad_sq_sum_without(&skip)?;
                self.grads.exact_sum_over_pipeline(&local)?
            }
        };
        Ok(sum.value().sqrt())
    }

    fn clip_with_norm(&self, _params: &[Var], max_norm: f64, norm: f64) -> Result<()> {
        match self.reducer {
            Reducer::AllReduce => clip_grads_with_norm(&self.params, max_norm, norm)?,
            Reducer::Sharded(sdp) => sdp.clip_grads_with_norm(max_norm, norm)?,
        }
        Ok(())
    }

    fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
        self.timeline
            .record(SpanKind::Optimizer, "optimizer step", || {
                match self.reducer {
                    Reducer::AllReduce => Ok(opt.step(lr)?),
                    Reducer::Sharded(sdp) => Ok(sdp.step(lr)?),
                }
            })
    }

    /// Mixed precision: the global norm of the unscaled gradients over every stage (the tied
    /// table once), then, unless it is NaN or infinite on any rank (every rank sees the same
    /// norm), the step with the clipping and the unscaling applied in f32: AdamW's gradient
    /// multiplier on a replicated stage, the ZeRO wrapper's f32 shards otherwise.
    fn step_mixed(
        &self,
        opt: &mut AdamW,
        _params: &[Var],
        lr: f64,
        max_norm: f64,
        scale: f64,
    ) -> Result<(f64, bool)> {
        let norm = match self.reducer {
            Reducer::AllReduce => self.grads.grad_norm()? / scale,
            Reducer::Sharded(sdp) => {
                if scale != 1.0 {
                    sdp.scale_grads(1.0 / scale)?;
                }
                let skip = |n: &str| self.grads.left_out_of_norm().iter().any(|s| s == n);
                let local = sdp.grad_sq_sum_without(&skip)?;
                all_reduce_scalar(self.pp.as_ref(), local, ReduceOp::Sum)?.sqrt()
            }
        };
        if !norm.is_finite() {
            return Ok((norm, false));
        }
        let coef = meshgrad_nn::optim::clip_coef(max_norm, norm);
        self.timeline
            .record(SpanKind::Optimizer, "optimizer step", || -> Result<()> {
                match self.reducer {
                    Reducer::AllReduce => opt.step_scaled(lr, coef / scale)?,
                    Reducer::Sharded(sdp) => {
                        if max_norm > 0.0 {
                            sdp.clip_grads_with_norm(max_norm, norm)?;
                        }
                        sdp.step(lr)?;
                    }
                }
                Ok(())
            })?;
        Ok((norm, true))
    }
}

/// Trains `task`'s model on the ranks of `layout` (with `pp` above 1) and returns the leader's
/// summary.
pub(crate) fn train_pipeline<T: PipelineTask>(
    task: &T,
    layout: &ParallelLayout,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    opts.activation_checkpointing.check(layout.pp())?;
    let (schedule, method) = pipeline_shape(task, layout, opts)?;
    // In a job of processes this process is one rank of the world; rank 0 alone plans and
    // prints.
    let world = crate::train_parallel::process_world(layout, opts.collective_timeout)?;
    let plan = match &world {
        None => profile_and_partition(task, layout, opts, schedule, &method)?,
        Some(world) => plan_on_world(task, layout, opts, schedule, &method, world.as_ref())?,
    };
    if let Some(partition) = plan
        .partition
        .as_ref()
        .filter(|_| verbosity != Verbosity::Quiet)
    {
        println!(
            "pipeline stages (--partition {}; {} ranks x {} chunk(s), predicted per microbatch):",
            opts.pipeline.partition,
            layout.pp(),
            plan.schedule.chunks,
        );
        for line in partition.summary_lines() {
            println!("  {line}");
        }
    }
    let origin = Instant::now();
    let timelines: Vec<Timeline> = (0..layout.world_size())
        .map(|r| Timeline::new(r, origin))
        .collect();
    // Per rank and step: when the rank started and finished its schedule.
    let step_windows = std::sync::Mutex::new(Vec::<StepWindow>::new());
    let reference = task.cfg().train.reference;
    let (mut summary, peak) = on_ranks(layout, opts.collective_timeout, reference, |ctx, mesh| {
        rank_main(
            task,
            layout,
            opts,
            &plan,
            ctx,
            mesh,
            &Timelines {
                all: &timelines,
                windows: &step_windows,
                // In a job of processes the other ranks' timelines are in their own processes.
                gather: world.is_some(),
            },
            verbosity,
        )
    })?;
    let measured = measured_idle_after_warmup(
        &timelines,
        layout,
        &step_windows.lock().unwrap_or_else(|e| e.into_inner()),
    );
    if let Some(partition) = plan
        .partition
        .as_ref()
        .filter(|_| verbosity != Verbosity::Quiet)
    {
        println!(
            "pipeline: {} schedule={} predicted_slowest_ms={:.3} simulated_idle={:.4} \
             measured_idle={:.4}",
            plan.fragment(),
            opts.pipeline.schedule,
            partition.max_time_ms(),
            plan.simulated_idle,
            measured
        );
    }
    if let Some(path) = &opts.pipeline.trace {
        write_chrome_trace(path, &timelines)
            .with_context(|| format!("writing the trace {}", path.display()))?;
        if verbosity != Verbosity::Quiet {
            println!("trace: {}", path.display());
        }
    }
    summary.peak_memory_per_rank = peak;
    Ok(summary)
}

/// When a rank ran one step's schedule: `(global rank, step, start, end)`, seconds from the
/// run's origin.
type StepWindow = (usize, usize, f64, f64);

/// The measured idle fraction of the pipeline of global rank 0 (its `pp` ranks; the other
/// pipelines of a composed layout do the same work) over each step's window, from the first
/// of its ranks starting the schedule to the last finishing it: the mean over the steps after
/// the first, which warms up (the first step's figure when there is only one).
fn measured_idle_after_warmup(
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
struct Timelines<'a> {
    all: &'a [Timeline],
    windows: &'a Mutex<Vec<StepWindow>>,
    /// Whether this process records only its own rank (MPI): the ranks then send theirs to
    /// world rank 0 after the run ([`gather_timelines`]).
    gather: bool,
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
fn gather_timelines(world: &dyn Communicator, t: &Timelines<'_>, sync_s: f64) -> Result<()> {
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

#[allow(clippy::too_many_arguments)]
fn rank_main<T: PipelineTask>(
    task: &T,
    layout: &ParallelLayout,
    opts: &TrainOptions,
    plan: &PipelinePlan,
    ctx: &RankCtx,
    mesh: &LayoutMesh,
    timelines: &Timelines<'_>,
    verbosity: Verbosity,
) -> Result<Option<TrainSummary>> {
    let cfg = task.cfg();
    let timeline = &timelines.all[ctx.rank];
    let step_windows = timelines.windows;
    let pp = mesh.pp_group();
    let (p, world_pp) = (pp.rank(), pp.world_size());
    let v = plan.schedule.chunks;
    let tp =
        (mesh.tp_degree() > 1).then(|| tensor_parallel(mesh.tp_group(), opts.sequence_parallel));
    let fsdp = layout.zero() == Some(ZeroStage::Three);
    let chunks: Vec<T::Stage> = (0..v)
        .map(|c| {
            task.build_stage(
                plan.specs[c * world_pp + p].clone(),
                tp.clone(),
                fsdp,
                opts.activation_checkpointing.on_stage(p),
            )
        })
        .collect::<Result<_>>()?;
    let module = Chunks(&chunks);
    let (mut opt, lr_schedule) = optimizer_and_schedule(cfg, &module)?;
    let reducer = match layout.zero() {
        None => Reducer::AllReduce,
        Some(stage) => Reducer::Sharded(ShardedDataParallel::new(
            &module,
            opt.param_groups().to_vec(),
            *opt.config(),
            mesh.shard_topology()?,
            ShardConfig::new(stage),
        )?),
    };
    let sharded = match &reducer {
        Reducer::Sharded(sdp) => Some(sdp),
        Reducer::AllReduce => None,
    };
    // A stage holds part of the model: it loads the tensors it has.
    let (start, saver) = crate::run_checkpoint::begin_rank(
        cfg,
        opts,
        &layout.to_string(),
        Some(ctx.comm.as_ref()),
        &module,
        &mut opt,
        sharded,
        true,
    )?;
    let start_step = start.step;
    let hook = saver.hook(sharded);
    let grads = PipelineGrads::new(&chunks, pp.clone())?;
    let params = module.parameters();
    let sync = PipelineSync {
        grads: &grads,
        reducer: &reducer,
        params: params.clone(),
        dp: mesh.dp_group(),
        pp: pp.clone(),
        timeline,
        reference: cfg.train.reference,
    };
    let dp = mesh.dp_degree();
    let rows = rank_rows(cfg.train.batch_size, dp, mesh.dp_rank())?;
    let leader = ctx.rank == 0;
    let mut rep = if leader {
        Reporter::leader(cfg, verbosity, start_step)?
    } else {
        Reporter::silent()
    };
    let per_rank = (rows.end - rows.start) as usize;
    let desc = layout_desc(layout, per_rank, opts.microbatches);
    rep.say(task.header(&format!(
        "{desc}, schedule {}, {}",
        plan.schedule.kind,
        plan.fragment()
    )));
    // In a job of processes, the common moment every rank's times are taken from (see gather_timelines).
    let sync_s = if timelines.gather {
        ctx.comm.barrier()?.wait()?;
        timeline.now_s()
    } else {
        0.0
    };
    let reference = cfg.train.reference.then(|| ReferenceChunks::new(&chunks));
    let total_groups = cfg.train.batch_size / cfg.train.row_group;
    // f16: the dynamic loss scale (continued from a resumed checkpoint's).
    let scaler = crate::train::run_loss_scaler(cfg, start.loss_scaler.as_ref())?;
    let micro_step = |step: usize| -> Result<f64> {
        let mbs = task.train_microbatches(step as u64, rows.clone(), opts.microbatches, dp)?;
        let t0 = timeline.now_s();
        let loss = match &reference {
            None => execute_scaled(
                &chunks,
                &plan.schedule,
                pp.as_ref(),
                &mbs,
                step as u64,
                Some(timeline),
                scaler.as_ref().map_or(1.0, |s| s.borrow().scale()),
            )?,
            Some(r) => r.step(
                &chunks,
                &plan.schedule,
                pp.as_ref(),
                &grads,
                &mbs,
                step as u64,
                task.reference_loss_scale(total_groups),
                timeline,
            )?,
        };
        let t1 = timeline.now_s();
        step_windows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((ctx.rank, step, t0, t1));
        Ok(loss)
    };
    let val = || -> Result<f64> {
        if reference.is_some() {
            return val_loss_reference(task, &chunks, pp.as_ref(), &rows, total_groups, &sync);
        }
        let batches = task.val_batches(rows.clone())?;
        for c in &chunks {
            c.set_training(false);
        }
        let mut sum = 0.0;
        let r = batches.iter().try_for_each(|b| -> Result<()> {
            sum += forward_only(&chunks, pp.as_ref(), b)?;
            Ok(())
        });
        for c in &chunks {
            c.set_training(true);
        }
        r?;
        task.val_loss(sum, batches.len(), mesh.dp_group().as_ref())
    };
    let result = drive_loop(
        cfg,
        &module,
        &mut opt,
        &lr_schedule,
        &params,
        &sync,
        &mut rep,
        // Reference mode: a step's share is the tree sum of its row groups' losses, summed over
        // the data-parallel ranks; the mean divides by the row groups.
        if reference.is_some() {
            task.reference_loss_scale(total_groups)
        } else {
            1.0
        },
        scaler.as_ref(),
        micro_step,
        val,
        &RunControl {
            start_step,
            loss_scaler: start.loss_scaler.clone(),
            world: Some(ctx.comm.as_ref()),
            save_every: opts.save_every,
            save: Some(&*hook),
        },
    )?;
    if timelines.gather {
        gather_timelines(ctx.comm.as_ref(), timelines, sync_s)?;
    }
    // The single-device state dict on the leader.
    if let Reducer::Sharded(sdp) = &reducer {
        sdp.summon_full_params()?;
    }
    let local = full_state_dict(&module)?;
    let gathers = mesh.dp_rank() == 0 && mesh.tp_rank() == 0;
    let tensors = if gathers {
        gather_stages(pp.as_ref(), local)?
    } else {
        None
    };
    match tensors {
        Some(t) if leader => Ok(Some(task.finish(&t, rep, result, verbosity)?)),
        _ => Ok(None),
    }
}

/// Sends every pipeline rank's named tensors to pipeline rank 0, which returns them all (the
/// first copy of a name kept: the tied table's copies are equal). Names travel as a tensor of
/// byte values.
fn gather_stages(
    pp: &dyn Communicator,
    local: Vec<(String, Tensor)>,
) -> Result<Option<Vec<(String, Tensor)>>> {
    let rank = pp.rank();
    if rank != 0 {
        let names: Vec<f32> = local
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join("\n")
            .bytes()
            .map(f32::from)
            .collect();
        let len = names.len();
        pp.send(&Tensor::from_vec(names, len, Device::Cpu)?, 0)?
            .wait()?;
        for (_, t) in &local {
            pp.send(t, 0)?.wait()?;
        }
        return Ok(None);
    }
    let mut all = local;
    for src in 1..pp.world_size() {
        let bytes: Vec<u8> = pp
            .recv(src)?
            .wait()?
            .to_vec::<f32>()?
            .into_iter()
            .map(|b| b as u8)
            .collect();
        let names = String::from_utf8(bytes).context("pipeline gather: parameter names")?;
        for name in names.split('\n') {
            let t = pp.recv(src)?.wait()?;
            if !all.iter().any(|(n, _)| n == name) {
                all.push((name.to_string(), t));
            }
        }
    }
    Ok(Some(all))
}

/// Reference mode's view of a rank's chunks (see [`crate::reference`]): each chunk's parameters,
/// and which of them are a copy of the tied table that the other end of the pipeline also holds.
struct ReferenceChunks {
    /// Per chunk: its parameters.
    params: Vec<Vec<Var>>,
    /// Per chunk: the positions in `params` of its tied copies, in
    /// [`ModelStage::tied_parameters`] order, and whether the chunk is virtual stage 0 (the
    /// embedding's copy; else the head's). Empty for a chunk that holds no copy or both uses.
    tied: Vec<(Vec<usize>, bool)>,
}

impl ReferenceChunks {
    fn new<S: ModelStage>(chunks: &[S]) -> Self {
        let mut params = Vec::with_capacity(chunks.len());
        let mut tied = Vec::with_capacity(chunks.len());
        for c in chunks {
            let named = c.named_parameters();
            let spec = c.spec();
            // A chunk with both the embedding and the head adds both uses in one backward.
            let pos = if spec.embedding != spec.head {
                c.tied_parameters()
                    .iter()
                    .filter_map(|n| named.iter().position(|(k, _)| k == n))
                    .collect()
            } else {
                Vec::new()
            };
            tied.push((pos, spec.embedding));
            params.push(named.into_iter().map(|(_, p)| p).collect());
        }
        ReferenceChunks { params, tied }
    }

    /// One step's schedule in reference mode, one microbatch per row group of this
    /// data-parallel rank: each microbatch's loss is multiplied by `loss_scale` (the task's
    /// [`PipelineTask::reference_loss_scale`]), each chunk's per-microbatch gradients are taken out of `.grad`
    /// as soon as they are complete and added over the aligned binary tree of the row groups
    /// ([`GradTree`], in whatever order the schedule finishes them), the tied table's two copies
    /// per microbatch first ([`PipelineGrads::reduce_tied_grads_by_microbatch`]). Leaves the
    /// tree sums in `.grad` and returns the tree sum of the row groups' losses on every
    /// pipeline rank.
    #[allow(clippy::too_many_arguments)]
    fn step<S: ModelStage>(
        &self,
        chunks: &[S],
        schedule: &Schedule,
        pp: &dyn Communicator,
        grads: &PipelineGrads,
        mbs: &[Microbatch<S::Batch>],
        step: u64,
        loss_scale: f64,
        timeline: &Timeline,
    ) -> Result<f64> {
        let m = mbs.len();
        let mut trees: Vec<GradTree> = (0..chunks.len()).map(|_| GradTree::new(m)).collect();
        let mut first: Vec<Vec<Option<Tensor>>> = vec![Vec::new(); m];
        let mut last: Vec<Vec<Option<Tensor>>> = vec![Vec::new(); m];
        let mut on_grads = |mb: usize, c: usize| -> meshgrad_tensor::Result<()> {
            let mut g = take_grads(&self.params[c]);
            let (pos, is_first) = &self.tied[c];
            if !pos.is_empty() {
                let tied: Vec<Option<Tensor>> = pos.iter().map(|&i| g[i].take()).collect();
                if *is_first {
                    first[mb] = tied;
                } else {
                    last[mb] = tied;
                }
            }
            trees[c]
                .push(mb, g)
                .map_err(|e| meshgrad_tensor::Error::msg(format!("{e:#}")))
        };
        let losses = execute_with(
            chunks,
            schedule,
            pp,
            mbs,
            step,
            Some(timeline),
            ExecuteOptions {
                loss_scale: Some(loss_scale),
                on_grads: Some(&mut on_grads),
            },
        )?;
        for (tree, params) in trees.into_iter().zip(&self.params) {
            for (p, g) in params.iter().zip(tree.finish()?) {
                p.set_grad(g);
            }
        }
        // On a rank without a copy, every microbatch's list is empty (as many as its copies).
        grads.reduce_tied_grads_by_microbatch(&first, &last)?;
        // The last stage's tree sum on every pipeline rank (the others add zeros: exact).
        Ok(all_reduce_scalar(pp, tree_sum_f64(&losses), ReduceOp::Sum)?)
    }
}

/// The validation loss in reference mode, as one device computes it
/// (`val_loss_reference` in [`crate::train`]): each validation batch's loss is the tree sum of
/// its row groups' losses (this rank's row groups of `rows`, each forward through the pipeline
/// on its own), summed over the data-parallel ranks by `sync` and normalised by the task
/// ([`PipelineTask::reference_val_loss`]); the batches' losses are averaged in order.
fn val_loss_reference<T: PipelineTask>(
    task: &T,
    chunks: &[T::Stage],
    pp: &dyn Communicator,
    rows: &Range<u64>,
    total: usize,
    sync: &dyn GradSync,
) -> Result<f64> {
    let cfg = task.cfg();
    let groups = row_groups(rows.clone(), cfg.train.row_group)?;
    let per_group = groups
        .iter()
        .map(|g| task.val_batches(g.clone()))
        .collect::<Result<Vec<_>>>()?;
    let n = cfg.train.eval_batches.max(1);
    for c in chunks {
        c.set_training(false);
    }
    let r = (|| -> Result<f64> {
        let mut sum = 0.0;
        for i in 0..n {
            let mut losses = Vec::with_capacity(per_group.len());
            for batches in &per_group {
                losses.push(forward_only(chunks, pp, &batches[i])?);
            }
            sum += task.reference_val_loss(sync.mean(tree_sum_f64(&losses))?, i as u64, total)?;
        }
        Ok(sum / n as f64)
    })();
    for c in chunks {
        c.set_training(true);
    }
    r
}

/// The options a pipeline run uses in reference mode: the pipeline's microbatches are this
/// data-parallel rank's row groups (`train.batch_size / dp / train.row_group`, one row group
/// per microbatch), so `--microbatches` must be left at 1 or give that number; a one-line
/// refusal otherwise. `opts` unchanged outside reference mode or without a pipeline.
pub(crate) fn reference_pipeline_options(
    cfg: &TrainConfig,
    layout: &ParallelLayout,
    opts: &TrainOptions,
) -> Result<TrainOptions> {
    let mut opts = opts.clone();
    if !cfg.train.reference || layout.pp() <= 1 {
        return Ok(opts);
    }
    let (b, r, dp) = (
        cfg.train.batch_size,
        cfg.train.row_group,
        layout.data_parallel_degree(),
    );
    let m = b / dp / r;
    if opts.microbatches != 1 && opts.microbatches != m {
        anyhow::bail!(
            "reference mode: a pipeline runs one microbatch per row group ({m} per \
             data-parallel rank: batch {b} / {dp} data-parallel rank(s) / row group {r}), not \
             --microbatches {}; choose the microbatches with --row-group",
            opts.microbatches
        );
    }
    opts.microbatches = m;
    Ok(opts)
}
