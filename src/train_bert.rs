//! `meshgrad train --model bert` (config `model.kind = "bert"`): a [`BertForMaskedLM`] trained by
//! masked language modelling, on one device or on the ranks of a parallel layout.
//!
//! **Tokenizer.** Token ids are those of the data (bytes 0..=255 for text, the file's ids for a
//! `.bin`), below `model.vocab_size`, and the five special tokens `[PAD] [UNK] [CLS] [SEP]
//! [MASK]` are appended after them: for text with the default `vocab_size = 256` they are ids
//! 256..=260 and the model's vocabulary is 261 (see [`meshgrad_nn::mlm::byte_level`]).
//!
//! **Batches.** Row `b` of step `s` is `[CLS]`, the `block_size - 2` tokens of the data window
//! the GPT sampler draws for `(seed, s, b)`, and `[SEP]`; no padding. [`mlm_mask`](meshgrad_nn::mlm::mlm_mask) then selects
//! 15% of the non-special tokens (80% become `[MASK]`, 10% a random byte, 10% stay) by draws
//! keyed by `(seed, s)` and the token's global row and column, so every layout sees the same
//! batch.
//!
//! **Loss.** The step's loss is Hugging Face's: the mean cross-entropy over the labelled tokens
//! of the whole global batch. Micro-batches and ranks do not hold equal numbers of labelled
//! tokens, so each computes its summed cross-entropy divided by the global count (every rank
//! counts the labels of all rows: masking is a pure function of the global position), scaled
//! by the number of ranks because gradient synchronisation averages. The result equals the
//! single-device step to rounding under any layout. Validation is the mean over all labelled
//! tokens of `eval_batches` fixed batches of the validation split.

use std::ops::Range;
use std::path::PathBuf;

use anyhow::{Context, Result};
use meshgrad_autograd::no_grad;
use meshgrad_nn::bert::{BertConfig, BertForMaskedLM, IGNORE_INDEX};
use meshgrad_nn::data::{Dataset, TokenSource};
use meshgrad_nn::mlm::{mlm_mask_rows, MlmConfig, SpecialTokens};
use meshgrad_nn::optim::{AdamW, CosineSchedule};
use meshgrad_nn::state::hf_bert;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{ForwardCtx, Module, ParamBuilder};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_parallel::{micro_rows, rank_rows, ParallelLayout, ZeroStage};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::train::{
    check_microbatches, check_sequence_parallel, drive_loop, optimizer_and_schedule, run_data,
    GradSync, LoopResult, Reporter, RunControl, RunData, SingleDevice, TrainOptions, TrainSummary,
    Verbosity,
};
use crate::train_parallel::{
    check_layout, gather_tensor_parallel, layout_desc, on_ranks, RankWrapper,
};

/// Mixed into the run seed for the masking draws.
const MLM_STREAM: u64 = 0x6d6c_6d5f_6d61_736b;
/// Mixed into the run seed for validation batches (windows and masks).
pub(crate) const VAL_STREAM: u64 = 0x5eed_0f7a_1d00_0002;

/// The special tokens of a run: appended after `model.vocab_size` ordinary ids.
pub fn special_tokens(cfg: &TrainConfig) -> SpecialTokens {
    SpecialTokens::after(cfg.model.vocab_size as u32)
}

/// The BERT a training config describes: `n_embd` wide, `n_layer` layers of `n_head` heads, a
/// 4x feed-forward, `block_size` positions, two token types, `model.dropout` on the hidden states
/// and the attention probabilities, the vocabulary of [`special_tokens`] (padded to a multiple of
/// `model.vocab_multiple`).
pub fn bert_config(cfg: &TrainConfig) -> BertConfig {
    let m = &cfg.model;
    let sp = special_tokens(cfg);
    BertConfig {
        vocab_size: m.padded_vocab(sp.mask as usize + 1),
        hidden_size: m.n_embd,
        num_hidden_layers: m.n_layer,
        num_attention_heads: m.n_head,
        intermediate_size: 4 * m.n_embd,
        max_position_embeddings: m.block_size,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: m.dropout,
        attention_probs_dropout_prob: m.dropout,
        pad_token_id: sp.pad as usize,
        initializer_range: 0.02,
    }
}

/// The masking of a run: BERT's proportions, random replacements among the ordinary ids.
pub fn mlm_config(cfg: &TrainConfig) -> MlmConfig {
    MlmConfig::bert(cfg.model.vocab_size as u32, special_tokens(cfg))
}

