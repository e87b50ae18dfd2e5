//! The memory report: per-rank peak bytes of parameters, gradients and optimizer state during
//! real training steps of a GPT, under data parallelism without sharding (DDP) and ZeRO-1, 2, 3,
//! each measured by the rank's own [`MemoryTracker`](meshgrad_tensor::alloc::MemoryTracker).
//!
//! Every rank builds the model, wraps it, resets its tracker's peaks (so the full model every
//! rank builds before sharding is not counted) and trains a few steps (AdamW, clipping). The
//! report gives, per strategy, the largest value over the ranks of:
//!
//! * the peak of each tag: `Params`, `Grads`, `OptimizerState`;
//! * the peak of their sum at one time (*model states*, what ZeRO shards);
//! * the peak of everything the rank allocated (activations and temporaries included).
//!
//! What each tag holds: parameters (ZeRO-3: the shards plus the units gathered at the moment),
//! the gradient buffers a strategy keeps (DDP's buckets, ZeRO's flat unit buffers being
//! assembled and reduced gradients), the optimizer's state (here AdamW's moments; under ZeRO, of
//! this rank's segments only) and master weights. The per-parameter gradients the autograd
//! engine hands to the gradient-ready hooks are counted under `Other` (ZeRO copies each into its
//! unit's buffer and drops it at once). With the in-process backend a collective's result is
//! allocated when it is waited for, so a prefetch in flight costs nothing until it is used.

use std::time::Duration;

use meshgrad_nn::data::{splitmix64, TokenDataset};
use meshgrad_nn::optim::{clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer};
use meshgrad_nn::ForwardCtx;
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_tensor::alloc::{MemoryStats, MemoryTag};
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use super::config::{ShardConfig, WrapPolicy, ZeroStage};
use super::plan::{ParamSpec, ShardPlan};
use super::topology::ShardTopology;
use super::wrapper::ShardedDataParallel;
use crate::comm::{run_ranks, RankCtx, RunOptions};
use crate::ddp::{Ddp, DdpConfig};
use crate::sampler::rank_rows;

/// A strategy the report measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryStrategy {
    /// Data parallelism without sharding ([`Ddp`] and plain AdamW).
    Ddp,
    /// Sharded data parallelism.
    Zero(ZeroStage),
}

impl MemoryStrategy {
    /// DDP, ZeRO-1, ZeRO-2, ZeRO-3.
    pub const ALL: [MemoryStrategy; 4] = [
        MemoryStrategy::Ddp,
        MemoryStrategy::Zero(ZeroStage::One),
        MemoryStrategy::Zero(ZeroStage::Two),
        MemoryStrategy::Zero(ZeroStage::Three),
    ];

    /// The name in the table.
    pub fn name(&self) -> &'static str {
        match self {
            MemoryStrategy::Ddp => "DDP (no sharding)",
            MemoryStrategy::Zero(ZeroStage::One) => "ZeRO-1",
            MemoryStrategy::Zero(ZeroStage::Two) => "ZeRO-2",
            MemoryStrategy::Zero(ZeroStage::Three) => "ZeRO-3 / FSDP",
        }
    }
}

/// What to train for the report.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryReportConfig {
    /// The model.
    pub model: GptConfig,
    /// Number of ranks.
    pub world: usize,
    /// Rows of the global batch (split over the ranks).
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
    /// 1.26 M parameters), global batch 8 x 64 tokens, 3 steps, on `world` ranks.
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

/// One strategy's measurements: the largest value over the ranks of each peak, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRow {
    /// The strategy.
    pub strategy: MemoryStrategy,
    /// Peak parameter bytes.
    pub params: usize,
    /// Peak gradient bytes.
    pub grads: usize,
    /// Peak optimizer-state bytes.
    pub optimizer: usize,
    /// Peak of parameters + gradients + optimizer state held at one time.
    pub model_states: usize,
    /// Peak of all allocations (activations and temporaries included).
    pub total: usize,
}

/// The report.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReport {
    /// What was trained.
    pub config: MemoryReportConfig,
    /// Parameters of the model.
    pub num_params: usize,
    /// Bytes of the unsharded model states of f32 AdamW training: parameters, gradients and two
    /// moments, 16 bytes per parameter.
    pub unsharded_model_states: usize,
    /// Bytes of the largest ZeRO-3 unit's parameters (gathered whole around its forward and
    /// backward).
    pub largest_unit_params: usize,
    /// Name of that unit.
    pub largest_unit: String,
    /// One row per strategy measured.
    pub rows: Vec<MemoryRow>,
}

impl MemoryReport {
    /// The row of `strategy`, if measured.
    pub fn row(&self, strategy: MemoryStrategy) -> Option<&MemoryRow> {
        self.rows.iter().find(|r| r.strategy == strategy)
    }

    /// The ZeRO-3 target: a quarter (1 / world) of the unsharded model states plus the largest
    /// unit's gathered parameters.
    pub fn zero3_target(&self) -> usize {
        self.unsharded_model_states / self.config.world + self.largest_unit_params
    }

