//! The memory report: per-rank peak bytes of parameters, gradients, optimizer state and
//! activations during real training steps of a next-token model of any family
//! ([`CausalFamily`]: a GPT, a Llama, ...), under any [`ParallelLayout`] (with or without
//! sequence parallelism): data parallelism without sharding (DDP), ZeRO-1, 2, 3, tensor
//! parallelism and their compositions, each measured by the rank's own
//! [`MemoryTracker`](meshgrad_tensor::alloc::MemoryTracker), beside the figure the theory gives.
//!
//! Every rank builds its model (under `tp`, only its part: split parameters are created at their
//! local shapes), wraps it as `meshgrad train` does ([`DataParallel::for_layout`]: DDP over the
//! data-parallel group when nothing is sharded and it has several ranks, [`ShardedDataParallel`](crate::zero::ShardedDataParallel)
//! over the layout's [`ShardTopology`](crate::ShardTopology) when sharded, nothing otherwise),
//! resets its tracker's peaks (so the model every rank
//! builds before sharding is not counted) and trains a few steps (AdamW, clipping). The global
//! batch is split over the data-parallel ranks; the ranks of one tensor-parallel group read the
//! same rows, those of a context-parallel group each their chunks of them. The report gives, per
//! layout, the largest value over the ranks of:
//!
//! * the peak of each tag: `Params`, `Grads`, `OptimizerState`, `Activations`;
//! * the peak of the first three's sum at one time (*model states*, what ZeRO shards);
//! * the peak of everything the rank allocated (activations and temporaries included).
//!
//! What each tag holds: parameters (ZeRO-3: the shards plus the units gathered at the moment;
//! `tp`: the rank's parts of split parameters and whole replicated ones), gradients (those
//! autograd accumulates on the parameters, DDP's buckets, ZeRO's flat unit buffers being
//! assembled and reduced gradients), the optimizer's state (here AdamW's moments; under ZeRO, of this rank's segments
//! only) and master weights. **Activations** are every byte allocated while the forward runs
//! (the report runs the model's loss under [`MemoryTag::Activations`]): the tensors autograd saves for
//! backward, the logits and the loss, the outputs of the tensor-parallel collectives (the
//! sequence all-gathers of sequence parallelism, the all-reduces of the row-parallel layers) and
//! the forward's temporaries while they live; parameters gathered by ZeRO-3 during the forward
//! stay `Params`. Their peak is reached at the end of the forward, before backward frees the
//! graph. What else the backward allocates (activation gradients, temporaries) is untagged and
//! counted only in *all allocations*. With the in-process backend a collective's
//! result is allocated when it is waited for, so a prefetch in flight costs nothing until it is
//! used.
//!
//! The theory ([`MemoryTheory`]), from the config alone, in f32 bytes, with `T` the tp degree and
//! `S` the sharding degree (`fsdp=S`, `zero1=S`, ...):
//!
//! * *tp-local parameters* `L = split / T + replicated`, where `split` counts the parameters
//!   the family's tensor-parallel plan splits (for a GPT: the token table, the q/k/v and MLP
//!   up-projection weights and biases, both output-projection weights) and `replicated` the rest
//!   (for a GPT: the position table, the LayerNorms, the row-parallel output-projection biases);
//! * parameters `4 L`; ZeRO-3 `4 (L / S + padding) + ` the largest unit's tp-local parameters
//!   (gathered whole around its forward and backward);
//! * gradients `4 L` (one rank, ZeRO-1); DDP `8 L` (autograd's gradients and the flat bucket
//!   copies being averaged, whole at the end of the backward); ZeRO-2/3 `4 (L / S + padding) + `
//!   the largest unit's tp-local gradient (whole, before its reduce-scatter);
//! * optimizer state: two AdamW moments, `8 L`; under ZeRO `8 (L / S + padding)`;
//! * expert parallelism (`ep=E`): a rank holds `X / E` of the `X` expert parameters. Without a
//!   ZeRO stage they are whole, with their gradients (`4 X / E`, `8 X / E` when the
//!   data-parallel degree exceeds `E`: the experts' own bucket copies) and AdamW moments
//!   (`8 X / E`); the other `L - X` parameters follow the layout's wrapper, parameters
//!   `4 (L - X)` and optimizer state twice that, gradients the larger of `8 (L - X) + 4 X / E`
//!   (the dense buckets' copies, during the backward) and `4 (L - X)` plus the experts' figure
//!   (their own copies, made after the dense ones are freed). Under a ZeRO stage the dense
//!   parameters are sharded as above (the plan and its largest unit without the experts), and
//!   the rank's experts are sharded at the same stage over the `R = D / E` ranks holding the
//!   same ones (a plan of their own, one unit per block; ZeRO-1 over `R = 1`): optimizer state
//!   `8 (X / E / R + padding)`; parameters `4 X / E`, ZeRO-3 `4 (X / E / R + padding) + ` the
//!   largest expert unit (a block's held experts, gathered whole); gradients `4 X / E` (padded)
//!   under ZeRO-1, and under ZeRO-2/3 that plus their shard (the whole flats exist until the
//!   reduction after the backward, as an expert may get no tokens on a rank). The two wrappers'
//!   figures are added (an upper bound: they need not peak together). The report adds a line
//!   of expert parameters per rank;
//! * activations: no figure. Tensor parallelism splits the attention and MLP interiors by heads
//!   and features and the logits by vocabulary; the LayerNorm / dropout / residual regions
//!   (`[B, T, C]` tensors) stay whole on every rank unless sequence parallelism splits them
//!   along the sequence, dividing those regions' activations by `T` (the column-parallel layers'
//!   inputs are gathered back to the full sequence and saved for the weight gradient). Context
//!   parallelism (`cp=C`) gives each rank `1 / C` of every sequence's tokens: every per-token
//!   activation divides by `C`; ring attention adds the key and value blocks in flight (two
//!   per hop, `2 x 2 x` the rank's key/value width per local token, freed after each hop) and
//!   keeps each row's log-sum-exp (one value per head and token) for the backward. Under a ZeRO
//!   stage `S` is `dp_shard x cp` (the context-parallel ranks hold different shards).

