//! The leader's end of every training run, whatever the model: the reporter closed, the run's
//! config (`meshgrad.toml`) and tokenizer written, the model saved by its recipe (last: its
//! `config.json` marks a complete folder), a sample from a next-token model, and the summary
//! line.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::CausalLm;

use crate::config::TrainConfig;
use crate::run_setup::{TrainSummary, Verbosity, TOKENIZER_FILE};
use crate::step_loop::{LoopResult, Reporter};

/// What a recipe hands to [`finish_run`].
pub(crate) struct Finish<'a> {
    /// The run's resolved config.
    pub(crate) cfg: &'a TrainConfig,
    /// The run's tokenizer, written beside the model (a stale one is removed without it).
    pub(crate) tokenizer: Option<&'a Tokenizer>,
    /// The leader's reporter, closed first.
    pub(crate) rep: Reporter,
    /// What the step loop measured.
    pub(crate) result: LoopResult,
    /// Whether to print the summary.
    pub(crate) verbosity: Verbosity,
    /// A next-token model to sample `train.sample_tokens` tokens from (`None`: no sample).
    pub(crate) sampler: Option<&'a dyn CausalLm>,
    /// Appended to the summary line after the validation losses (BERT: `ln vocab`).
    pub(crate) note: String,
}

/// Writes the run's folder (`cfg.out`): config, tokenizer, then the model through `save`;
/// samples (among the run's `model.vocab_size` ids: never a padded one) and prints the summary.
/// The summary's peak memory is left at 0 for the trainer to fill in.
pub(crate) fn finish_run(
    f: Finish<'_>,
    save: impl FnOnce(&Path) -> Result<()>,
) -> Result<TrainSummary> {
    let Finish {
        cfg,
        tokenizer,
        rep,
        result: r,
        verbosity,
        sampler,
        note,
    } = f;
    rep.finish()?;
    let out = PathBuf::from(&cfg.out);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
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
    save(&out).with_context(|| format!("saving checkpoint to {}", out.display()))?;
    let sample = match sampler {
        Some(model) if cfg.train.sample_tokens > 0 => sample(cfg, model, tokenizer)?,
        _ => String::new(),
    };
    let summary = TrainSummary {
        initial_val_loss: r.initial_val_loss,
        final_val_loss: r.final_val_loss,
        final_train_loss: r.final_train_loss,
        steps: cfg.train.steps,
        tokens_per_s: r.tokens_per_s,
        checkpoint: out,
        sample,
        peak_memory_per_rank: 0,
    };
    if verbosity != Verbosity::Quiet {
        println!(
            "done: {} steps in {:.1}s ({:.0} tok/s); val_loss {:.4} -> {:.4}{note}; checkpoint in {}",
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

/// `train.sample_tokens` tokens from `model` (temperature 0.8, top 40, the run's seed) after a
/// newline: decoded by the tokenizer, or as bytes for a byte-level vocabulary; nothing for
/// another vocabulary without a tokenizer.
fn sample(
    cfg: &TrainConfig,
    model: &dyn CausalLm,
    tokenizer: Option<&Tokenizer>,
) -> Result<String> {
    let prompt = match tokenizer {
        Some(tok) => sample_prompt(tok)?,
        None if cfg.model.vocab_size >= 256 => vec![u32::from(b'\n')],
        None => return Ok(String::new()),
    };
    let toks = model.generate(
        &prompt,
        cfg.train.sample_tokens,
        0.8,
        Some(40),
        cfg.train.seed,
        &mut |_| Ok(()),
    )?;
    Ok(match tokenizer {
        Some(tok) => tok.decode(&toks, true)?,
        None => crate::generate::detokenize(&toks),
    })
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
