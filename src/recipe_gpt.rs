//! The GPT family's [`Recipe`]: a GPT-2-style decoder trained on next-token prediction (its
//! stages, microbatches, validation, profile and checkpoint in Hugging Face GPT-2 format, with
//! the run's tokenizer and a sample).

use std::ops::Range;
use std::path::PathBuf;

use anyhow::{Context, Result};
use meshgrad_nn::data::TokenSource;
use meshgrad_nn::gpt::{GptBatch, GptStage};
use meshgrad_nn::state::{hf_gpt2, load_state_dict};
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{Gpt, GptConfig, ParamBuilder, StageSpec};
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{micro_rows, Communicator, ParallelLayout, ReduceOp};
use meshgrad_tensor::Tensor;

use crate::config::TrainConfig;
use crate::recipe::Recipe;
use crate::step_loop::{LoopResult, Reporter};
use crate::train::{
    batch_tensors, precision_dtype, train_device, RunData, TrainOptions, TrainSummary, Verbosity,
    TOKENIZER_FILE, VAL_STREAM,
};

/// The model config a training config describes.
pub fn gpt_config(cfg: &TrainConfig) -> GptConfig {
    let m = &cfg.model;
    GptConfig {
        vocab_size: m.padded_vocab(m.vocab_size),
        block_size: m.block_size,
        n_layer: m.n_layer,
        n_head: m.n_head,
        n_embd: m.n_embd,
        dropout: m.dropout,
        bias: m.bias,
        layer_norm_eps: 1e-5,
    }
}

/// The first log line of a run.
fn header(cfg: &TrainConfig, model: &GptConfig, data: &RunData, layout: &str) -> String {
    let tokens = match &data.tokenizer {
        Some(t) => format!("tokenizer {} (vocab {})", t.name(), t.vocab_size()),
        None => "byte-level text".to_string(),
    };
    format!(
        "meshgrad train: {} parameters, {} train / {} val tokens from {} (validation: {}; {tokens}), \
         {} steps of {} x {} tokens{layout}",
        model.num_parameters(),
        data.train.len(),
        data.val.len(),
        data.source,
        data.validation,
        cfg.train.steps,
        cfg.train.batch_size,
        cfg.model.block_size
    )
}

/// The prompt of the sample at the end of a run with a tokenizer: a newline, or the first special
/// token the tokenizer adds (`[CLS]`) when a newline encodes to nothing, or id 0.
fn sample_prompt(tok: &Tokenizer) -> Result<Vec<u32>> {
    let newline = tok.encode("\n", false)?;
    if !newline.is_empty() {
        return Ok(newline);
    }
    Ok(vec![tok.encode("", true)?.first().copied().unwrap_or(0)])
}

/// The leader's end of a run: closes the reporter, writes the checkpoint, the resolved config
/// and the tokenizer (`tokenizer.json`, when the run has one; a stale one is removed otherwise),
/// samples (among the run's `model.vocab_size` ids: never a padded one) and prints the summary.
fn finish_run(
    cfg: &TrainConfig,
    model: &mut Gpt,
    tokenizer: Option<&Tokenizer>,
    rep: Reporter,
    r: LoopResult,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    rep.finish()?;
    model.vocab_in_use = Some(cfg.model.vocab_size);
    let model = &*model;
    let out = PathBuf::from(&cfg.out);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // The run's config and tokenizer first, the model last: its config.json, written last,
    // marks a complete folder.
    let cfg_text = cfg.to_toml_string()?;
    meshgrad_nn::state::write_bytes_atomic(out.join("meshgrad.toml"), cfg_text.as_bytes())
        .with_context(|| format!("writing {}/meshgrad.toml", out.display()))?;
    let tok_path = out.join(TOKENIZER_FILE);
    match tokenizer {
        Some(tok) => tok.save(&tok_path)?,
        None if tok_path.exists() => std::fs::remove_file(&tok_path)
            .with_context(|| format!("removing the stale {}", tok_path.display()))?,
        None => {}
    }
    hf_gpt2::save_gpt2(model, &out)
        .with_context(|| format!("saving checkpoint to {}", out.display()))?;

    let sample = match tokenizer {
        _ if cfg.train.sample_tokens == 0 => String::new(),
        Some(tok) => {
            let toks = model.generate(
                &sample_prompt(tok)?,
                cfg.train.sample_tokens,
                0.8,
                Some(40),
                cfg.train.seed,
                |_| Ok(()),
            )?;
            tok.decode(&toks, true)?
        }
        None if cfg.model.vocab_size >= 256 => {
            let prompt = b"\n".iter().map(|&c| c as u32).collect::<Vec<_>>();
            let toks = model.generate(
                &prompt,
                cfg.train.sample_tokens,
                0.8,
                Some(40),
                cfg.train.seed,
                |_| Ok(()),
            )?;
            crate::generate::detokenize(&toks)
        }
        None => String::new(),
    };
    let summary = TrainSummary {
        initial_val_loss: r.initial_val_loss,
        final_val_loss: r.final_val_loss,
        final_train_loss: r.final_train_loss,
        steps: cfg.train.steps,
        tokens_per_s: r.tokens_per_s,
        checkpoint: out,
        sample,
        peak_memory_per_rank: meshgrad_tensor::alloc::memory_stats(train_device(cfg)?).peak,
    };
    if verbosity != Verbosity::Quiet {
        println!(
            "done: {} steps in {:.1}s ({:.0} tok/s); val_loss {:.4} -> {:.4}; checkpoint in {}",
            summary.steps,
            r.elapsed_s,
            summary.tokens_per_s,
            summary.initial_val_loss,
            summary.final_val_loss,
            summary.checkpoint.display()
        );
        if !summary.sample.is_empty() {
            println!("sample:\n{}", summary.sample);
        }
    }
    Ok(summary)
}