use std::collections::HashMap;
use std::time::Duration;

use meshgrad_nn::data::{splitmix64, TokenDataset};
use meshgrad_nn::gpt::GptBatch;
use meshgrad_nn::optim::{param_groups_for_decay, AdamW, AdamWConfig};
use meshgrad_nn::tp::TpPlan;
use meshgrad_nn::{CausalFamily, ForwardCtx, ModelStage, Module, ParamBuilder, StageSpec};
use meshgrad_tensor::alloc::{with_tag, MemoryStats, MemoryTag};
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use crate::comm::{run_ranks, RankCtx, RunOptions};
use crate::layout::{ParallelLayout, ZeroStage};
use crate::pipeline::PipelineGrads;
use crate::sampler::rank_rows;
use crate::strategy::DataParallel;
use crate::tp::{context_parallel, expert_parallel, tensor_parallel};
use crate::zero::plan::{ParamSpec, ShardPlan};
use crate::zero::WrapPolicy;

/// A layout the report measures, with or without sequence parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStrategy {
    /// The parallel layout (its world size is the number of ranks).
    pub layout: ParallelLayout,
    /// Sequence parallelism (only meaningful with `tp` above 1).
    pub sequence_parallel: bool,
}

impl MemoryStrategy {
    /// A layout spec as `--layout` takes it (`dp=4`, `fsdp=2,tp=2`, ...).
    pub fn new(spec: &str, sequence_parallel: bool) -> Result<Self> {
        let layout: ParallelLayout = spec.parse()?;
        Ok(MemoryStrategy {
            layout,
            sequence_parallel,
        })
    }

    /// DDP over `world` ranks.
    pub fn ddp(world: usize) -> Result<Self> {
        Ok(MemoryStrategy {
            layout: ParallelLayout::data_parallel(world)?,
            sequence_parallel: false,
        })
    }

    /// ZeRO `stage` over `world` ranks.
    pub fn zero(stage: ZeroStage, world: usize) -> Result<Self> {
        Ok(MemoryStrategy {
            layout: ParallelLayout::sharded(stage, world)?,
            sequence_parallel: false,
        })
    }

    /// DDP, ZeRO-1, ZeRO-2 and ZeRO-3 over `world` ranks.
    pub fn data_parallel(world: usize) -> Result<Vec<Self>> {
        Ok(vec![
            MemoryStrategy::ddp(world)?,
            MemoryStrategy::zero(ZeroStage::One, world)?,
            MemoryStrategy::zero(ZeroStage::Two, world)?,
            MemoryStrategy::zero(ZeroStage::Three, world)?,
        ])
    }

