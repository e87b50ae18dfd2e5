//! `meshgrad train`: the single-device training loop (data, model, AdamW with warmup + cosine,
//! clipping, periodic validation, metrics, checkpoint, sample).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use meshgrad_autograd::no_grad;
use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::layers::ForwardCtx;
use meshgrad_nn::optim::{
    clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, CosineSchedule, Optimizer,
};
use meshgrad_nn::state::hf_gpt2;
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_tensor::{DType, Device, Tensor};

use crate::config::TrainConfig;

/// What a training run reports at the end.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    /// Validation loss before the first step.
    pub initial_val_loss: f64,
    /// Validation loss after the last step.
    pub final_val_loss: f64,
    /// Training loss of the last step.
    pub final_train_loss: f64,
    /// Steps run.
    pub steps: usize,
    /// Mean training throughput, tokens per second.
    pub tokens_per_s: f64,
    /// Where the checkpoint was written.
    pub checkpoint: PathBuf,
    /// The generated sample (empty when `sample_tokens == 0`).
    pub sample: String,
}

/// How the run reports progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verbosity {
    /// Progress bar (on a terminal) and log lines.
    Normal,
    /// Nothing on stdout (tests).
    Quiet,
}

/// The model config a training config describes.
pub fn gpt_config(cfg: &TrainConfig) -> GptConfig {
    let m = &cfg.model;
    GptConfig {
        vocab_size: m.vocab_size,
        block_size: m.block_size,
        n_layer: m.n_layer,
        n_head: m.n_head,
        n_embd: m.n_embd,
        dropout: m.dropout,
        bias: m.bias,
        layer_norm_eps: 1e-5,
    }
}

/// Loads the training data the config names (the built-in corpus when no path is given).
pub fn load_data(cfg: &TrainConfig) -> Result<TokenDataset> {
    let ds = match &cfg.data.path {
        None => crate::corpus::builtin_dataset(),
        Some(p) => {
            TokenDataset::from_path(p).with_context(|| format!("reading training data {p}"))?
        }
    };
    if ds.vocab_size > cfg.model.vocab_size {
        anyhow::bail!(
            "{}: token ids need a vocabulary of {} but model.vocab_size is {}",
            ds.source,
            ds.vocab_size,
            cfg.model.vocab_size
        );
    }
    Ok(ds)
}

/// Loads a checkpoint directory written by `meshgrad train` (Hugging Face GPT-2 format).
pub fn load_checkpoint(dir: &Path) -> Result<Gpt> {
    hf_gpt2::load_gpt2(dir, DType::F32, Device::Cpu)
        .with_context(|| format!("loading checkpoint {}", dir.display()))
}

/// Mixed into the seed for validation draws, so they never coincide with training draws.
const VAL_STREAM: u64 = 0x5eed_0f7a_1d00_0001;

/// Mean loss over `batches` fixed validation batches (the same batches at every evaluation).
fn val_loss(model: &Gpt, val: &TokenDataset, cfg: &TrainConfig) -> Result<f64> {
    let (b, t) = (cfg.train.batch_size, cfg.model.block_size);
    model.set_training(false);
    let r = no_grad(|| -> Result<f64> {
        let mut total = 0.0;
        let n = cfg.train.eval_batches.max(1);
        for i in 0..n {
            // Validation draws use their own stream of "steps", far from the training ones.
            let batch = val.batch(cfg.train.seed ^ VAL_STREAM, i as u64, 0..b as u64, t)?;
            let ids = Tensor::from_vec(batch.inputs, (b, t), Device::Cpu)?;
            let targets = Tensor::from_vec(batch.targets, (b, t), Device::Cpu)?;
            total += model
                .loss(&ids, &targets, &ForwardCtx::default(), None)?
                .tensor()
                .item()?;
        }
        Ok(total / n as f64)
    });
    model.set_training(true);
    r
}

/// One JSON line of metrics.
fn metrics_line(
    step: usize,
    loss: f64,
    lr: f64,
    tokens_per_s: f64,
    grad_norm: f64,
    val: Option<f64>,
) -> String {
    let mut m = serde_json::json!({
        "step": step,
        "loss": loss,
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        "grad_norm": grad_norm,
    });
    if let Some(v) = val {
        m["val_loss"] = serde_json::json!(v);
    }
    m.to_string()
}