/// One part of a masked batch.
pub(crate) struct MlmBatch {
    pub(crate) ids: Tensor,
    pub(crate) labels: Tensor,
    /// Labelled tokens.
    pub(crate) count: usize,
}

/// What a run needs to draw batches.
pub(crate) struct Sampler<'a> {
    pub(crate) cfg: &'a TrainConfig,
    pub(crate) sp: SpecialTokens,
    pub(crate) mlm: MlmConfig,
}

impl Sampler<'_> {
    /// Global rows `rows` of batch `step` of `ds` (streams `seed`): `[CLS] window [SEP]`, masked.
    pub(crate) fn batch(
        &self,
        ds: &Dataset,
        seed: u64,
        step: u64,
        rows: Range<u64>,
    ) -> Result<MlmBatch> {
        let t = self.cfg.model.block_size;
        let n = (rows.end - rows.start) as usize;
        let b = ds.batch(seed, step, rows.clone(), t - 2)?;
        let mut ids = Vec::with_capacity(n * t);
        for r in 0..n {
            ids.push(self.sp.cls);
            ids.extend_from_slice(&b.inputs[r * (t - 2)..(r + 1) * (t - 2)]);
            ids.push(self.sp.sep);
        }
        let (masked, labels) =
            mlm_mask_rows(&ids, t, rows.start, step, seed ^ MLM_STREAM, &self.mlm)?;
        let count = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
        Ok(MlmBatch {
            ids: Tensor::from_vec(masked, (n, t), Device::Cpu)?,
            labels: Tensor::from_vec(labels, (n, t), Device::Cpu)?,
            count,
        })
    }

    /// Labelled tokens of the whole global batch `step` (the same on every rank).
    pub(crate) fn global_count(&self, ds: &Dataset, seed: u64, step: u64) -> Result<usize> {
        let rows = 0..self.cfg.train.batch_size as u64;
        Ok(self.batch(ds, seed, step, rows)?.count)
    }
}

impl MlmBatch {
    /// The ids and labels on `device` (the run's: batches are drawn on the host).
    pub(crate) fn on_device(self, device: Device) -> Result<MlmBatch> {
        Ok(MlmBatch {
            ids: self.ids.to_device(device)?,
            labels: self.labels.to_device(device)?,
            count: self.count,
        })
    }
}

/// The model, optimizer and schedule of a run.
struct BertRun {
    model: BertForMaskedLM,
    opt: AdamW,
    schedule: CosineSchedule,
}

/// The run's model (this rank's part under tensor parallelism; with `delayed_init`, allocated on
/// first use), its optimizer and schedule.
fn bert_run(
    cfg: &TrainConfig,
    tp: Option<TensorParallel>,
    delayed_init: bool,
    checkpointing: bool,
) -> Result<BertRun> {
    let mut builder = ParamBuilder::new(cfg.train.seed)
        .dtype(crate::train::precision_dtype(cfg)?)
        .device(crate::train::train_device(cfg)?);
    if delayed_init {
        builder = builder.delayed_init();
    }
    // Reference mode: chunked sums on one device as on tp ranks (see `crate::reference_tp`).
    let plan = BertForMaskedLM::tp_plan();
    let mut model = crate::reference_tp::build_with_plan(cfg, builder, tp, plan, |b| {
        BertForMaskedLM::build(bert_config(cfg), b)
    })?;
    model.activation_checkpointing = checkpointing;
    let (opt, schedule) = optimizer_and_schedule(cfg, &model)?;
    Ok(BertRun {
        model,
        opt,
        schedule,
    })
}

/// Mean MLM loss over all labelled tokens of `eval_batches` fixed validation batches (the same
/// batches at every evaluation). Each rank computes its `rows`; the sums are combined.
fn val_loss(
    model: &BertForMaskedLM,
    s: &Sampler<'_>,
    val: &Dataset,
    rows: &Range<u64>,
    world: usize,
    sync: &dyn GradSync,
) -> Result<f64> {
    let seed = s.cfg.train.seed ^ VAL_STREAM;
    let device = crate::train::train_device(s.cfg)?;
    model.set_training(false);
    let r = no_grad(|| -> Result<(f64, usize)> {
        let (mut sum, mut count) = (0.0, 0);
        for i in 0..s.cfg.train.eval_batches.max(1) as u64 {
            let b = s.batch(val, seed, i, rows.clone())?.on_device(device)?;
            let part = model.loss_over(&b.ids, None, None, &b.labels, 1.0)?;
            sum += part.tensor().item()?;
            count += s.global_count(val, seed, i)?;
        }
        Ok((sum, count))
    });
    model.set_training(true);
    let (sum, count) = r?;
    Ok(sync.mean(sum)? * world as f64 / count.max(1) as f64)
}