    /// `tp=2`, `tp=2` with sequence parallelism, `tp=4`, `tp=4` with sequence parallelism and
    /// `fsdp=2,tp=2`.
    pub fn tensor_parallel() -> Vec<Self> {
        [
            ("tp=2", false),
            ("tp=2", true),
            ("tp=4", false),
            ("tp=4", true),
            ("fsdp=2,tp=2", false),
        ]
        .into_iter()
        .map(|(s, sp)| MemoryStrategy::new(s, sp).expect("a valid layout"))
        .collect()
    }

    /// The README's rows: [`MemoryStrategy::data_parallel`] over `world` ranks, then
    /// [`MemoryStrategy::tensor_parallel`].
    pub fn all(world: usize) -> Result<Vec<Self>> {
        let mut v = MemoryStrategy::data_parallel(world)?;
        v.extend(MemoryStrategy::tensor_parallel());
        Ok(v)
    }

    /// The layout spec, with ` +sp` for sequence parallelism.
    pub fn name(&self) -> String {
        let sp = if self.sequence_parallel { " +sp" } else { "" };
        format!("{}{sp}", self.layout)
    }

    /// What the layout is, in words: `DDP`, `ZeRO-1`, `ZeRO-3 / FSDP`, `TP`, `TP + SP`,
    /// `ZeRO-3 x TP`, ...
    pub fn kind(&self) -> String {
        let dp = match self.layout.zero() {
            // Context-parallel ranks average their gradients with the data-parallel ones.
            None if self.layout.data_parallel_degree() * self.layout.cp() > 1 => Some("DDP"),
            None => None,
            Some(ZeroStage::One) => Some("ZeRO-1"),
            Some(ZeroStage::Two) => Some("ZeRO-2"),
            Some(ZeroStage::Three) if self.layout.tp() > 1 => Some("FSDP"),
            Some(ZeroStage::Three) => Some("ZeRO-3 / FSDP"),
        };
        let tp = match (self.layout.tp() > 1, self.sequence_parallel) {
            (false, _) => None,
            (true, false) => Some("TP"),
            (true, true) => Some("TP + SP"),
        };
        let ep = self.layout.ep() > 1;
        let dp = match dp {
            Some("DDP") if self.layout.cp() > 1 => Some("DDP + CP"),
            d => d,
        };
        // Expert parallelism beside the data-parallel wrapper (DDP or a ZeRO stage).
        let dp = dp.map(|d| {
            if ep {
                format!("{d} + EP")
            } else {
                d.to_string()
            }
        });
        match (dp, tp) {
            (Some(d), Some(t)) => format!("{d} x {t}"),
            (Some(d), None) => d,
            (None, Some(t)) => t.to_string(),
            (None, None) => "one rank".to_string(),
        }
    }
}

/// What to train for the report: a model of a family whose config is `C`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryReportConfig<C> {
    /// The model (its heads, MLP width and vocabulary must split over every `tp` degree
    /// measured, and `seq_len` too with sequence parallelism).
    pub model: C,
    /// Ranks of the data-parallel rows ([`MemoryStrategy::all`]) and of the ZeRO-3 target.
    pub world: usize,
    /// Rows of the global batch (split over the data-parallel ranks of each layout).
    pub global_batch: usize,
    /// Sequence length.
    pub seq_len: usize,
    /// Training steps measured.
    pub steps: usize,
    /// Seed of the weights and the data.
    pub seed: u64,
}

/// The theory's per-rank bytes of one layout (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryTheory {
    /// Parameter bytes.
    pub params: usize,
    /// Gradient bytes.
    pub grads: usize,
    /// Optimizer-state bytes (two AdamW moments).
    pub optimizer: usize,
}

/// One layout's measurements: the largest value over the ranks of each peak, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRow {
    /// The layout.
    pub strategy: MemoryStrategy,
    /// Batch rows each rank trains on (the global batch over the data-parallel degree).
    pub rows_per_rank: usize,
    /// Peak parameter bytes.
    pub params: usize,
    /// Peak gradient bytes.
    pub grads: usize,
    /// Peak optimizer-state bytes.
    pub optimizer: usize,
    /// Peak of parameters + gradients + optimizer state held at one time.
    pub model_states: usize,
    /// Peak of the bytes allocated during the forward (see the [module docs](self)).
    pub activations: usize,
    /// Peak of all allocations (activations and temporaries included).
    pub total: usize,
    /// Expert parameters a rank holds (the largest over the ranks; every expert of the model
    /// without expert parallelism, `1 / ep` of them under `ep`).
    pub expert_params: usize,
    /// The theory's figures.
    pub theory: MemoryTheory,
}

