//! The memory report: per-rank peak bytes of parameters, gradients, optimizer state and
//! activations during real training steps of a GPT, under any [`ParallelLayout`] (with or
//! without sequence parallelism): data parallelism without sharding (DDP), ZeRO-1, 2, 3, tensor
//! parallelism and their compositions, each measured by the rank's own
//! [`MemoryTracker`](meshgrad_tensor::alloc::MemoryTracker), beside the figure the theory gives.
//!
//! Every rank builds its model (under `tp`, only its part: split parameters are created at their
//! local shapes), wraps it as `meshgrad train` does (DDP over the data-parallel group when
//! nothing is sharded, even a group of one rank; else [`ShardedDataParallel`] over the layout's
//! [`ShardTopology`](crate::ShardTopology)), resets its tracker's peaks (so the model every rank
//! builds before sharding is not counted) and trains a few steps (AdamW, clipping). The global
//! batch is split over the data-parallel ranks; the ranks of one tensor-parallel group read the
//! same rows. The report gives, per layout, the largest value over the ranks of:
//!
//! * the peak of each tag: `Params`, `Grads`, `OptimizerState`, `Activations`;
//! * the peak of the first three's sum at one time (*model states*, what ZeRO shards);
//! * the peak of everything the rank allocated (activations and temporaries included).
//!
//! What each tag holds: parameters (ZeRO-3: the shards plus the units gathered at the moment;
//! `tp`: the rank's parts of split parameters and whole replicated ones), the gradient buffers a
//! strategy keeps (DDP's buckets, ZeRO's flat unit buffers being assembled and reduced
//! gradients), the optimizer's state (here AdamW's moments; under ZeRO, of this rank's segments
//! only) and master weights. **Activations** are every byte allocated while the forward runs
//! (the report runs `Gpt::loss` under [`MemoryTag::Activations`]): the tensors autograd saves for
//! backward, the logits and the loss, the outputs of the tensor-parallel collectives (the
//! sequence all-gathers of sequence parallelism, the all-reduces of the row-parallel layers) and
//! the forward's temporaries while they live; parameters gathered by ZeRO-3 during the forward
//! stay `Params`. Their peak is reached at the end of the forward, before backward frees the
//! graph. What the backward allocates (activation gradients, and the per-parameter gradients
//! autograd hands to the gradient-ready hooks before DDP or ZeRO copy them into their buffers) is
//! untagged and counted only in *all allocations*. With the in-process backend a collective's
//! result is allocated when it is waited for, so a prefetch in flight costs nothing until it is
//! used.
//!
//! The theory ([`MemoryTheory`]), from the config alone, in f32 bytes, with `T` the tp degree and
//! `S` the sharding degree (`fsdp=S`, `zero1=S`, ...):
//!
//! * *tp-local parameters* `L = split / T + replicated`, where `split` counts the parameters
//!   [`Gpt::tp_plan`] splits (the token table, the q/k/v and MLP up-projection weights and biases,
//!   both output-projection weights) and `replicated` the rest (the position table, the
//!   LayerNorms, the row-parallel output-projection biases);
//! * parameters `4 L`; ZeRO-3 `4 (L / S + padding) + ` the largest unit's tp-local parameters
//!   (gathered whole around its forward and backward);
//! * gradients `4 L` (DDP's buckets, ZeRO-1); ZeRO-2/3 `4 (L / S + padding)`;
//! * optimizer state: two AdamW moments, `8 L`; under ZeRO `8 (L / S + padding)`;
//! * activations: no figure. Tensor parallelism splits the attention and MLP interiors by heads
//!   and features and the logits by vocabulary; the LayerNorm / dropout / residual regions
//!   (`[B, T, C]` tensors) stay whole on every rank unless sequence parallelism splits them
//!   along the sequence, dividing those regions' activations by `T` (the column-parallel layers'
//!   inputs are gathered back to the full sequence and saved for the weight gradient).

use std::collections::HashMap;
use std::time::Duration;