/// [`val_loss`] in reference mode: per validation batch, the row groups' summed token losses
/// added over their tree, summed over the data-parallel ranks in the same tree and divided by
/// the batch's global count of predicted tokens; then the batches' losses averaged in order.
fn val_loss_reference(
    model: &BertForMaskedLM,
    s: &Sampler<'_>,
    val: &Dataset,
    groups: &[Range<u64>],
    sync: &dyn GradSync,
) -> Result<f64> {
    let seed = s.cfg.train.seed ^ VAL_STREAM;
    let n = s.cfg.train.eval_batches.max(1) as u64;
    model.set_training(false);
    let r = (|| -> Result<f64> {
        let mut sum = 0.0;
        for i in 0..n {
            let local = crate::reference::group_loss_sum(groups, |rows| {
                let b = s.batch(val, seed, i, rows.clone())?;
                let part = no_grad(|| model.loss_over(&b.ids, None, None, &b.labels, 1.0))?;
                Ok(part.tensor().item()?)
            })?;
            let count = s.global_count(val, seed, i)?.max(1) as f64;
            sum += sync.mean(local)? / count;
        }
        Ok(sum / n as f64)
    })();
    model.set_training(true);
    r
}

/// The training loop for one device or one rank of `world`: this rank's `rows` of each global
/// batch in `microbatches` parts (see the module docs for the loss scaling), clipping, the
/// optimizer step, periodic validation and reporting.
#[allow(clippy::too_many_arguments)]
fn run_loop(
    s: &Sampler<'_>,
    data: &RunData,
    run: &mut BertRun,
    rows: Range<u64>,
    world: usize,
    microbatches: usize,
    sync: &dyn GradSync,
    rep: &mut Reporter,
    ctl: &RunControl<'_>,
) -> Result<LoopResult> {
    let cfg = s.cfg;
    let seed = cfg.train.seed;
    let device = crate::train::train_device(cfg)?;
    let micro = micro_rows(rows.clone(), microbatches)?;
    let params = run.model.parameters();
    let BertRun {
        model,
        opt,
        schedule,
    } = run;
    let model = &*model;
    // f16: the dynamic loss scale (continued from a resumed checkpoint's).
    let scaler = crate::train::run_loss_scaler(cfg, ctl.loss_scaler.as_ref())?;
    // Reference mode: this rank's row groups, each its own pass, added over their tree.
    let reference = cfg.train.reference;
    let groups = if reference {
        crate::reference::row_groups(rows.clone(), cfg.train.row_group)?
    } else {
        Vec::new()
    };
    let micro_step = |step: usize| -> Result<f64> {
        let step64 = step as u64;
        let total = s.global_count(&data.train, seed, step64)?.max(1) as f64;
        if reference {
            // Each row group's loss is its masked tokens' sum over the global count: the
            // row groups' losses add up to the global mean on every layout.
            return crate::reference::reference_step(&params, &groups, 1.0, sync, |r| {
                let mb = s.batch(&data.train, seed, step64, r.clone())?;
                let ctx = ForwardCtx::new(step64, r.start);
                Ok(ctx.scope(|| model.loss_over(&mb.ids, None, None, &mb.labels, total))?)
            });
        }
        let mut local = 0.0;
        for (m, r) in micro.iter().enumerate() {
            let mb = s
                .batch(&data.train, seed, step64, r.clone())?
                .on_device(device)?;
            let ctx = ForwardCtx::new(step64, r.start);
            let part = ctx.scope(|| model.loss_over(&mb.ids, None, None, &mb.labels, total))?;
            local += part.tensor().item()?;
            // The data-parallel average divides by `world`; f16 multiplies by the loss scale.
            let factor = world as f64 * scaler.as_ref().map_or(1.0, |s| s.borrow().scale());
            let part = if factor != 1.0 {
                part.mul_scalar(factor)?
            } else {
                part
            };
            sync.set_sync(m + 1 == microbatches);
            part.backward()?;
        }
        Ok(local)
    };
    let val = || {
        if reference {
            val_loss_reference(model, s, &data.val, &groups, sync)
        } else {
            val_loss(model, s, &data.val, &rows, world, sync)
        }
    };
    // Reference mode's data-parallel "mean" is the tree sum of the ranks' shares.
    let scale = if reference { 1.0 } else { world as f64 };
    drive_loop(
        cfg,
        model,
        opt,
        schedule,
        &params,
        sync,
        rep,
        scale,
        scaler.as_ref(),
        micro_step,
        val,
        ctl,
    )
}