/// The report.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReport {
    /// The model, in words (`GPT n_layer 6 n_embd 128 n_head 4 vocab 512`).
    pub model: String,
    /// Ranks of the data-parallel rows and of the ZeRO-3 target.
    pub world: usize,
    /// Rows of the global batch.
    pub global_batch: usize,
    /// Sequence length.
    pub seq_len: usize,
    /// Training steps measured.
    pub steps: usize,
    /// Parameters of the model.
    pub num_params: usize,
    /// Parameters the family's tensor-parallel plan splits over the ranks (full count).
    pub split_params: usize,
    /// Parameters every tensor-parallel rank holds whole.
    pub replicated_params: usize,
    /// Expert parameters of the model (a mixture of experts'; 0 without one).
    pub expert_params: usize,
    /// Bytes of the unsharded model states of f32 AdamW training: parameters, gradients and two
    /// moments, 16 bytes per parameter.
    pub unsharded_model_states: usize,
    /// Bytes of the largest ZeRO-3 unit's parameters on one device (gathered whole around its
    /// forward and backward).
    pub largest_unit_params: usize,
    /// Name of that unit.
    pub largest_unit: String,
    /// One row per layout measured.
    pub rows: Vec<MemoryRow>,
}

impl MemoryReport {
    /// The row of `strategy`, if measured.
    pub fn row(&self, strategy: &MemoryStrategy) -> Option<&MemoryRow> {
        self.rows.iter().find(|r| r.strategy == *strategy)
    }

    /// The ZeRO-3 target at `world` ranks: 1 / world of the unsharded model states plus the
    /// largest unit's gathered parameters and its whole gradient.
    pub fn zero3_target(&self) -> usize {
        self.unsharded_model_states / self.world + 2 * self.largest_unit_params
    }

    /// Parameter bytes each rank holds under `tp` ranks without sharding:
    /// `4 (split / tp + replicated)`.
    pub fn tp_params(&self, tp: usize) -> usize {
        4 * (self.split_params / tp + self.replicated_params)
    }

