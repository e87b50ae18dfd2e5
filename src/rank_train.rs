//! The trainer: one run set-up, one micro-step, one validation and one step loop for every model
//! family (a [`Recipe`]) and every layout: one device, data parallelism (`dp`, `zero1/2`,
//! `fsdp`, `hsdp`), tensor parallelism (`tp`, `--sequence-parallel`), pipelines (`pp`), their
//! compositions, reference mode, and every backend (threads, TCP, MPI, NCCL).
//!
//! A layout without a pipeline is a pipeline of one stage: the whole model is the stage
//! [`StageSpec::full`](meshgrad_nn::StageSpec::full) and the step runs the one-stage 1F1B schedule over the rank's
//! microbatches (gradient accumulation); one device is a layout of one rank. Each rank builds
//! its chunks (virtual stages `c * P + p` on pipeline rank `p`, under their global names, with
//! the tensor-parallel plan and, for `fsdp`/`hsdp`, delayed initialisation), wraps them for
//! its data parallelism ([`DataParallel::for_layout`]) and runs [`drive_loop`] with the
//! schedule ([`execute_with`], the f16 loss scale seeding the backwards) as its micro-step and
//! the rank's end of the step in [`RankSync`].
//!
//! **Reference mode** (`--reference`, see README's "Reference mode") makes every layout run the
//! single device's reference run bit for bit:
//!
//! * the microbatches are the data-parallel rank's row groups, one each
//!   ([`reference_options`](crate::pipeline_plan::reference_options));
//! * the last stage multiplies each microbatch's loss by `1 / G` (`G` row groups in the global
//!   batch) before its backward, and each chunk's gradients of a microbatch are taken out of
//!   `.grad` as soon as they are complete (after its backward, or the zero-bubble schedule's
//!   weight pass; [`ExecuteOptions::on_grads`]) and added over the row groups' aligned binary tree
//!   (`RowGroupTrees`), whatever order the schedule finishes them in;
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
//! Validation runs forward through the stages ([`forward_only`]). For the checkpoint the
//! sharded and tensor-parallel parameters are gathered within each stage and the stages send
//! theirs to rank 0, which assembles the single-device state dict for the recipe's `finish`.
//! After a pipeline run the leader prints `pipeline: partition=<first block of each virtual
//! stage> schedule=<kind> predicted_slowest_ms=<x> simulated_idle=<fraction>
//! measured_idle=<fraction>` and, with `--trace FILE`, writes a Chrome trace of every rank's
//! actions.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use meshgrad_autograd::{source_grads, Var};
use meshgrad_nn::module::Child;
use meshgrad_nn::tp::full_state_dict;
use meshgrad_nn::{InitialValues, ModelStage, Module};
use meshgrad_parallel::comm::gather_named;
use meshgrad_parallel::comm::{all_reduce_scalar, InProcessComm, RankCtx};
use meshgrad_parallel::pipeline::{
    execute_with, forward_only, gather_timelines, mean_loss, measured_idle_after_warmup,
    write_chrome_trace, ExecuteOptions, Microbatch, PipelineGrads, Schedule, StepWindow, Timeline,
    Timelines,
};
use meshgrad_parallel::tp::{context_parallel_traced, expert_parallel_traced, tensor_parallel};
use meshgrad_parallel::{
    rank_rows, Communicator, DataParallel, LayoutMesh, ParallelLayout, ReduceOp, ZeroStage,
};
use meshgrad_tensor::alloc::{memory_stats, MemoryTracker};
use meshgrad_tensor::tree_sum::tree_sum_f64;
use meshgrad_tensor::Tensor;

use crate::config::TrainConfig;
use crate::expert_load::PendingExperts;
use crate::pipeline_plan::{pipeline_shape, plan_on_world, profile_and_partition, PipelinePlan};
use crate::rank_sync::RankSync;
use crate::recipe::{Recipe, StageBuild};
use crate::reference::row_groups;
use crate::run_setup::{optimizer_and_schedule, TrainOptions, TrainSummary, Verbosity};
use crate::step_loop::{drive_loop, GradSync, Reporter, RunControl, StepShare};
use meshgrad_nn::moe::collect_expert_load;
use meshgrad_parallel::grad_tree::{take_grads, RowGroupTrees};

/// A rank's chunks as one module (for the optimizer and the data-parallel wrapper): their
/// parameters under their global names.
struct Chunks<'a, S>(&'a [S]);

impl<S: Module> Module for Chunks<'_, S> {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        for c in self.0 {
            c.visit_children(f);
        }
    }
    fn module_type(&self) -> &'static str {
        "RankChunks"
    }
}