use meshgrad_nn::data::{splitmix64, TokenDataset};
use meshgrad_nn::optim::{clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer};
use meshgrad_nn::tp::TpPlan;
use meshgrad_nn::ForwardCtx;
use meshgrad_nn::{Gpt, GptConfig, Module, ParamBuilder};
use meshgrad_tensor::alloc::{with_tag, MemoryStats, MemoryTag};
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use crate::comm::{run_ranks, RankCtx, RunOptions};
use crate::ddp::{Ddp, DdpConfig};
use crate::layout::{ParallelLayout, ZeroStage};
use crate::sampler::rank_rows;
use crate::tp::tensor_parallel;
use crate::zero::plan::{ParamSpec, ShardPlan};
use crate::zero::{ShardConfig, ShardedDataParallel, WrapPolicy};

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
        Ok(MemoryStrategy {
            layout: spec.parse()?,
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
            None if self.layout.data_parallel_degree() > 1 => Some("DDP"),
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
        match (dp, tp) {
            (Some(d), Some(t)) => format!("{d} x {t}"),
            (Some(d), None) => d.to_string(),
            (None, Some(t)) => t.to_string(),
            (None, None) => "one rank".to_string(),
        }
    }
}

/// What to train for the report.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryReportConfig {
    /// The model (`n_head`, `4 n_embd` and `vocab_size` must split over every `tp` degree
    /// measured, and `seq_len` too with sequence parallelism).
    pub model: GptConfig,
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

impl MemoryReportConfig {
    /// The README's configuration: a 6-layer GPT (n_embd 128, 4 heads, vocab 512, context 64,
    /// 1.26 M parameters), global batch 8 x 64 tokens, 3 steps; data-parallel rows on `world`
    /// ranks.
    pub fn small_gpt(world: usize) -> Self {
        MemoryReportConfig {
            model: GptConfig {
                vocab_size: 512,
                block_size: 64,
                n_layer: 6,
                n_head: 4,
                n_embd: 128,
                dropout: 0.0,
                bias: true,
                layer_norm_eps: 1e-5,
            },
            world,
            global_batch: 8,
            seq_len: 64,
            steps: 3,
            seed: 1,
        }
    }
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
    /// The theory's figures.
    pub theory: MemoryTheory,
}