    /// The report as a Markdown table (bytes in KiB) with the theory's figures beside the
    /// measured ones and lines on the ZeRO-3 target and sequence parallelism.
    pub fn to_markdown(&self) -> String {
        let kib = |b: usize| format!("{:.1}", b as f64 / 1024.0);
        let c = self;
        let mut s = format!(
            "{} ({} parameters, f32), global batch {} x {}, AdamW, {} steps; per-rank peaks \
             (max over ranks) in KiB, measured (theory):\n\n",
            self.model, self.num_params, c.global_batch, c.seq_len, c.steps
        );
        s.push_str(
            "| layout | strategy | ranks | rows/rank | parameters | gradients | optimizer state | \
             model states (at one time) | activations | all allocations |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rows {
            s.push_str(&format!(
                "| `{}` | {} | {} | {} | {} ({}) | {} ({}) | {} ({}) | {} | {} | {} |\n",
                r.strategy.name(),
                r.strategy.kind(),
                r.strategy.layout.world_size(),
                r.rows_per_rank,
                kib(r.params),
                kib(r.theory.params),
                kib(r.grads),
                kib(r.theory.grads),
                kib(r.optimizer),
                kib(r.theory.optimizer),
                kib(r.model_states),
                kib(r.activations),
                kib(r.total)
            ));
        }
        s.push_str(&format!(
            "\nTheory: under tp=T each rank holds (split / T + replicated) parameters, split = {} \
             (what the tensor-parallel plan splits), replicated = {} (the rest): tp=2 {} KiB, tp=4 {} KiB; fsdp=S shards those tp-local parameters over S ranks \
             (plus padding) and ZeRO-3 adds the largest unit gathered whole.\n",
            self.split_params,
            self.replicated_params,
            kib(self.tp_params(2)),
            kib(self.tp_params(4)),
        ));
        s.push_str(&format!(
            "\nUnsharded model states (16 B/parameter): {} KiB; ZeRO-3 target at {} ranks = 1/{} \
             of that + the largest unit's parameters and gradient ({}, 2 x {} KiB) = {} KiB",
            kib(self.unsharded_model_states),
            c.world,
            c.world,
            self.largest_unit,
            kib(self.largest_unit_params),
            kib(self.zero3_target())
        ));
        let fsdp = MemoryStrategy::zero(ZeroStage::Three, c.world).ok();
        if let Some(r) = fsdp.and_then(|f| self.row(&f).copied()) {
            s.push_str(&format!(
                "; measured {} KiB ({:.0}% of the target).\n",
                kib(r.model_states),
                100.0 * r.model_states as f64 / self.zero3_target() as f64
            ));
        } else {
            s.push_str(".\n");
        }
        let ep_lines: Vec<String> = self
            .rows
            .iter()
            .filter(|r| r.strategy.layout.ep() > 1)
            .map(|r| {
                format!(
                    "`{}` {} of {} (1/{})",
                    r.strategy.name(),
                    r.expert_params,
                    self.expert_params,
                    r.strategy.layout.ep()
                )
            })
            .collect();
        if !ep_lines.is_empty() {
            s.push_str(&format!(
                "\nExpert parameters per rank (expert parallelism holds 1/ep of the experts on each \
                 rank; the router and the rest whole): {}.\n",
                ep_lines.join(", ")
            ));
        }
        let mut sp_lines = Vec::new();
        for r in self.rows.iter().filter(|r| r.strategy.sequence_parallel) {
            let plain = MemoryStrategy {
                sequence_parallel: false,
                ..r.strategy
            };
            if let Some(p) = self.row(&plain) {
                sp_lines.push(format!(
                    "`{}` holds {:.0}% of `{}`'s activation bytes",
                    r.strategy.name(),
                    100.0 * r.activations as f64 / p.activations.max(1) as f64,
                    plain.name()
                ));
            }
        }
        for r in self.rows.iter().filter(|r| r.strategy.layout.cp() > 1) {
            let plain = r
                .strategy
                .layout
                .with_cp(1)
                .ok()
                .map(|layout| MemoryStrategy {
                    layout,
                    ..r.strategy
                });
            if let Some((plain, p)) = plain.and_then(|l| Some((l, self.row(&l)?))) {
                sp_lines.push(format!(
                    "`{}` holds {:.0}% of `{}`'s (context parallelism: each rank's tokens are \
                     1/{} of the sequence, plus the ring's key and value blocks)",
                    r.strategy.name(),
                    100.0 * r.activations as f64 / p.activations.max(1) as f64,
                    plain.name(),
                    r.strategy.layout.cp()
                ));
            }
        }
        if !sp_lines.is_empty() {
            s.push_str(&format!(
                "\nActivations (bytes allocated during the forward, peak): sequence parallelism \
                 splits the LayerNorm / dropout / residual regions along the sequence, context \
                 parallelism the whole sequence: {}.\n",
                sp_lines.join(", ")
            ));
        }
        s
    }
}

/// A synthetic token stream for the report (no files needed).
fn dataset(vocab: usize, seed: u64) -> Result<TokenDataset> {
    let tokens: Vec<u32> = (0..20_000u64)
        .map(|i| (splitmix64(i ^ seed) % vocab as u64) as u32)
        .collect();
    TokenDataset::from_tokens("memory-report", tokens, vocab).map_err(|e| Error::msg(e.to_string()))
}