/// A GPT run's recipe.
pub(crate) struct GptRecipe {
    cfg: TrainConfig,
    data: RunData,
    config: GptConfig,
}

impl GptRecipe {
    /// Parameters from the run seed, in the run's precision, on its device.
    fn builder(&self) -> Result<ParamBuilder> {
        Ok(ParamBuilder::new(self.cfg.train.seed)
            .dtype(precision_dtype(&self.cfg)?)
            .device(train_device(&self.cfg)?))
    }

    fn batch(&self, seed: u64, step: u64, rows: Range<u64>, val: bool) -> Result<GptBatch> {
        let ds = if val {
            &self.data.val
        } else {
            &self.data.train
        };
        let (ids, targets) = batch_tensors(ds, seed, step, rows, self.cfg.model.block_size)?;
        let device = train_device(&self.cfg)?;
        Ok(GptBatch {
            ids: ids.to_device(device)?,
            targets: targets.to_device(device)?,
            ignore_index: None,
        })
    }
}

impl Recipe for GptRecipe {
    type Stage = GptStage;
    const NAME: &'static str = "GPT";

    fn check(
        cfg: &TrainConfig,
        layout: Option<&ParallelLayout>,
        opts: &TrainOptions,
    ) -> Result<()> {
        let Some(layout) = layout else {
            return Ok(());
        };
        // The other sizes first; then the vocabulary, whose error names the key that pads it.
        let mut sizes = gpt_config(cfg);
        sizes.vocab_size = sizes.vocab_size.next_multiple_of(layout.tp());
        meshgrad_nn::gpt::check_tp_sizes(
            &sizes,
            layout.tp(),
            opts.sequence_parallel.then_some(cfg.model.block_size),
        )?;
        crate::ranks::check_vocab_splits(cfg, gpt_config(cfg).vocab_size, layout)
    }

    fn new(cfg: TrainConfig, data: RunData) -> Result<Self> {
        let config = gpt_config(&cfg);
        Ok(GptRecipe { cfg, data, config })
    }

    fn cfg(&self) -> &TrainConfig {
        &self.cfg
    }

    fn n_blocks(&self) -> usize {
        self.config.n_layer
    }

    fn build_stage(
        &self,
        spec: StageSpec,
        tp: Option<TensorParallel>,
        delayed: bool,
        checkpointing: bool,
    ) -> Result<GptStage> {
        let mut builder = self.builder()?;
        if delayed {
            builder = builder.delayed_init();
        }
        // Reference mode: the sums tensor parallelism splits are trees over the model's chunk
        // count on every stage, as in the single-device reference run (see `run_model`).
        let plan = GptStage::tp_plan(&spec);
        let mut stage = crate::reference_tp::build_with_plan(&self.cfg, builder, tp, plan, |b| {
            GptStage::build(self.config, spec, b)
        })?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
    }

    fn train_microbatches(
        &self,
        step: u64,
        rows: Range<u64>,
        microbatches: usize,
        _dp: usize,
    ) -> Result<Vec<Microbatch<GptBatch>>> {
        micro_rows(rows, microbatches)?
            .into_iter()
            .map(|r| {
                Ok(Microbatch {
                    first_row: r.start,
                    batch: self.batch(self.cfg.train.seed, step, r, false)?,
                })
            })
            .collect()
    }

    fn val_batches(&self, rows: Range<u64>) -> Result<Vec<GptBatch>> {
        (0..self.cfg.train.eval_batches.max(1) as u64)
            .map(|i| self.batch(self.cfg.train.seed ^ VAL_STREAM, i, rows.clone(), true))
            .collect()
    }

    fn val_loss(&self, local_sum: f64, n_batches: usize, dp: &dyn Communicator) -> Result<f64> {
        let mean = local_sum / n_batches.max(1) as f64;
        Ok(all_reduce_scalar(dp, mean, ReduceOp::Avg)?)
    }

    fn header(&self, layout: &str) -> String {
        header(&self.cfg, &self.config, &self.data, layout)
    }

    fn profile_batch(&self, rows: usize) -> Result<GptBatch> {
        self.batch(self.cfg.train.seed, 0, 0..rows as u64, false)
    }

    fn finish(
        &self,
        tensors: &[(String, Tensor)],
        rep: Reporter,
        result: LoopResult,
        verbosity: Verbosity,
    ) -> Result<TrainSummary> {
        let mut model = Gpt::build(self.config, self.builder()?)?;
        load_state_dict(&model, tensors, true)?;
        finish_run(
            &self.cfg,
            &mut model,
            self.data.tokenizer.as_ref(),
            rep,
            result,
            verbosity,
        )
    }
}