pub(crate) fn header(
    cfg: &TrainConfig,
    model: &BertConfig,
    data: &RunData,
    layout: &str,
) -> String {
    format!(
        "meshgrad train: BERT (masked LM, vocabulary {}), {} parameters, {} train / {} val tokens from {}, {} steps of {} x {} tokens{layout}",
        model.vocab_size,
        model.num_parameters(),
        data.train.len(),
        data.val.len(),
        data.source,
        cfg.train.steps,
        cfg.train.batch_size,
        cfg.model.block_size
    )
}

/// The leader's end of a run: the checkpoint (Hugging Face BERT format), the resolved config
/// and the summary line.
pub(crate) fn finish(
    cfg: &TrainConfig,
    model: &BertForMaskedLM,
    rep: Reporter,
    r: LoopResult,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    rep.finish()?;
    let out = PathBuf::from(&cfg.out);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // The run's config first, the model last (its config.json marks a complete folder).
    meshgrad_nn::state::write_bytes_atomic(
        out.join("meshgrad.toml"),
        cfg.to_toml_string()?.as_bytes(),
    )
    .with_context(|| format!("writing {}/meshgrad.toml", out.display()))?;
    hf_bert::save_bert(model, &out)
        .with_context(|| format!("saving checkpoint to {}", out.display()))?;
    let summary = TrainSummary {
        initial_val_loss: r.initial_val_loss,
        final_val_loss: r.final_val_loss,
        final_train_loss: r.final_train_loss,
        steps: cfg.train.steps,
        tokens_per_s: r.tokens_per_s,
        checkpoint: out,
        sample: String::new(),
        peak_memory_per_rank: meshgrad_tensor::alloc::memory_stats(crate::train::train_device(
            cfg,
        )?)
        .peak,
    };
    if verbosity != Verbosity::Quiet {
        println!(
            "done: {} steps in {:.1}s ({:.0} tok/s); val_loss {:.4} -> {:.4} (ln vocab = {:.4}); checkpoint in {}",
            summary.steps,
            r.elapsed_s,
            summary.tokens_per_s,
            summary.initial_val_loss,
            summary.final_val_loss,
            (model.config.vocab_size as f64).ln(),
            summary.checkpoint.display()
        );
    }
    Ok(summary)
}