/// One rank of one layout: build, wrap, reset the peaks, train, read the tracker.
fn measure_rank<F: CausalFamily>(
    ctx: &RankCtx,
    cfg: &MemoryReportConfig<F::Config>,
    strategy: MemoryStrategy,
    data: &TokenDataset,
) -> Result<(MemoryStats, usize)> {
    let mesh = strategy.layout.mesh(ctx.comm.clone())?;
    let spec = StageSpec::full(F::n_layer(&cfg.model));
    let mut builder = ParamBuilder::new(cfg.seed);
    if let Some(ep) = mesh.ep_group() {
        builder = builder.expert_parallel(expert_parallel(ep));
    }
    if mesh.tp_degree() > 1 {
        let tp = tensor_parallel(mesh.tp_group(), strategy.sequence_parallel);
        builder = builder.tensor_parallel(tp, F::tp_plan(&cfg.model, &spec));
    }
    // Context parallelism: ring attention over the cp group, each rank its chunks of the rows.
    let mut order = None;
    if strategy.layout.cp() > 1 {
        let cp = context_parallel(mesh.cp_group());
        order = Some(cp.order());
        builder = builder.context_parallel(cp);
    }
    let local = |t: Tensor| match &order {
        Some(o) => o.local_of(&t, 1),
        None => Ok(t),
    };
    let model = F::build_stage(cfg.model, spec, builder, false)?;
    let experts = expert_numel(&model);
    let groups = param_groups_for_decay(model.named_parameters(), 0.1);
    let mut opt = AdamW::new(groups, AdamWConfig::default())?;
    let wrapper = DataParallel::for_layout(&mesh, &model, &opt)?;
    let grads = PipelineGrads::new(std::slice::from_ref(&model), mesh.pp_group())?;
    let rows = rank_rows(cfg.global_batch, mesh.batch_degree(), mesh.batch_rank())?;
    let n = (rows.end - rows.start) as usize;
    let batch = |step: usize| -> Result<(GptBatch, ForwardCtx)> {
        let b = data
            .batch(cfg.seed, step as u64, rows.clone(), cfg.seq_len)
            .map_err(|e| Error::msg(e.to_string()))?;
        Ok((
            GptBatch {
                ids: local(Tensor::from_vec(b.inputs, (n, cfg.seq_len), Device::Cpu)?)?,
                targets: local(Tensor::from_vec(b.targets, (n, cfg.seq_len), Device::Cpu)?)?,
                ignore_index: None,
            },
            ForwardCtx {
                step: step as u64,
                first_row: rows.start,
            },
        ))
    };
    let lr = 1e-3;
    ctx.tracker.reset_peak();
    for step in 0..cfg.steps {
        wrapper.zero_grad(&opt);
        let (batch, fctx) = batch(step)?;
        // Everything the forward allocates is an activation (see the module docs).
        with_tag(MemoryTag::Activations, || {
            fctx.scope(|| model.forward_stage(&batch, None))
        })?
        .backward()?;
        // The trainer's end of a step: the wrapper's norm, clipping and step.
        wrapper.finish()?;
        let norm = wrapper.grad_norm(&grads)?;
        wrapper.clip_grads_with_norm(&grads, 1.0, norm)?;
        wrapper.step(&mut opt, lr)?;
    }
    Ok((ctx.tracker.stats(), experts))
}

/// The elements of `model`'s expert parameters ([`meshgrad_nn::moe::expert_parameter_names`]).
fn expert_numel(model: &dyn Module) -> usize {
    let names = meshgrad_nn::moe::expert_parameter_names(model);
    model
        .named_parameters()
        .iter()
        .filter(|(n, _)| names.contains(n))
        .map(|(_, v)| v.tensor().elem_count())
        .sum()
}

/// The single-device model's parameters with their shapes under `tp` ranks (split parameters
/// at their local shapes), and whether each is split.
fn tp_local_shapes(
    model: &dyn Module,
    plan: &TpPlan,
    tp: usize,
) -> Result<Vec<(String, Vec<usize>, bool)>> {
    let styles: HashMap<_, _> = plan.resolve(model)?;
    Ok(model
        .named_parameters()
        .into_iter()
        .map(|(name, v)| {
            let mut shape = v.tensor().dims().to_vec();
            let split = TpPlan::split_of(&styles, &name);
            if let Some((dim, _)) = split {
                shape[dim] /= tp;
            }
            (name, shape, split.is_some())
        })
        .collect())
}

/// The ZeRO plan of the tp-local parameters over `shards` ranks (default wrap policy), without
/// those named in `ignored` (the experts under expert parallelism, which the wrapper leaves
/// alone).
fn shard_plan(
    model: &dyn Module,
    plan: &TpPlan,
    tp: usize,
    shards: usize,
    ignored: &[String],
) -> Result<ShardPlan> {
    let shapes = tp_local_shapes(model, plan, tp)?;
    let kept: Vec<bool> = shapes
        .iter()
        .map(|(n, _, _)| !ignored.contains(n))
        .collect();
    let (units, of) = WrapPolicy::Auto.assign(model)?;
    let (units, of) = crate::zero::without_ignored(units, of, &kept);
    let specs = shapes
        .into_iter()
        .zip(&kept)
        .filter_map(|(s, &k)| k.then_some(s))
        .zip(of)
        .map(|((name, shape, _), unit)| ParamSpec {
            name,
            shape,
            unit,
            group: 0,
        })
        .collect();
    ShardPlan::new(specs, units, shards)
}