    /// The report as a Markdown table (bytes in KiB) with a line on the ZeRO-3 target.
    pub fn to_markdown(&self) -> String {
        let kib = |b: usize| format!("{:.1}", b as f64 / 1024.0);
        let c = &self.config;
        let mut s = format!(
            "GPT n_layer {} n_embd {} vocab {} ({} parameters, f32), {} ranks, global batch {} x {}, \
             AdamW; per-rank peaks (max over ranks) in KiB:\n\n",
            c.model.n_layer,
            c.model.n_embd,
            c.model.vocab_size,
            self.num_params,
            c.world,
            c.global_batch,
            c.seq_len
        );
        s.push_str(
            "| strategy | parameters | gradients | optimizer state | model states (at one time) | all allocations |\n\
             |---|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rows {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                r.strategy.name(),
                kib(r.params),
                kib(r.grads),
                kib(r.optimizer),
                kib(r.model_states),
                kib(r.total)
            ));
        }
        s.push_str(&format!(
            "\nUnsharded model states (16 B/parameter): {} KiB; ZeRO-3 target = 1/{} of that + the \
             largest unit's parameters ({}, {} KiB) = {} KiB",
            kib(self.unsharded_model_states),
            c.world,
            self.largest_unit,
            kib(self.largest_unit_params),
            kib(self.zero3_target())
        ));
        if let Some(r) = self.row(MemoryStrategy::Zero(ZeroStage::Three)) {
            s.push_str(&format!(
                "; measured {} KiB ({:.0}% of the target).\n",
                kib(r.model_states),
                100.0 * r.model_states as f64 / self.zero3_target() as f64
            ));
        } else {
            s.push_str(".\n");
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

/// One rank of one strategy: wrap, reset the peaks, train, read the tracker.
fn measure_rank(
    ctx: &RankCtx,
    cfg: &MemoryReportConfig,
    strategy: MemoryStrategy,
    data: &TokenDataset,
) -> Result<MemoryStats> {
    let model = Gpt::new(cfg.model, cfg.seed, DType::F32, Device::Cpu)?;
    let groups = param_groups_for_decay(model.named_parameters(), 0.1);
    let rows = rank_rows(cfg.global_batch, cfg.world, ctx.rank)?;
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
    match strategy {
        MemoryStrategy::Ddp => {
            let ddp = Ddp::new(
                model.named_parameters(),
                ctx.comm.clone(),
                DdpConfig::default(),
            )?;
            let mut opt = AdamW::new(groups, AdamWConfig::default())?;
            ctx.tracker.reset_peak();
            for step in 0..cfg.steps {
                opt.zero_grad();
                let (ids, targets, fctx) = batch(step)?;
                fctx.scope(|| model.loss(&ids, &targets, None))?
                    .backward()?;
                ddp.finish()?;
                clip_grad_norm(&model.parameters(), 1.0)?;
                opt.step(lr)?;
            }
            Ok(ctx.tracker.stats())
        }
        MemoryStrategy::Zero(stage) => {
            let sdp = ShardedDataParallel::new(
                &model,
                groups,
                AdamWConfig::default(),
                ShardTopology::flat(ctx.comm.clone()),
                ShardConfig::new(stage),
            )?;
            ctx.tracker.reset_peak();
            for step in 0..cfg.steps {
                sdp.zero_grad();
                let (ids, targets, fctx) = batch(step)?;
                fctx.scope(|| model.loss(&ids, &targets, None))?
                    .backward()?;
                sdp.finish()?;
                sdp.clip_grad_norm(1.0)?;
                sdp.step(lr)?;
            }
            Ok(ctx.tracker.stats())
        }
    }
}

/// The largest unit of the default wrap policy and its parameter bytes (f32).
fn largest_unit(cfg: &MemoryReportConfig) -> Result<(String, usize)> {
    let model = Gpt::new(cfg.model, cfg.seed, DType::F32, Device::Cpu)?;
    let named = model.named_parameters();
    let (units, of) = WrapPolicy::Auto.assign(&model)?;
    let specs = named
        .iter()
        .zip(of)
        .map(|((n, v), unit)| ParamSpec {
            name: n.clone(),
            shape: v.tensor().dims().to_vec(),
            unit,
            group: 0,
        })
        .collect();
    let plan = ShardPlan::new(specs, units, cfg.world)?;
    let u = plan
        .units
        .iter()
        .max_by_key(|u| u.numel)
        .ok_or_else(|| Error::msg("memory report: the model has no parameters"))?;
    Ok((u.name.clone(), u.numel * DType::F32.size_in_bytes()))
}

/// Trains `strategies` on `cfg.world` ranks (one after another) and measures them.
pub fn memory_report(
    cfg: &MemoryReportConfig,
    strategies: &[MemoryStrategy],
) -> Result<MemoryReport> {
    cfg.model.validate()?;
    if cfg.world == 0 || cfg.steps == 0 {
        meshgrad_tensor::bail!("memory report: world and steps must be at least 1");
    }
    let data = dataset(cfg.model.vocab_size, cfg.seed)?;
    let opts = RunOptions::with_timeout(Duration::from_secs(120));
    let mut rows = Vec::new();
    for &strategy in strategies {
        let per_rank = run_ranks(cfg.world, &opts, |ctx| {
            measure_rank(&ctx, cfg, strategy, &data)
        })
        .map_err(|e| Error::msg(format!("memory report, {}: {e}", strategy.name())))?;
        let max = |f: &dyn Fn(&MemoryStats) -> usize| per_rank.iter().map(f).max().unwrap_or(0);
        rows.push(MemoryRow {
            strategy,
            params: max(&|s| s.peak_of(MemoryTag::Params)),
            grads: max(&|s| s.peak_of(MemoryTag::Grads)),
            optimizer: max(&|s| s.peak_of(MemoryTag::OptimizerState)),
            model_states: max(&|s| s.model_state_peak),
            total: max(&|s| s.peak),
        });
    }
    let num_params = cfg.model.num_parameters();
    let (largest_unit, largest_unit_params) = largest_unit(cfg)?;
    Ok(MemoryReport {
        config: *cfg,
        num_params,
        unsharded_model_states: 16 * num_params,
        largest_unit_params,
        largest_unit,
        rows,
    })
}