/// The report.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReport {
    /// What was trained.
    pub config: MemoryReportConfig,
    /// Parameters of the model.
    pub num_params: usize,
    /// Parameters [`Gpt::tp_plan`] splits over the tensor-parallel ranks (full count).
    pub split_params: usize,
    /// Parameters every tensor-parallel rank holds whole.
    pub replicated_params: usize,
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

    /// The ZeRO-3 target at `config.world` ranks: 1 / world of the unsharded model states plus
    /// the largest unit's gathered parameters.
    pub fn zero3_target(&self) -> usize {
        self.unsharded_model_states / self.config.world + self.largest_unit_params
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
        let c = &self.config;
        let mut s = format!(
            "GPT n_layer {} n_embd {} n_head {} vocab {} ({} parameters, f32), global batch {} x \
             {}, AdamW, {} steps; per-rank peaks (max over ranks) in KiB, measured (theory):\n\n",
            c.model.n_layer,
            c.model.n_embd,
            c.model.n_head,
            c.model.vocab_size,
            self.num_params,
            c.global_batch,
            c.seq_len,
            c.steps
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
             (token table, q/k/v and MLP up-projection weights and biases, output-projection \
             weights), replicated = {} (position table, LayerNorms, output-projection biases): \
             tp=2 {} KiB, tp=4 {} KiB; fsdp=S shards those tp-local parameters over S ranks \
             (plus padding) and ZeRO-3 adds the largest unit gathered whole.\n",
            self.split_params,
            self.replicated_params,
            kib(self.tp_params(2)),
            kib(self.tp_params(4)),
        ));
        s.push_str(&format!(
            "\nUnsharded model states (16 B/parameter): {} KiB; ZeRO-3 target at {} ranks = 1/{} \
             of that + the largest unit's parameters ({}, {} KiB) = {} KiB",
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
        if !sp_lines.is_empty() {
            s.push_str(&format!(
                "\nActivations (bytes allocated during the forward, peak): sequence parallelism \
                 splits the LayerNorm / dropout / residual regions along the sequence: {}.\n",
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

/// How a rank's model is wrapped (as `meshgrad train` does).
enum Wrapper {
    Ddp(Ddp, AdamW),
    Sharded(ShardedDataParallel),
}

/// One rank of one layout: build, wrap, reset the peaks, train, read the tracker.
fn measure_rank(
    ctx: &RankCtx,
    cfg: &MemoryReportConfig,
    strategy: MemoryStrategy,
    data: &TokenDataset,
) -> Result<MemoryStats> {
    let mesh = strategy.layout.mesh(ctx.comm.clone())?;
    let model = if mesh.tp_degree() > 1 {
        let tp = tensor_parallel(mesh.tp_group(), strategy.sequence_parallel);
        Gpt::build(
            cfg.model,
            ParamBuilder::new(cfg.seed).tensor_parallel(tp, Gpt::tp_plan()),
        )?
    } else {
        Gpt::new(cfg.model, cfg.seed, DType::F32, Device::Cpu)?
    };
    let groups = param_groups_for_decay(model.named_parameters(), 0.1);
    let rows = rank_rows(cfg.global_batch, mesh.dp_degree(), mesh.dp_rank())?;
    let n = (rows.end - rows.start) as usize;
    let batch = |step: usize| -> Result<(Tensor, Tensor, ForwardCtx)> {
        let b = data
            .batch(cfg.seed, step as u64, rows.clone(), cfg.seq_len)
            .map_err(|e| Error::msg(e.to_string()))?;
        Ok((
            Tensor::from_vec(b.inputs, (n, cfg.seq_len), Device::Cpu)?,
            Tensor::from_vec(b.targets, (n, cfg.seq_len), Device::Cpu)?,
            ForwardCtx {
                step: step as u64,
                first_row: rows.start,
            },
        ))
    };
    let lr = 1e-3;
    let mut wrapper = match strategy.layout.zero() {
        None => Wrapper::Ddp(
            Ddp::new(
                model.named_parameters(),
                mesh.dp_group(),
                DdpConfig::default(),
            )?,
            AdamW::new(groups, AdamWConfig::default())?,
        ),
        Some(stage) => Wrapper::Sharded(ShardedDataParallel::new(
            &model,
            groups,
            AdamWConfig::default(),
            mesh.shard_topology()?,
            ShardConfig::new(stage),
        )?),
    };
    ctx.tracker.reset_peak();
    for step in 0..cfg.steps {
        match &mut wrapper {
            Wrapper::Ddp(_, opt) => opt.zero_grad(),
            Wrapper::Sharded(sdp) => sdp.zero_grad(),
        }
        let (ids, targets, fctx) = batch(step)?;
        // Everything the forward allocates is an activation (see the module docs).
        with_tag(MemoryTag::Activations, || {
            fctx.scope(|| model.loss(&ids, &targets, None))
        })?
        .backward()?;
        match &mut wrapper {
            Wrapper::Ddp(ddp, opt) => {
                ddp.finish()?;
                clip_grad_norm(&model.parameters(), 1.0)?;
                opt.step(lr)?;
            }
            Wrapper::Sharded(sdp) => {
                sdp.finish()?;
                sdp.clip_grad_norm(1.0)?;
                sdp.step(lr)?;
            }
        }
    }
    Ok(ctx.tracker.stats())
}

/// The single-device model's parameters with their shapes under `tp` ranks (split parameters
/// at their local shapes), and whether each is split.
fn tp_local_shapes(model: &Gpt, tp: usize) -> Result<Vec<(String, Vec<usize>, bool)>> {
    let styles: HashMap<_, _> = Gpt::tp_plan().resolve(model)?;
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

/// The ZeRO plan of the tp-local parameters over `shards` ranks (default wrap policy).
fn shard_plan(model: &Gpt, tp: usize, shards: usize) -> Result<ShardPlan> {
    let (units, of) = WrapPolicy::Auto.assign(model)?;
    let specs = tp_local_shapes(model, tp)?
        .into_iter()
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
fn theory(model: &Gpt, strategy: &MemoryStrategy) -> Result<MemoryTheory> {
    let tp = strategy.layout.tp();
    let local: usize = tp_local_shapes(model, tp)?
        .iter()
        .map(|(_, s, _)| s.iter().product::<usize>())
        .sum();
    let f32b = DType::F32.size_in_bytes();
    let Some(stage) = strategy.layout.zero() else {
        return Ok(MemoryTheory {
            params: f32b * local,
            grads: f32b * local,
            optimizer: 2 * f32b * local,
        });
    };
    let plan = shard_plan(model, tp, strategy.layout.dp_shard())?;
    let shard = plan.shard_numel();
    let largest = plan.units.iter().map(|u| u.numel).max().unwrap_or(0);
    Ok(MemoryTheory {
        params: f32b
            * match stage {
                ZeroStage::Three => shard + largest,
                _ => local,
            },
        grads: f32b
            * match stage {
                ZeroStage::One => local,
                _ => shard,
            },
        optimizer: 2 * f32b * shard,
    })
}

/// Trains `strategies` (one after another, each on its layout's number of ranks) and measures
/// them.
pub fn memory_report(
    cfg: &MemoryReportConfig,
    strategies: &[MemoryStrategy],
) -> Result<MemoryReport> {
    cfg.model.validate()?;
    if cfg.world == 0 || cfg.steps == 0 {
        meshgrad_tensor::bail!("memory report: world and steps must be at least 1");
    }
    for s in strategies {
        let tp = s.layout.tp();
        meshgrad_nn::gpt::check_tp_sizes(
            &cfg.model,
            tp,
            s.sequence_parallel.then_some(cfg.seq_len),
        )
        .map_err(|e| Error::msg(format!("memory report, {}: {e}", s.name())))?;
    }
    let model = Gpt::new(cfg.model, cfg.seed, DType::F32, Device::Cpu)?;
    let data = dataset(cfg.model.vocab_size, cfg.seed)?;
    let opts = RunOptions::with_timeout(Duration::from_secs(120));
    let mut rows = Vec::new();
    for &strategy in strategies {
        let per_rank = run_ranks(strategy.layout.world_size(), &opts, |ctx| {
            measure_rank(&ctx, cfg, strategy, &data)
        })
        .map_err(|e| Error::msg(format!("memory report, {}: {e}", strategy.name())))?;
        let max = |f: &dyn Fn(&MemoryStats) -> usize| per_rank.iter().map(f).max().unwrap_or(0);
        rows.push(MemoryRow {
            strategy,
            rows_per_rank: cfg.global_batch / strategy.layout.data_parallel_degree(),
            params: max(&|s| s.peak_of(MemoryTag::Params)),
            grads: max(&|s| s.peak_of(MemoryTag::Grads)),
            optimizer: max(&|s| s.peak_of(MemoryTag::OptimizerState)),
            model_states: max(&|s| s.model_state_peak),
            activations: max(&|s| s.peak_of(MemoryTag::Activations)),
            total: max(&|s| s.peak),
            theory: theory(&model, &strategy)?,
        });
    }
    let num_params = cfg.model.num_parameters();
    let (mut split_params, mut replicated_params) = (0, 0);
    for (_, shape, split) in tp_local_shapes(&model, 1)? {
        let n: usize = shape.iter().product();
        if split {
            split_params += n;
        } else {
            replicated_params += n;
        }
    }
    let plan = shard_plan(&model, 1, cfg.world)?;
    let u = plan
        .units
        .iter()
        .max_by_key(|u| u.numel)
        .ok_or_else(|| Error::msg("memory report: the model has no parameters"))?;
    Ok(MemoryReport {
        config: *cfg,
        num_params,
        split_params,
        replicated_params,
        unsharded_model_states: 16 * num_params,
        largest_unit_params: u.numel * DType::F32.size_in_bytes(),
        largest_unit: u.name.clone(),
        rows,
    })
}