/// Trains a GPT as `cfg` describes and writes the checkpoint to `cfg.out`.
pub fn train(cfg: &TrainConfig, verbosity: Verbosity) -> Result<TrainSummary> {
    cfg.validate()?;
    let data = load_data(cfg)?;
    let (t, b) = (cfg.model.block_size, cfg.train.batch_size);
    let (train_ds, val_ds) = data.split(cfg.data.val_fraction, t + 1)?;
    let model = Gpt::new(gpt_config(cfg), cfg.train.seed, DType::F32, Device::Cpu)?;
    let params = model.parameters();
    let mut opt = AdamW::new(
        param_groups_for_decay(model.named_parameters(), cfg.train.weight_decay),
        AdamWConfig {
            beta1: cfg.train.beta1,
            beta2: cfg.train.beta2,
            ..Default::default()
        },
    )?;
    let schedule = CosineSchedule::new(
        cfg.train.lr,
        cfg.train.min_lr,
        cfg.train.warmup_steps,
        cfg.train.steps,
    )?;

    let out = PathBuf::from(&cfg.out);
    let mut metrics = match &cfg.metrics {
        None => None,
        Some(p) => {
            if let Some(dir) = Path::new(p).parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            Some(std::io::BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("creating metrics file {p}"))?,
            ))
        }
    };

    let quiet = verbosity == Verbosity::Quiet;
    let say = |pb: &ProgressBar, s: String| {
        if quiet {
        } else if pb.is_hidden() {
            println!("{s}");
        } else {
            pb.println(s);
        }
    };
    let pb = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(cfg.train.steps as u64), ProgressDrawTarget::stderr())
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    say(
        &pb,
        format!(
            "meshgrad train: {} parameters, {} train / {} val tokens from {}, {} steps of {} x {} tokens",
            model.num_parameters(),
            train_ds.len(),
            val_ds.len(),
            data.source,
            cfg.train.steps,
            b,
            t
        ),
    );
    let initial_val = val_loss(&model, &val_ds, cfg)?;
    say(&pb, format!("step 0: val_loss={initial_val:.4}"));

    let started = Instant::now();
    let mut last_loss = f64::NAN;
    let mut last_val = initial_val;
    let mut tokens_done = 0usize;
    for step in 0..cfg.train.steps {
        let t0 = Instant::now();
        let batch = train_ds.batch(cfg.train.seed, step as u64, 0..b as u64, t)?;
        let ids = Tensor::from_vec(batch.inputs, (b, t), Device::Cpu)?;
        let targets = Tensor::from_vec(batch.targets, (b, t), Device::Cpu)?;
        let ctx = ForwardCtx {
            step: step as u64,
            first_row: 0,
        };
        let loss = model.loss(&ids, &targets, &ctx, None)?;
        opt.zero_grad();
        loss.backward()?;
        let grad_norm = if cfg.train.grad_clip > 0.0 {
            clip_grad_norm(&params, cfg.train.grad_clip)?
        } else {
            f64::NAN
        };
        let lr = schedule.lr_at(step);
        opt.step(lr)?;
        last_loss = loss.tensor().item()?;
        if !last_loss.is_finite() {
            anyhow::bail!(
                "training diverged: loss is {last_loss} at step {}",
                step + 1
            );
        }
        let dt = t0.elapsed().as_secs_f64();
        tokens_done += b * t;
        let tps = (b * t) as f64 / dt;
        let is_last = step + 1 == cfg.train.steps;
        let eval_now =
            is_last || (cfg.train.eval_interval > 0 && (step + 1) % cfg.train.eval_interval == 0);
        let val = if eval_now {
            Some(val_loss(&model, &val_ds, cfg)?)
        } else {
            None
        };
        if let Some(v) = val {
            last_val = v;
            say(&pb, format!("step {}: val_loss={v:.4}", step + 1));
        }
        if let Some(w) = metrics.as_mut() {
            writeln!(
                w,
                "{}",
                metrics_line(step + 1, last_loss, lr, tps, grad_norm, val)
            )
            .context("writing metrics")?;
        }
        if cfg.train.log_interval > 0
            && (step + 1) % cfg.train.log_interval == 0
            && pb.is_hidden()
            && !quiet
        {
            println!(
                "step {:>5}/{} | loss {last_loss:.4} | lr {lr:.2e} | {tps:.0} tok/s",
                step + 1,
                cfg.train.steps
            );
        }
        pb.set_message(format!("loss {last_loss:.4} | {tps:.0} tok/s"));
        pb.inc(1);
    }
    pb.finish_and_clear();
    if let Some(mut w) = metrics {
        w.flush().context("writing metrics")?;
    }
    let elapsed = started.elapsed().as_secs_f64();

    hf_gpt2::save_gpt2(&model, &out)
        .with_context(|| format!("saving checkpoint to {}", out.display()))?;
    let cfg_text = cfg.to_toml_string()?;
    std::fs::write(out.join("meshgrad.toml"), cfg_text)
        .with_context(|| format!("writing {}/meshgrad.toml", out.display()))?;

    let sample = if cfg.train.sample_tokens > 0 && cfg.model.vocab_size >= 256 {
        let prompt = b"\n".iter().map(|&c| c as u32).collect::<Vec<_>>();
        let toks = model.generate(
            &prompt,
            cfg.train.sample_tokens,
            0.8,
            Some(40),
            cfg.train.seed,
        )?;
        crate::generate::detokenize(&toks)
    } else {
        String::new()
    };
    let summary = TrainSummary {
        initial_val_loss: initial_val,
        final_val_loss: last_val,
        final_train_loss: last_loss,
        steps: cfg.train.steps,
        tokens_per_s: tokens_done as f64 / elapsed,
        checkpoint: out,
        sample,
    };
    if !quiet {
        println!(
            "done: {} steps in {elapsed:.1}s ({:.0} tok/s); val_loss {:.4} -> {:.4}; checkpoint in {}",
            summary.steps,
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
