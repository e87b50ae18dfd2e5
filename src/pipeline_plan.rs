//! What a run's pipeline is, decided before the ranks start: the pipeline flags of `meshgrad
//! train` ([`PipelineOptions`]), the schedule and the partition ([`PipelinePlan`]). With `pp`
//! above 1 the model is profiled on this device (each block's, the embedding's and the head's
//! forward + backward time and memory, [`profile_layers`]) and cut into `P x V` contiguous
//! virtual stages by `--partition` (`auto`/`speed`, `memory`, `even` or explicit first blocks);
//! `V` is `--chunks` (interleaved schedule only). Without a pipeline the plan is the whole model
//! as one stage, run by the one-stage 1F1B schedule over the microbatches (gradient
//! accumulation).

use anyhow::{Context, Result};
use meshgrad_nn::StageSpec;
use meshgrad_parallel::pipeline::partition::{MemoryModel, ModelCosts, Partition, PartitionMethod};
use meshgrad_parallel::pipeline::{
    profile_layers, simulate, Costs, ProfileOptions, Schedule, ScheduleKind,
};
use meshgrad_parallel::{Communicator, ParallelLayout};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::recipe::{Recipe, StageBuild};
use crate::run_setup::TrainOptions;

/// Profiles every layer of `task`'s model on this device ([`profile_layers`]: a few timed
/// forward + backward passes of each block, the embedding and the head on one microbatch of
/// `rows` rows, single device, no tensor parallelism) for the partitioner.
fn profile_task<T: Recipe>(task: &T, rows: usize) -> Result<ModelCosts> {
    let batch = task.profile_batch(rows)?;
    let opts = ProfileOptions::new(1, 3).with_min_sample_ms(2.0);
    let build = |spec: StageSpec| {
        task.build_stage(StageBuild::plain(spec))
            .map_err(|e| meshgrad_tensor::Error::msg(format!("{e:#}")))
    };
    profile_layers(task.n_blocks(), build, &batch, &opts)
        .with_context(|| format!("profiling the {}'s layers for --partition", T::NAME))
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
    /// No pipeline: the whole model of `n_blocks` blocks as one stage, the one-stage 1F1B
    /// schedule over `microbatches` microbatches.
    pub(crate) fn single(n_blocks: usize, microbatches: usize) -> Result<PipelinePlan> {
        Ok(PipelinePlan {
            schedule: Schedule::generate(ScheduleKind::OneFOneB, 1, microbatches, None)?,
            partition: None,
            boundaries: vec![0],
            specs: vec![StageSpec::full(n_blocks)],
            simulated_idle: f64::NAN,
        })
    }

    /// The run summary's fragment: `partition=0,3,6,9` (the first block of each virtual stage).
    pub(crate) fn fragment(&self) -> String {
        let b: Vec<String> = self.boundaries.iter().map(ToString::to_string).collect();
        format!("partition={}", b.join(","))
    }
}

/// What the pipeline flags and the layout decide without profiling: the schedule and how to
/// partition. Every refusal in one line, the same on every rank.
pub(crate) fn pipeline_shape<T: Recipe>(
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
            T::NAME
        );
    }
    let method = PartitionMethod::parse_for(&po.partition, stages, n)
        .map_err(|e| anyhow::anyhow!("--partition {}: {e}", po.partition))?;
    Ok((schedule, method))
}

/// Profiles the model, partitions it by `method` for `schedule` and simulates the schedule with
/// the predicted costs: every refusal in one line, before any training.
pub(crate) fn profile_and_partition<T: Recipe>(
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
pub(crate) fn plan_on_world<T: Recipe>(
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
        crate::ranks::or_abort_job(
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

/// The options a run uses in reference mode: its microbatches are this data-parallel rank's
/// row groups (`train.batch_size / dp / train.row_group`, one row group per microbatch; `layout`
/// `None` is one device). A pipeline refuses another `--microbatches` than 1 or that number in
/// one line; without a pipeline `--microbatches` does not change a reference run (its passes
/// are its row groups whatever it says). `opts` unchanged outside reference mode.
pub(crate) fn reference_options(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
) -> Result<TrainOptions> {
    let mut opts = opts.clone();
    if !cfg.train.reference {
        return Ok(opts);
    }
    let (b, r, dp) = (
        cfg.train.batch_size,
        cfg.train.row_group,
        layout.map_or(1, ParallelLayout::data_parallel_degree),
    );
    let m = b / dp / r;
    let pipeline = layout.is_some_and(|l| l.pp() > 1);
    if pipeline && opts.microbatches != 1 && opts.microbatches != m {
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