/// The theory's figures for `strategy` (see the module docs).
fn theory(model: &dyn Module, plan: &TpPlan, strategy: &MemoryStrategy) -> Result<MemoryTheory> {
    let tp = strategy.layout.tp();
    let local: usize = tp_local_shapes(model, plan, tp)?
        .iter()
        .map(|(_, s, _)| s.iter().product::<usize>())
        .sum();
    let f32b = DType::F32.size_in_bytes();
    // The gradients' bucket copy exists wherever gradients are averaged: over the
    // data-parallel and the context-parallel ranks.
    let averaged = strategy.layout.data_parallel_degree() * strategy.layout.cp();
    // Under ep=E a rank holds 1/E of the experts. Without a ZeRO stage they are whole, with
    // their gradients and AdamW moments; their gradients have a bucket copy only when other
    // ranks hold the same experts (D / E above 1). Without ep the experts are parameters like
    // the others.
    let e = strategy.layout.ep();
    let names = meshgrad_nn::moe::expert_parameter_names(model);
    let apart = if e > 1 || strategy.layout.zero().is_none() {
        expert_numel(model)
    } else {
        0
    };
    let held = apart / e;
    let expert_grads = if averaged > e { 2 } else { 1 } * held;
    let dense = local - apart;
    let Some(stage) = strategy.layout.zero() else {
        let copies = if averaged > 1 { 2 } else { 1 };
        // Under ep the experts' bucket copies are made after the dense ones are freed (the
        // experts' DDP finishes after the dense one): the larger of the two moments.
        let grads = if e > 1 {
            (copies * dense + held).max(dense + expert_grads)
        } else {
            copies * local
        };
        return Ok(MemoryTheory {
            params: f32b * (dense + held),
            grads: f32b * grads,
            optimizer: 2 * f32b * (dense + held),
        });
    };
    // The context-parallel ranks hold different shards (see `LayoutMesh::shard_topology`);
    // under ep the dense parameters alone are in this plan.
    let shards = strategy.layout.dp_shard() * strategy.layout.cp();
    let ignored = if e > 1 { names.clone() } else { Vec::new() };
    let dplan = shard_plan(model, plan, tp, shards, &ignored)?;
    let shard = dplan.shard_numel();
    let largest = dplan.units.iter().map(|u| u.numel).max().unwrap_or(0);
    // Under ep with ZeRO the experts a rank holds (those of the first expert-parallel rank:
    // every rank holds as many) are sharded over the `D / E` ranks holding the same ones, at
    // the same stage (ZeRO-1 over a single one: whole): their own plan. ZeRO-1 keeps their
    // whole (padded) gradients; ZeRO-2/3 reduce them after the backward (an expert may get no
    // tokens on a rank), so the whole flats exist before the shards: both counted.
    let (e_params, e_grads, e_shard) = if e > 1 {
        let replicas = (strategy.layout.data_parallel_degree() / e).max(1);
        let estage = if replicas > 1 { stage } else { ZeroStage::One };
        let not_held: Vec<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| {
                !names.contains(n) || expert_index(n).is_some_and(|i| i >= per_rank(model, e))
            })
            .collect();
        let eplan = shard_plan(model, plan, tp, replicas, &not_held)?;
        let eshard = eplan.shard_numel();
        let padded: usize = eplan.units.iter().map(|u| u.padded(replicas)).sum();
        let eunit = eplan.units.iter().map(|u| u.numel).max().unwrap_or(0);
        match estage {
            ZeroStage::One => (held, padded, eshard),
            ZeroStage::Two => (held, padded + eshard, eshard),
            ZeroStage::Three => (eshard + eunit, padded + eshard, eshard),
        }
    } else {
        (0, 0, 0)
    };
    Ok(MemoryTheory {
        params: f32b
            * (e_params
                + match stage {
                    ZeroStage::Three => shard + largest,
                    _ => dense,
                }),
        grads: f32b
            * (e_grads
                + match stage {
                    ZeroStage::One => dense,
                    _ => shard + largest,
                }),
        optimizer: 2 * f32b * (shard + e_shard),
    })
}

/// The index of the expert an expert parameter belongs to (the path component after
/// `experts`: `layers.0.block_sparse_moe.experts.3.w1.weight` is expert 3).
fn expert_index(name: &str) -> Option<usize> {
    let mut parts = name.split('.');
    parts.find(|p| *p == "experts")?;
    parts.next()?.parse().ok()
}

/// Experts per layer on each of `ep` expert-parallel ranks (the largest expert index plus one,
/// divided by `ep`).
fn per_rank(model: &dyn Module, ep: usize) -> usize {
    let n = model
        .named_parameters()
        .iter()
        .filter_map(|(n, _)| expert_index(n))
        .max()
        .map_or(0, |i| i + 1);
    n / ep
}