/// Trains `recipe`'s model on one device (`layout` `None`) or on the ranks of `layout`, and
/// returns the leader's summary with the largest rank's peak memory.
pub(crate) fn run<R: Recipe>(
    recipe: &R,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    let Some(layout) = layout else {
        return run_single(recipe, opts, verbosity);
    };
    let pp = layout.pp();
    opts.activation_checkpointing.check(pp)?;
    // In a job of processes this process is one rank of the world; rank 0 alone plans and
    // prints.
    let world = crate::ranks::process_world(layout, opts.collective_timeout)?;
    let plan = if pp > 1 {
        let (schedule, method) = pipeline_shape(recipe, layout, opts)?;
        match &world {
            None => profile_and_partition(recipe, layout, opts, schedule, &method)?,
            Some(world) => plan_on_world(recipe, layout, opts, schedule, &method, world.as_ref())?,
        }
    } else {
        PipelinePlan::single(recipe.n_blocks(), opts.microbatches)?
    };
    if let Some(partition) = plan
        .partition
        .as_ref()
        .filter(|_| verbosity != Verbosity::Quiet)
    {
        println!(
            "pipeline stages (--partition {}; {} ranks x {} chunk(s), predicted per microbatch):",
            opts.pipeline.partition, pp, plan.schedule.chunks,
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
    let step_windows = Mutex::new(Vec::<StepWindow>::new());
    let reference = recipe.cfg().train.reference;
    let init = initial_values(recipe.cfg(), opts)?;
    let summary =
        crate::ranks::on_ranks(layout, opts.collective_timeout, reference, |ctx, mesh| {
            let at = RankAt {
                layout,
                label: layout.to_string(),
                plan: &plan,
                ctx,
                mesh,
                timelines: &Timelines {
                    all: &timelines,
                    windows: &step_windows,
                    // In a job of processes the other ranks' timelines are in their own processes.
                    gather: world.is_some(),
                },
                init: init.clone(),
            };
            rank_main(recipe, opts, &at, verbosity)
        })?;
    if pp > 1 {
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
    }
    write_trace(opts, &timelines, verbosity)?;
    Ok(summary)
}

/// `--trace`: writes the ranks' timelines as a Chrome trace (on the process that holds them all,
/// or rank 0's of a job of processes, which gathered them).
fn write_trace(opts: &TrainOptions, timelines: &[Timeline], verbosity: Verbosity) -> Result<()> {
    if let Some(path) = &opts.pipeline.trace {
        write_chrome_trace(path, timelines)
            .with_context(|| format!("writing the trace {}", path.display()))?;
        if verbosity != Verbosity::Quiet {
            println!("trace: {}", path.display());
        }
    }
    Ok(())
}

/// One device: the trainer on this thread, as the one rank of a world of one (on the run's
/// device; the peak is the device's, as the allocator counts it).
fn run_single<R: Recipe>(
    recipe: &R,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    opts.activation_checkpointing.check(1)?;
    let cfg = recipe.cfg();
    let layout = ParallelLayout::data_parallel(1)?;
    let plan = PipelinePlan::single(recipe.n_blocks(), opts.microbatches)?;
    let comm: Arc<dyn Communicator> = Arc::new(
        InProcessComm::create_world(1, opts.collective_timeout)?
            .pop()
            .context("a world of one rank")?,
    );
    let ctx = RankCtx {
        rank: 0,
        world_size: 1,
        comm: comm.clone(),
        tracker: MemoryTracker::new(),
    };
    let mesh = layout.mesh(crate::reference::mesh_world(comm, cfg.train.reference))?;
    let timelines = [Timeline::new(0, Instant::now())];
    let windows = Mutex::new(Vec::new());
    let at = RankAt {
        layout: &layout,
        label: "single".into(),
        plan: &plan,
        ctx: &ctx,
        mesh: &mesh,
        timelines: &Timelines {
            all: &timelines,
            windows: &windows,
            gather: false,
        },
        init: initial_values(cfg, opts)?,
    };
    let summary =
        rank_main(recipe, opts, &at, verbosity)?.context("the single rank returned no summary")?;
    write_trace(opts, &timelines, verbosity)?;
    Ok(summary)
}

/// `--init-from`'s weights, read once for every rank of this process (none when the run
/// resumes: the checkpoint has its own).
fn initial_values(cfg: &TrainConfig, opts: &TrainOptions) -> Result<Option<Arc<InitialValues>>> {
    match (&opts.init_from, &opts.resume) {
        (Some(dir), None) => Ok(Some(Arc::new(crate::init_from::initial_values(dir, cfg)?))),
        _ => Ok(None),
    }
}

/// Where a rank runs: its layout (one rank's for one device) and the label checkpoints record,
/// the plan, its context and mesh, where it records its timeline, and the weights it starts
/// from.
struct RankAt<'a> {
    layout: &'a ParallelLayout,
    label: String,
    plan: &'a PipelinePlan,
    ctx: &'a RankCtx,
    mesh: &'a LayoutMesh,
    timelines: &'a Timelines<'a>,
    /// `--init-from`: the weights every rank copies its part of.
    init: Option<Arc<InitialValues>>,
}

/// What the header says about the run's layout: nothing on one device (but its micro-batches),
/// the layout's ranks and rows otherwise, and a pipeline's schedule and partition.
fn layout_header(at: &RankAt<'_>, rows: usize, opts: &TrainOptions) -> String {
    if at.label == "single" {
        return if opts.microbatches > 1 {
            format!(", {} micro-batches", opts.microbatches)
        } else {
            String::new()
        };
    }
    let desc = crate::ranks::layout_desc(at.layout, rows, opts.microbatches);
    if at.layout.pp() > 1 {
        format!(
            "{desc}, schedule {}, {}",
            at.plan.schedule.kind,
            at.plan.fragment()
        )
    } else {
        desc
    }
}

/// One rank's run: build its chunks, wrap them, resume, drive the step loop with the schedule,
/// gather the single-device state dict on the leader and let the recipe finish there. Returns
/// the leader's summary (with the largest rank's peak memory before finishing; every rank takes
/// part in that maximum), `None` elsewhere.
fn rank_main<R: Recipe>(
    recipe: &R,
    opts: &TrainOptions,
    at: &RankAt<'_>,
    verbosity: Verbosity,
) -> Result<Option<TrainSummary>> {
    let cfg = recipe.cfg();
    let (layout, plan, ctx, mesh) = (at.layout, at.plan, at.ctx, at.mesh);
    let timelines = at.timelines;
    let timeline = &timelines.all[ctx.rank];
    let step_windows = timelines.windows;
    let pp = mesh.pp_group();
    let (p, world_pp) = (pp.rank(), pp.world_size());
    let v = plan.schedule.chunks;
    let tp =
        (mesh.tp_degree() > 1).then(|| tensor_parallel(mesh.tp_group(), opts.sequence_parallel));
    // Context parallelism: the ring over the cp group; each rank takes its chunks of the rows.
    // `--trace`: the ring's hops and the all-to-alls are spans of this rank's timeline.
    let traced = opts.pipeline.trace.as_ref().map(|_| timeline.clone());
    // Reference mode's folded position order (on one device too): its leaves over the cp group.
    let folded = crate::reference::folded_positions(cfg)
        .then(|| crate::reference_tp::chunk_count(cfg))
        .flatten();
    let cp = match (layout.cp() > 1, folded) {
        (false, None) => None,
        (_, leaves) => {
            let cp =
                context_parallel_traced(mesh.cp_group(), traced.clone()).with_mode(opts.cp_mode);
            Some(match leaves {
                Some(k) => cp.with_folded(k)?,
                None => cp,
            })
        }
    };
    let order = cp
        .as_ref()
        .filter(|cp| cp.degree() > 1)
        .map(|cp| cp.order());
    let ep = mesh
        .ep_group()
        .map(|g| expert_parallel_traced(g, traced.clone()).with_reference(cfg.train.reference));
    let own_chunks = |b: <R::Stage as ModelStage>::Batch| match &order {
        Some(o) => recipe.context_chunks(b, o),
        None => Ok(b),
    };
    // ZeRO-3 / FSDP cuts its shards from a delayed-initialisation model one unit at a time, so
    // no rank holds the whole model.
    let fsdp = layout.zero() == Some(ZeroStage::Three);
    let chunks: Vec<R::Stage> = (0..v)
        .map(|c| {
            recipe.build_stage(StageBuild {
                spec: plan.specs[c * world_pp + p].clone(),
                tp: tp.clone(),
                cp: cp.clone(),
                ep: ep.clone(),
                delayed: fsdp,
                checkpointing: opts.activation_checkpointing.on_stage(p),
                init: at.init.clone(),
            })
        })
        .collect::<Result<_>>()?;
    let module = Chunks(&chunks);
    let (mut opt, lr_schedule) = optimizer_and_schedule(cfg, &module)?;
    let wrapper = DataParallel::for_layout(mesh, &module, &opt)?;
    // A stage, or an expert-parallel rank, holds part of the model: it loads the tensors it
    // has (a checkpoint holds every expert under its global name).
    let (start, saver) = crate::run_checkpoint::begin_rank(
        cfg,
        opts,
        &at.label,
        Some(ctx.comm.as_ref()),
        &module,
        &mut opt,
        &wrapper,
        world_pp > 1 || ep.is_some(),
    )?;
    let start_step = start.step;
    let hook = saver.hook(&wrapper);
    let grads = PipelineGrads::new(&chunks, pp.clone())?;
    let sync = RankSync {
        grads: &grads,
        wrapper: &wrapper,
        dp: mesh.dp_group(),
        timeline,
        reference: cfg.train.reference,
        last_weight_gradients: plan.schedule.last_weight_gradients(pp.rank()),
    };
    // The ranks of a context-parallel group read the same rows (each its chunks of them).
    let dp = mesh.batch_degree();
    let rows = rank_rows(cfg.train.batch_size, dp, mesh.batch_rank())?;
    let leader = ctx.rank == 0;
    let mut rep = if leader {
        Reporter::leader(cfg, verbosity, start_step)?
    } else {
        Reporter::silent()
    };
    rep.say(recipe.header(&layout_header(at, (rows.end - rows.start) as usize, opts)));
    // In a job of processes, the common moment every rank's times are taken from (see
    // gather_timelines).
    let sync_s = if timelines.gather {
        ctx.comm.barrier()?.wait()?;
        timeline.now_s()
    } else {
        0.0
    };
    let sources = ep.as_ref().map_or(1, |e| e.degree());
    let reference = (cfg.train.reference).then(|| ReferenceChunks::new(&chunks, sources));
    let total_groups = cfg.train.batch_size / cfg.train.row_group;
    // f16: the dynamic loss scale (continued from a resumed checkpoint's).
    let scaler = crate::run_setup::run_loss_scaler(cfg, start.loss_scaler.as_ref())?;
    let aux_coef = recipe.aux_loss_coef();
    let micro_step = |step: usize| -> Result<StepShare> {
        let mbs = recipe
            .train_microbatches(
                step as u64,
                rows.clone(),
                opts.microbatches,
                mesh.dp_degree(),
            )?
            .into_iter()
            .map(|mb| {
                Ok(Microbatch {
                    first_row: mb.first_row,
                    batch: own_chunks(mb.batch)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let t0 = timeline.now_s();
        // A mixture of experts' layers record their load during the step's forwards.
        let (loss, load) = collect_expert_load(|| -> Result<f64> {
            Ok(match &reference {
                None => {
                    let m = mbs.len();
                    let factor = scaler.as_ref().map_or(1.0, |s| s.borrow().scale());
                    let mut before = |mb: usize, chunk: usize| -> meshgrad_tensor::Result<()> {
                        sync.before_grads(mb, chunk);
                        Ok(())
                    };
                    let losses = execute_with(
                        &chunks,
                        &plan.schedule,
                        pp.as_ref(),
                        &mbs,
                        step as u64,
                        Some(timeline),
                        ExecuteOptions {
                            loss_scale: Some(factor / m as f64),
                            on_grads: None,
                            before_grads: Some(&mut before),
                        },
                    )?;
                    mean_loss(pp.as_ref(), &losses)?
                }
                Some(r) => r.step(
                    &chunks,
                    &plan.schedule,
                    pp.as_ref(),
                    &grads,
                    &mbs,
                    step as u64,
                    recipe.reference_loss_scale(total_groups),
                    timeline,
                )?,
            })
        });
        let loss = loss?;
        let t1 = timeline.now_s();
        step_windows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((ctx.rank, step, t0, t1));
        let experts = aux_coef.map(|coef| PendingExperts {
            load,
            dp: mesh.dp_group(),
            pp: pp.clone(),
            coef,
        });
        Ok(StepShare { loss, experts })
    };
    let val = || -> Result<f64> {
        if reference.is_some() {
            return val_loss_reference(
                recipe,
                &chunks,
                pp.as_ref(),
                &rows,
                total_groups,
                &sync,
                &own_chunks,
            );
        }
        let batches = recipe
            .val_batches(rows.clone())?
            .into_iter()
            .map(&own_chunks)
            .collect::<Result<Vec<_>>>()?;
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
        recipe.val_loss(sum, batches.len(), mesh.dp_group().as_ref())
    };
    let result = drive_loop(
        cfg,
        &module,
        &mut opt,
        &lr_schedule,
        &sync,
        &mut rep,
        // Reference mode: a step's share is the tree sum of its row groups' losses, summed over
        // the data-parallel ranks; the mean divides by the row groups.
        if reference.is_some() {
            recipe.reference_loss_scale(total_groups)
        } else {
            1.0
        },
        scaler.as_ref(),
        micro_step,
        val,
        &RunControl {
            start_step,
            world: Some(ctx.comm.as_ref()),
            save_every: opts.save_every,
            save: Some(&*hook),
        },
    )?;
    if timelines.gather {
        gather_timelines(ctx.comm.as_ref(), timelines, sync_s)?;
    }
    // The largest rank's peak so far (one device: the device's), before the leader finishes.
    let peak = if at.label == "single" {
        memory_stats(crate::run_setup::train_device(cfg)?).peak
    } else {
        let mine = ctx.tracker.stats().peak as f64; // exact: below 2^53 bytes
        all_reduce_scalar(ctx.comm.as_ref(), mine, ReduceOp::Max)? as usize
    };
    // The single-device state dict on the leader.
    wrapper.summon_full_params()?;
    let mut local = Some(full_state_dict(&module)?);
    // Expert parallelism: each group's first rank collects the experts of the others.
    if let Some(ep) = mesh.ep_group() {
        local = gather_named(ep.as_ref(), local.unwrap_or_default())?;
    }
    let gathers = mesh.dp_rank() == 0 && mesh.tp_rank() == 0;
    let tensors = match local {
        Some(local) if gathers => gather_named(pp.as_ref(), local)?,
        _ => None,
    };
    match tensors {
        Some(t) if leader => {
            let mut summary = recipe.finish(&t, rep, result, verbosity)?;
            summary.peak_memory_per_rank = peak;
            Ok(Some(summary))
        }
        _ => Ok(None),
    }
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
    /// The ranks whose row groups a parameter's set-aside gradients come from (the
    /// expert-parallel degree; 1 without).
    sources: usize,
}

impl ReferenceChunks {
    fn new<S: ModelStage>(chunks: &[S], sources: usize) -> Self {
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
        ReferenceChunks {
            params,
            tied,
            sources,
        }
    }

    /// One step's schedule in reference mode, one microbatch per row group of this
    /// data-parallel rank: each microbatch's loss is multiplied by `loss_scale` (the task's
    /// [`Recipe::reference_loss_scale`]), each chunk's per-microbatch gradients are taken out of `.grad`
    /// as soon as they are complete and added over the aligned binary tree of the row groups
    /// ([`RowGroupTrees`], in whatever order the schedule finishes them; an expert's
    /// per-source gradients at their sources' leaves), the tied table's two copies
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
        let mut trees: Vec<RowGroupTrees> = (self.params.iter())
            .map(|p| RowGroupTrees::new(p.clone(), m, self.sources))
            .collect();
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
        // Expert parallelism sets its experts' per-source gradients aside for the trees.
        let collecting = source_grads::collect();
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
                before_grads: None,
            },
        )?;
        drop(collecting);
        for tree in trees {
            tree.finish()?;
        }
        // On a rank without a copy, every microbatch's list is empty (as many as its copies).
        grads.reduce_tied_grads_by_microbatch(&first, &last)?;
        // The last stage's tree sum on every pipeline rank (the others add zeros: exact).
        Ok(all_reduce_scalar(pp, tree_sum_f64(&losses), ReduceOp::Sum)?)
    }
}

/// The validation loss in reference mode: each validation batch's loss is the tree sum of
/// its row groups' losses (this rank's row groups of `rows`, each forward through the pipeline
/// on its own, this rank's chunks of it under context parallelism: `own_chunks`), summed over
/// the data-parallel ranks by `sync` and normalised by the task
/// ([`Recipe::reference_val_loss`]); the batches' losses are averaged in order.
#[allow(clippy::too_many_arguments)]
fn val_loss_reference<T: Recipe>(
    task: &T,
    chunks: &[T::Stage],
    pp: &dyn Communicator,
    rows: &Range<u64>,
    total: usize,
    sync: &dyn GradSync,
    own_chunks: &dyn Fn(<T::Stage as ModelStage>::Batch) -> Result<<T::Stage as ModelStage>::Batch>,
) -> Result<f64> {
    let cfg = task.cfg();
    let groups = row_groups(rows.clone(), cfg.train.row_group)?;
    let per_group = groups
        .iter()
        .map(|g| {
            task.val_batches(g.clone())?
                .into_iter()
                .map(own_chunks)
                .collect::<Result<Vec<_>>>()
        })
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