/// Trains a BERT by masked language modelling as `cfg` describes (with `model.kind = "bert"`),
/// on one device or, with `layout`, on its ranks (threads of this process), and writes the
/// checkpoint (Hugging Face BERT format) to `cfg.out`.
pub fn train_bert(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    cfg.validate()?;
    crate::train::check_device_and_precision(cfg, layout)?;
    // The number of data-parallel ranks (those reading different rows).
    let world = match layout {
        None => {
            check_sequence_parallel(opts, 1)?;
            crate::train_pipeline::check_pipeline_flags(opts, 1)?;
            opts.activation_checkpointing.check(1)?;
            crate::train::check_run_options(cfg, opts)?;
            check_microbatches(cfg, 1, opts.microbatches)?;
            1
        }
        Some(l) => {
            check_layout(cfg, l, opts)?;
            // The other sizes first; then the vocabulary, whose error names the key that pads it.
            let mut sizes = bert_config(cfg);
            sizes.vocab_size = sizes.vocab_size.next_multiple_of(l.tp());
            meshgrad_nn::bert::check_tp_sizes(
                &sizes,
                l.tp(),
                opts.sequence_parallel.then_some(cfg.model.block_size),
            )?;
            crate::train_parallel::check_vocab_splits(cfg, bert_config(cfg).vocab_size, l)?;
            l.data_parallel_degree()
        }
    };
    if let Some(t) = &cfg.data.tokenizer {
        anyhow::bail!(
            "train --model bert uses the byte-level vocabulary with [PAD] [UNK] [CLS] [SEP] [MASK] \
             appended; a tokenizer ({}) is not supported for BERT yet",
            t
        );
    }
    crate::preflight::check_train(cfg, layout, opts)?;
    let data = run_data(cfg, None)?;
    let s = Sampler {
        cfg,
        sp: special_tokens(cfg),
        mlm: mlm_config(cfg),
    };
    if let Some(l) = layout.filter(|l| l.pp() > 1) {
        let task = crate::pipeline_bert::BertPipeline::new(s, &data);
        let opts = &crate::train_pipeline::reference_pipeline_options(cfg, l, opts)?;
        return crate::train_pipeline::train_pipeline(&task, l, opts, verbosity);
    }
    match layout {
        None => {
            let mut run = bert_run(cfg, None, false, opts.activation_checkpointing.on_stage(0))?;
            let (start, saver) = crate::run_checkpoint::begin_rank(
                cfg,
                opts,
                "single",
                None,
                &run.model,
                &mut run.opt,
                None,
                false,
            )?;
            let start_step = start.step;
            let hook = saver.hook(None);
            let mut rep = Reporter::leader(cfg, verbosity, start_step)?;
            let desc = if opts.microbatches > 1 {
                format!(", {} micro-batches", opts.microbatches)
            } else {
                String::new()
            };
            rep.say(header(cfg, &run.model.config, &data, &desc));
            let rows = 0..cfg.train.batch_size as u64;
            let r = run_loop(
                &s,
                &data,
                &mut run,
                rows,
                1,
                opts.microbatches,
                &SingleDevice,
                &mut rep,
                &RunControl {
                    start_step,
                    loss_scaler: start.loss_scaler.clone(),
                    world: None,
                    save_every: opts.save_every,
                    save: Some(&*hook),
                },
            )?;
            finish(cfg, &run.model, rep, r, verbosity)
        }
        Some(layout) => on_ranks(
            layout,
            opts.collective_timeout,
            cfg.train.reference,
            |ctx, mesh| {
                let tp = (mesh.tp_degree() > 1)
                    .then(|| tensor_parallel(mesh.tp_group(), opts.sequence_parallel));
                let fsdp = layout.zero() == Some(ZeroStage::Three);
                let mut run = bert_run(cfg, tp, fsdp, opts.activation_checkpointing.on_stage(0))?;
                let wrapper = RankWrapper::new(mesh, &run.model, &run.opt)?;
                let (start, saver) = crate::run_checkpoint::begin_rank(
                    cfg,
                    opts,
                    &layout.to_string(),
                    Some(ctx.comm.as_ref()),
                    &run.model,
                    &mut run.opt,
                    wrapper.sharded(),
                    false,
                )?;
                let start_step = start.step;
                let hook = saver.hook(wrapper.sharded());
                let rows = rank_rows(cfg.train.batch_size, mesh.dp_degree(), mesh.dp_rank())?;
                let leader = ctx.rank == 0;
                let mut rep = if leader {
                    Reporter::leader(cfg, verbosity, start_step)?
                } else {
                    Reporter::silent()
                };
                let desc = layout_desc(layout, (rows.end - rows.start) as usize, opts.microbatches);
                rep.say(header(cfg, &run.model.config, &data, &desc));
                let dp_group = mesh.dp_group();
                let sync = wrapper.sync(dp_group.as_ref());
                let r = run_loop(
                    &s,
                    &data,
                    &mut run,
                    rows,
                    world,
                    opts.microbatches,
                    sync.as_ref(),
                    &mut rep,
                    &RunControl {
                        start_step,
                        loss_scaler: start.loss_scaler.clone(),
                        world: Some(ctx.comm.as_ref()),
                        save_every: opts.save_every,
                        save: Some(&*hook),
                    },
                )?;
                wrapper.summon_full_params()?;
                // tp: the leader assembles the single-device model from every rank's parts.
                let gathered = gather_tensor_parallel(&run.model, mesh, leader, || {
                    Ok(BertForMaskedLM::new(
                        bert_config(cfg),
                        cfg.train.seed,
                        crate::train::precision_dtype(cfg)?,
                        Device::Cpu,
                    )?)
                })?;
                if leader {
                    let model = gathered.as_ref().unwrap_or(&run.model);
                    Ok(Some(finish(cfg, model, rep, r, verbosity)?))
                } else {
                    Ok(None)
                }
            },
        )
        .map(|(mut summary, peak)| {
            summary.peak_memory_per_rank = peak;
            summary
        }),
    }
}