/// Trains a model of family `F` under `strategies` (one after another, each on its layout's
/// number of ranks) and measures them.
///
/// ```no_run
/// use meshgrad_nn::Gpt;
/// use meshgrad_nn::GptConfig;
/// use meshgrad_parallel::memory_report::{memory_report, MemoryReportConfig, MemoryStrategy};
/// let cfg = MemoryReportConfig {
///     model: GptConfig {
///         vocab_size: 512,
///         block_size: 64,
///         n_layer: 6,
///         n_head: 4,
///         n_embd: 128,
///         dropout: 0.0,
///         bias: true,
///         layer_norm_eps: 1e-5,
///     },
///     world: 4,
///     global_batch: 8,
///     seq_len: 64,
///     steps: 3,
///     seed: 1,
/// };
/// let report = memory_report::<Gpt>(&cfg, &MemoryStrategy::all(4)?)?;
/// println!("{}", report.to_markdown());
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
pub fn memory_report<F: CausalFamily>(
    cfg: &MemoryReportConfig<F::Config>,
    strategies: &[MemoryStrategy],
) -> Result<MemoryReport> {
    F::validate(&cfg.model)?;
    if cfg.world == 0 || cfg.steps == 0 {
        meshgrad_tensor::bail!("memory report: world and steps must be at least 1");
    }
    for s in strategies {
        let tp = s.layout.tp();
        F::check_tp(&cfg.model, tp, s.sequence_parallel.then_some(cfg.seq_len))
            .map_err(|e| Error::msg(format!("memory report, {}: {e}", s.name())))?;
    }
    let spec = StageSpec::full(F::n_layer(&cfg.model));
    let plan = F::tp_plan(&cfg.model, &spec);
    let model = F::build_stage(cfg.model, spec, ParamBuilder::new(cfg.seed), false)?;
    let data = dataset(F::vocab(&cfg.model), cfg.seed)?;
    let opts = RunOptions::with_timeout(Duration::from_secs(120));
    let mut rows = Vec::new();
    for &strategy in strategies {
        let per_rank = run_ranks(strategy.layout.world_size(), &opts, |ctx| {
            measure_rank::<F>(&ctx, cfg, strategy, &data)
        })
        .map_err(|e| Error::msg(format!("memory report, {}: {e}", strategy.name())))?;
        let max = |f: &dyn Fn(&MemoryStats) -> usize| {
            per_rank.iter().map(|(s, _)| f(s)).max().unwrap_or(0)
        };
        rows.push(MemoryRow {
            strategy,
            rows_per_rank: cfg.global_batch / strategy.layout.data_parallel_degree(),
            params: max(&|s| s.peak_of(MemoryTag::Params)),
            grads: max(&|s| s.peak_of(MemoryTag::Grads)),
            optimizer: max(&|s| s.peak_of(MemoryTag::OptimizerState)),
            model_states: max(&|s| s.model_state_peak),
            activations: max(&|s| s.peak_of(MemoryTag::Activations)),
            total: max(&|s| s.peak),
            expert_params: per_rank.iter().map(|(_, e)| *e).max().unwrap_or(0),
            theory: theory(&model, &plan, &strategy)?,
        });
    }
    let num_params = F::num_parameters(&cfg.model);
    let (mut split_params, mut replicated_params) = (0, 0);
    for (_, shape, split) in tp_local_shapes(&model, &plan, 1)? {
        let n: usize = shape.iter().product();
        if split {
            split_params += n;
        } else {
            replicated_params += n;
        }
    }
    let units = shard_plan(&model, &plan, 1, cfg.world, &[])?;
    let u = units
        .units
        .iter()
        .max_by_key(|u| u.numel)
        .ok_or_else(|| Error::msg("memory report: the model has no parameters"))?;
    let shape = F::shape(&cfg.model);
    Ok(MemoryReport {
        model: format!(
            "{} n_layer {} n_embd {} n_head {} vocab {}",
            F::NAME,
            shape.n_layer,
            shape.n_embd,
            shape.n_head,
            shape.vocab_size
        ),
        world: cfg.world,
        global_batch: cfg.global_batch,
        seq_len: cfg.seq_len,
        steps: cfg.steps,
        num_params,
        split_params,
        replicated_params,
        expert_params: expert_numel(&model),
        unsharded_model_states: 16 * num_params,
        largest_unit_params: u.numel * DType::F32.size_in_bytes(),
        largest_unit: u.name.clone(),
        rows,
    })
}
