//! `meshgrad train`: the training loop (data, model, AdamW with warmup + cosine, gradient
//! accumulation, clipping, periodic validation, metrics, checkpoint, sample). The loop is written
//! once for one device and for a data-parallel rank (`GradSync` is the difference); the
//! parallel launcher is in [`crate::train_parallel`].

use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use meshgrad_autograd::{no_grad, Var};
use meshgrad_nn::data::{load_split, split_dataset, Dataset, LoadOptions, TokenSource};
use meshgrad_nn::optim::{
    clip_grad_norm, grad_sq_sum, AdamW, CosineSchedule, LossScaler, Optimizer,
};
use meshgrad_nn::state::{hf_gpt2, hf_llama};
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::ForwardCtx;
use meshgrad_nn::{CausalLm, Gpt, GptConfig, Module, ParamBuilder};
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::{micro_rows, Communicator, ReduceOp};
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
    /// The largest rank's peak of tracked bytes on the device it computes on (one device: the
    /// run's peak): parameters, gradients, optimizer state, activations and temporaries, as
    /// the allocator accounting (`meshgrad_tensor::alloc`) counts them. `meshgrad train`
    /// prints it last, as `peak_memory_per_rank_mib=`.
    pub peak_memory_per_rank: usize,
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

/// The config a run trains with, and its tokenizer: with `data.tokenizer` set, the tokenizer is
/// loaded and `model.vocab_size` becomes its vocabulary size. The result is validated.
pub fn resolve_tokenizer(cfg: &TrainConfig) -> Result<(TrainConfig, Option<Tokenizer>)> {
    let mut cfg = cfg.clone();
    let tokenizer = match &cfg.data.tokenizer {
        None => None,
        Some(p) => {
            let tok = Tokenizer::from_file(p)?;
            cfg.model.vocab_size = tok.vocab_size();
            Some(tok)
        }
    };
    cfg.validate()?;
    Ok((cfg, tokenizer))
}

/// The name of the tokenizer file in a checkpoint directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The tokenizer stored in a checkpoint directory (`tokenizer.json`), if there is one.
pub fn load_checkpoint_tokenizer(dir: &Path) -> Result<Option<Tokenizer>> {
    if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(dir)? {
        return crate::run_checkpoint::load_training_tokenizer(&ck);
    }
    let path = dir.join(TOKENIZER_FILE);
    if !path.exists() {
        return Ok(None);
    }
    Ok(Some(Tokenizer::from_file(&path)?))
}

/// Loads a GPT written by `meshgrad train`: its final model (`--out`, Hugging Face GPT-2
/// format), or a training checkpoint (`OUT/checkpoints/step-N`, a folder of them, or `OUT`
/// when it holds checkpoints but no final model). The sizes its config describes are checked
/// against the machine's memory before the model is built
/// ([`crate::preflight::check_checkpoint`], [`crate::preflight::check_model_memory`]).
pub fn load_checkpoint(dir: &Path) -> Result<Gpt> {
    if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(dir)? {
        return match crate::run_checkpoint::load_training_model(&ck)? {
            crate::run_checkpoint::CheckpointModel::Gpt(m) => Ok(*m),
            crate::run_checkpoint::CheckpointModel::Bert(_) => anyhow::bail!(
                "{} is a BERT checkpoint; this command takes a GPT",
                ck.path().display()
            ),
        };
    }
    crate::preflight::check_checkpoint(dir)?;
    let mut model = hf_gpt2::load_gpt2(dir, DType::F32, Device::Cpu)
        .with_context(|| format!("loading checkpoint {}", dir.display()))?;
    model.vocab_in_use = exported_vocab_in_use(dir)?;
    Ok(model)
}

/// Loads the next-token model in `dir` for `eval` and `generate`: a Hugging Face
/// `LlamaForCausalLM` folder (`config.json` with `"model_type": "llama"`, through
/// [`hf_llama::load_llama`], RoPE computed as transformers does), else a GPT as
/// [`load_checkpoint`] loads it.
pub fn load_causal_lm(dir: &Path) -> Result<Box<dyn CausalLm>> {
    if hf_llama::is_llama_folder(dir) {
        let model = hf_llama::load_llama(dir, DType::F32, Device::Cpu)
            .with_context(|| format!("loading checkpoint {}", dir.display()))?;
        return Ok(Box::new(model));
    }
    Ok(Box::new(load_checkpoint(dir)?))
}

/// The token ids a model folder's data used, when its vocabulary may be padded: the run's
/// `model.vocab_size` from its `meshgrad.toml`, else the size of its `tokenizer.json`, else
/// `None` (every id of the model's vocabulary).
fn exported_vocab_in_use(dir: &Path) -> Result<Option<usize>> {
    let toml = dir.join("meshgrad.toml");
    if toml.exists() {
        let text = std::fs::read_to_string(&toml)
            .with_context(|| format!("reading {}", toml.display()))?;
        let cfg = TrainConfig::from_toml_str(&text, &toml.display().to_string())?;
        return Ok(Some(cfg.model.vocab_size));
    }
    let tok = dir.join(TOKENIZER_FILE);
    if tok.exists() {
        return Ok(Some(Tokenizer::from_file(&tok)?.vocab_size()));
    }
    Ok(None)
}

/// Mixed into the seed for validation draws, so they never coincide with training draws.
pub(crate) const VAL_STREAM: u64 = 0x5eed_0f7a_1d00_0001;

/// Options of a training run that are not part of the saved config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainOptions {
    /// Gradient accumulation: each rank's rows of a step are processed in this many equal
    /// micro-batches, each loss scaled by `1 / microbatches`, before one optimizer step.
    pub microbatches: usize,
    /// Sequence parallelism (`--sequence-parallel`): with tensor parallelism, the activations
    /// outside the tensor-parallel layers are split along the sequence across the tensor-parallel
    /// ranks. Needs `tp > 1` in the layout; refused otherwise.
    pub sequence_parallel: bool,
    /// Pipeline parallelism's options (schedule, chunks, partition, trace), for layouts with
    /// `pp` above 1; refused otherwise when set.
    pub pipeline: crate::train_pipeline::PipelineOptions,
    /// Activation checkpointing (`--activation-checkpointing`): which blocks recompute their
    /// activations in the backward pass instead of keeping them.
    pub activation_checkpointing: ActivationCheckpointing,
    /// Save a checkpoint every this many steps (`--save-every`), into `OUT/checkpoints`.
    pub save_every: Option<usize>,
    /// Keep only the newest this many periodic checkpoints (`--keep`; all when `None`).
    pub keep: Option<usize>,
    /// Continue the run whose `--out` folder (or checkpoint) this is (`--resume`).
    pub resume: Option<PathBuf>,
    /// Train into an `--out` folder that already holds a run, removing its checkpoints
    /// (`--overwrite`).
    pub overwrite: bool,
    /// How long a rank of a parallel layout waits for its peers in a collective or receive
    /// before the run fails naming the missing ranks (`--collective-timeout`; default
    /// [`crate::train_parallel::COLLECTIVE_TIMEOUT`]).
    pub collective_timeout: std::time::Duration,
}

/// Which blocks recompute their activations during the backward pass
/// (`--activation-checkpointing none|all|S0,S1,...`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ActivationCheckpointing {
    /// Keep every activation (the default).
    #[default]
    None,
    /// Every block of the model, on every stage.
    All,
    /// Only the blocks of these pipeline stages (pipeline ranks; needs `pp` above 1).
    Stages(Vec<usize>),
}

impl std::str::FromStr for ActivationCheckpointing {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "none" => Ok(ActivationCheckpointing::None),
            "all" => Ok(ActivationCheckpointing::All),
            list => list
                .split(',')
                .map(|x| {
                    x.trim().parse::<usize>().map_err(|_| {
                        format!(
                            "--activation-checkpointing {s:?}: expected none, all or pipeline \
                             stage indices such as 0,1"
                        )
                    })
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(ActivationCheckpointing::Stages),
        }
    }
}

impl ActivationCheckpointing {
    /// Whether pipeline stage `stage` recomputes its blocks' activations.
    pub fn on_stage(&self, stage: usize) -> bool {
        match self {
            ActivationCheckpointing::None => false,
            ActivationCheckpointing::All => true,
            ActivationCheckpointing::Stages(s) => s.contains(&stage),
        }
    }

    /// Refuses stage lists without a pipeline of `pp` stages, or naming a stage it lacks.
    pub(crate) fn check(&self, pp: usize) -> Result<()> {
        if let ActivationCheckpointing::Stages(s) = self {
            if pp <= 1 {
                anyhow::bail!(
                    "--activation-checkpointing with stage indices needs pipeline parallelism \
                     (pp=P with P > 1 in --layout); use all or none"
                );
            }
            if let Some(bad) = s.iter().find(|&&x| x >= pp) {
                anyhow::bail!(
                    "--activation-checkpointing: stage {bad} does not exist (pp={pp}: stages \
                     0..{})",
                    pp - 1
                );
            }
        }
        Ok(())
    }
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            microbatches: 1,
            sequence_parallel: false,
            pipeline: Default::default(),
            activation_checkpointing: ActivationCheckpointing::None,
            save_every: None,
            keep: None,
            resume: None,
            overwrite: false,
            collective_timeout: crate::train_parallel::COLLECTIVE_TIMEOUT,
        }
    }
}

/// Checks the checkpointing options, takes the `--out` folder's lock and checks the folder,
/// before any work (see [`crate::run_dir`]; nothing is removed here).
pub(crate) fn check_run_options(cfg: &TrainConfig, opts: &TrainOptions) -> Result<()> {
    if opts.save_every == Some(0) {
        anyhow::bail!("--save-every must be at least 1 (a checkpoint every N steps)");
    }
    if opts.keep == Some(0) {
        anyhow::bail!("--keep must be at least 1 (the number of checkpoints kept)");
    }
    if opts.resume.is_some() && opts.overwrite {
        anyhow::bail!("--resume and --overwrite conflict: continue the run or start over");
    }
    let out = Path::new(&cfg.out);
    crate::run_dir::lock_out_dir(out, "out, --out")?;
    crate::run_dir::check_out_dir(out, opts.resume.is_some(), opts.overwrite)
}

/// Refuses `--sequence-parallel` without tensor parallelism (`tp` is the layout's
/// tensor-parallel degree, 1 on one device), in one line.
pub(crate) fn check_sequence_parallel(opts: &TrainOptions, tp: usize) -> Result<()> {
    if opts.sequence_parallel && tp <= 1 {
        anyhow::bail!("--sequence-parallel needs tensor parallelism (tp>1 in --layout)");
    }
    Ok(())
}

/// How a training loop synchronises across ranks. One device: nothing to do.
pub(crate) trait GradSync {
    /// Whether the next backward synchronises gradients (off for non-final micro-batches).
    fn set_sync(&self, on: bool);
    /// Completes gradient synchronisation after the final backward of a step.
    fn finish(&self) -> Result<()>;
    /// The mean of `local` over the ranks (losses).
    fn mean(&self, local: f64) -> Result<f64>;
    /// Clears the gradients before a step's first backward (default: the optimizer's).
    fn zero_grad(&self, opt: &AdamW) {
        opt.zero_grad();
    }
    /// Clips the global gradient norm to `max_norm` and returns the norm before clipping
    /// (default: the local gradients, which are complete after `finish`; sharded strategies
    /// combine their shards).
    fn clip(&self, params: &[Var], max_norm: f64) -> Result<f64> {
        Ok(clip_grad_norm(params, max_norm)?)
    }
    /// Reference mode's gradient norm: the square root of an order-free exact sum of squares
    /// (default: over the local gradients, which are whole after `finish`; sharded strategies
    /// combine their shards' exact sums), so no layout changes its bits.
    fn exact_norm(&self, params: &[Var]) -> Result<f64> {
        Ok(meshgrad_autograd::distributed::exact_grad_squares(params)?
            .value()
            .sqrt())
    }
    /// Scales the gradients as clipping to `max_norm` does when the global norm is `norm`
    /// (default: the local gradients).
    fn clip_with_norm(&self, params: &[Var], max_norm: f64, norm: f64) -> Result<()> {
        Ok(meshgrad_nn::optim::clip_grads_with_norm(
            params, max_norm, norm,
        )?)
    }
    /// The optimizer step with learning rate `lr` (default: the run's AdamW; sharded
    /// strategies step their own shard of the optimizer).
    fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
        Ok(opt.step(lr)?)
    }
    /// The optimizer step of a bf16 / f16 run whose loss was multiplied by `scale` (1 for
    /// bf16): the gradient norm of the unscaled gradients (from the half-precision gradients,
    /// summed in f64, divided by `scale`), and unless it is NaN or infinite the AdamW step with
    /// the gradient multiplier `clip_coef / scale` applied in f32 on the master weights
    /// ([`AdamW::step_scaled`]); `max_norm` 0 does not clip. Returns the norm, and whether the
    /// step was taken (false: nothing was changed). The default suits gradients every rank holds
    /// whole (one device, DDP).
    fn step_mixed(
        &self,
        opt: &mut AdamW,
        params: &[Var],
        lr: f64,
        max_norm: f64,
        scale: f64,
    ) -> Result<(f64, bool)> {
        let norm = grad_sq_sum(params)?.sqrt() / scale;
        if !norm.is_finite() {
            return Ok((norm, false));
        }
        let coef = meshgrad_nn::optim::clip_coef(max_norm, norm);
        opt.step_scaled(lr, coef / scale)?;
        Ok((norm, true))
    }
}

/// The single-device [`GradSync`]: gradients are already complete.
pub(crate) struct SingleDevice;

impl GradSync for SingleDevice {
    fn set_sync(&self, _on: bool) {}
    fn finish(&self) -> Result<()> {
        Ok(())
    }
    fn mean(&self, local: f64) -> Result<f64> {
        Ok(local)
    }
}

/// Checks that each rank's `rows` split evenly into `microbatches`, with a one-line reason.
pub(crate) fn check_microbatches(
    cfg: &TrainConfig,
    ranks: usize,
    microbatches: usize,
) -> Result<()> {
    let b = cfg.train.batch_size;
    if microbatches == 0 {
        anyhow::bail!("--microbatches must be at least 1");
    }
    if !b.is_multiple_of(ranks) || !(b / ranks).is_multiple_of(microbatches) {
        anyhow::bail!(
            "train.batch_size {b} does not split evenly into {ranks} rank(s) x {microbatches} \
             micro-batches"
        );
    }
    Ok(())
}

/// The data of a run: the train and validation splits, where they came from and the tokenizer
/// (if any) that made them.
pub(crate) struct RunData {
    pub(crate) source: String,
    pub(crate) validation: String,
    pub(crate) train: Dataset,
    pub(crate) val: Dataset,
    pub(crate) tokenizer: Option<Tokenizer>,
}

/// Loads and splits the data the config names (the built-in corpus when no path is given), text
/// through `tokenizer` when there is one. `cfg` is the resolved config
/// ([`resolve_tokenizer`]): token shards are checked against its `model.vocab_size`.
pub(crate) fn run_data(cfg: &TrainConfig, tokenizer: Option<Tokenizer>) -> Result<RunData> {
    let min_len = cfg.model.block_size + 1;
    let vf = cfg.data.val_fraction;
    let split = match &cfg.data.path {
        None => {
            let ds = crate::corpus::builtin_dataset_with(tokenizer.as_ref())?;
            let source = ds.source.clone();
            split_dataset(ds.into(), source, vf, min_len)?
        }
        Some(p) => {
            let opts = LoadOptions {
                tokenizer: tokenizer.as_ref(),
                shard_vocab_size: cfg.model.vocab_size,
            };
            load_split(Path::new(p), &opts, vf, min_len)
                .with_context(|| format!("reading training data {p}"))?
        }
    };
    if split.train.vocab_size() > cfg.model.vocab_size {
        anyhow::bail!(
            "{}: token ids need a vocabulary of {} but model.vocab_size is {}",
            split.source,
            split.train.vocab_size(),
            cfg.model.vocab_size
        );
    }
    Ok(RunData {
        source: split.source,
        validation: split.validation,
        train: split.train,
        val: split.val,
        tokenizer,
    })
}

/// The model, optimizer and schedule of a run.
pub(crate) struct RunModel {
    pub(crate) model: Gpt,
    pub(crate) opt: AdamW,
    pub(crate) schedule: CosineSchedule,
}

/// The dtype of the model's parameters and activations for `train.precision`: f32, bf16 or
/// f16. Half-precision runs keep f32 master weights and AdamW state in the optimizer (see
/// [`AdamW`]).
pub fn precision_dtype(cfg: &TrainConfig) -> Result<DType> {
    match cfg.train.precision.as_str() {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        p => anyhow::bail!("train.precision must be \"f32\", \"bf16\" or \"f16\", got {p:?}"),
    }
}

/// The device of `train.device` (`cpu`, `cuda`, `cuda:N`).
pub fn train_device(cfg: &TrainConfig) -> Result<Device> {
    cfg.train
        .device
        .parse()
        .map_err(|e| anyhow::anyhow!("train.device: {e}"))
}

/// Checks, before any work, that `train.device` and `train.precision` can run with `layout`
/// (`None`: one device): reference mode's own conditions (`reference::check_reference`);
/// a CUDA device trains on one device only (the ranks of a layout compute on the CPU) and must
/// be usable in this build (the backend's one-line reason otherwise: built without `--features
/// cuda`, no driver, no such device). bf16 and f16 train the GPT and BERT under every layout: AdamW's f32
/// master weights on replicated ranks, the ZeRO wrapper's f32 master shards otherwise, the
/// f16 loss scale unscaled in f32 before the norm and the step.
pub fn check_device_and_precision(
    cfg: &TrainConfig,
    layout: Option<&meshgrad_parallel::ParallelLayout>,
) -> Result<()> {
    crate::reference::check_reference(cfg, layout)?;
    let device = train_device(cfg)?;
    precision_dtype(cfg)?;
    let d = &cfg.train.device;
    if device != Device::Cpu {
        if let Some(l) = layout {
            // Under a layout every backend's ranks compute on the CPU (NCCL's stage their
            // collectives through cuda:LOCAL_RANK).
            anyhow::bail!(
                "--device {d} with layout {l}: the ranks of a layout compute on the CPU (with \
                 --backend nccl their collectives run on cuda:LOCAL_RANK); drop --device, or \
                 train on one device without --layout"
            );
        }
        device
            .check_available()
            .map_err(|e| anyhow::anyhow!("--device {d}: {e}"))?;
    }
    Ok(())
}

/// `(ids, targets)` moved to the run's device (created on the host, then copied).
pub(crate) fn to_run_device(
    cfg: &TrainConfig,
    batch: (Tensor, Tensor),
) -> Result<(Tensor, Tensor)> {
    let device = train_device(cfg)?;
    Ok((batch.0.to_device(device)?, batch.1.to_device(device)?))
}

/// Builds the model (weights from the run seed, in the run's precision and on its device),
/// AdamW and the learning-rate schedule.
pub(crate) fn run_model(
    cfg: &TrainConfig,
    tp: Option<TensorParallel>,
    delayed_init: bool,
    checkpointing: bool,
) -> Result<RunModel> {
    let mut builder = ParamBuilder::new(cfg.train.seed)
        .dtype(precision_dtype(cfg)?)
        .device(train_device(cfg)?);
    if delayed_init {
        builder = builder.delayed_init();
    }
    // Reference mode: the layers compute the sums tensor parallelism splits as trees over a
    // chunk count of the model's, on one device (a group of one rank) as on tp ranks.
    let mut model = crate::reference_tp::build_with_plan(cfg, builder, tp, Gpt::tp_plan(), |b| {
        Gpt::build(gpt_config(cfg), b)
    })?;
    model.activation_checkpointing = checkpointing;
    let (opt, schedule) = optimizer_and_schedule(cfg, &model)?;
    Ok(RunModel {
        model,
        opt,
        schedule,
    })
}

/// AdamW over `model`'s trainable parameters (nanoGPT decay groups) with the config's
/// hyper-parameters, and the warm-up + cosine schedule. A run shorter than `warmup_steps` warms
/// up over all its steps (as the config documents). Shared by every model kind.
pub(crate) fn optimizer_and_schedule(
    cfg: &TrainConfig,
    model: &dyn Module,
) -> Result<(AdamW, CosineSchedule)> {
    let t = &cfg.train;
    let opt = AdamW::for_module(model)
        .weight_decay(t.weight_decay)
        .betas(t.beta1, t.beta2)
        .build()?;
    let schedule = CosineSchedule::new(t.lr, t.min_lr, t.warmup_steps.min(t.steps), t.steps)?;
    Ok((opt, schedule))
}

/// Ids and targets `[rows, t]` of global rows `rows` at `step` (of stream `seed`).
pub(crate) fn batch_tensors(
    ds: &Dataset,
    seed: u64,
    step: u64,
    rows: Range<u64>,
    t: usize,
) -> Result<(Tensor, Tensor)> {
    let n = (rows.end - rows.start) as usize;
    let batch = ds.batch(seed, step, rows, t)?;
    Ok((
        Tensor::from_vec(batch.inputs, (n, t), Device::Cpu)?,
        Tensor::from_vec(batch.targets, (n, t), Device::Cpu)?,
    ))
}

/// Mean loss over `eval_batches` fixed validation batches (the same batches at every
/// evaluation). Each rank evaluates its `rows` of every batch; the ranks' means are averaged.
fn val_loss(
    model: &Gpt,
    val: &Dataset,
    cfg: &TrainConfig,
    rows: &Range<u64>,
    sync: &dyn GradSync,
) -> Result<f64> {
    let t = cfg.model.block_size;
    model.set_training(false);
    let r = no_grad(|| -> Result<f64> {
        let mut total = 0.0;
        let n = cfg.train.eval_batches.max(1);
        for i in 0..n {
            // Validation draws use their own stream of "steps", far from the training ones.
            let (ids, targets) = to_run_device(
                cfg,
                batch_tensors(val, cfg.train.seed ^ VAL_STREAM, i as u64, rows.clone(), t)?,
            )?;
            total += model.loss(&ids, &targets, None)?.tensor().item()?;
        }
        Ok(total / n as f64)
    });
    model.set_training(true);
    sync.mean(r?)
}

/// [`val_loss`] in reference mode: each validation batch's loss is the tree sum of its row
/// groups' losses (this rank's `groups` of `total` in all), summed over the data-parallel ranks
/// in the same tree and divided by `total`; the batches' losses are then averaged in order.
fn val_loss_reference(
    model: &Gpt,
    val: &Dataset,
    cfg: &TrainConfig,
    groups: &[Range<u64>],
    total: usize,
    sync: &dyn GradSync,
) -> Result<f64> {
    let t = cfg.model.block_size;
    let n = cfg.train.eval_batches.max(1);
    model.set_training(false);
    let r = (|| -> Result<f64> {
        let mut sum = 0.0;
        for i in 0..n {
            let local = crate::reference::group_loss_sum(groups, |rows| {
                let (ids, targets) = to_run_device(
                    cfg,
                    batch_tensors(val, cfg.train.seed ^ VAL_STREAM, i as u64, rows.clone(), t)?,
                )?;
                Ok(no_grad(|| model.loss(&ids, &targets, None))?
                    .tensor()
                    .item()?)
            })?;
            sum += sync.mean(local)? / total as f64;
        }
        Ok(sum / n as f64)
    })();
    model.set_training(true);
    r
}

/// One JSON line of metrics.
pub(crate) fn metrics_line(
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

/// A metrics line with an f16 run's `"loss_scale"` and `"skipped"` added.
fn with_loss_scale(line: &str, scale: f64, skipped: bool) -> String {
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(mut m) => {
            m["loss_scale"] = serde_json::json!(scale);
            m["skipped"] = serde_json::json!(skipped);
            m.to_string()
        }
        Err(_) => line.to_string(),
    }
}

/// The metrics file of a run resumed after `start_step` steps, open for appending: lines of
/// later steps (written by the run before it was stopped, after its checkpoint) are dropped,
/// through a temporary file renamed over the original.
fn reopen_metrics(path: &Path, start_step: usize) -> Result<std::fs::File> {
    let kept: String = match std::fs::read_to_string(path) {
        Ok(text) => text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s as usize <= start_step)
            })
            .map(|l| format!("{l}\n"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => {
            return Err(e).with_context(|| format!("reading metrics file {}", path.display()))
        }
    };
    meshgrad_nn::state::write_bytes_atomic(path, kept.as_bytes())
        .with_context(|| format!("rewriting metrics file {}", path.display()))?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .with_context(|| format!("opening metrics file {}", path.display()))
}

/// Progress output and the metrics file. Only the leader (rank 0) reports; the others get a
/// silent reporter.
pub(crate) struct Reporter {
    pub(crate) quiet: bool,
    pub(crate) pb: ProgressBar,
    metrics: Option<std::io::BufWriter<std::fs::File>>,
}

impl Reporter {
    /// The leader's reporter: a progress bar (unless quiet) and the metrics file, if configured.
    /// A run resumed after `start_step` steps keeps the metrics file's lines of those steps
    /// (dropping any later ones a killed run wrote) and appends; a new run starts the file.
    pub(crate) fn leader(
        cfg: &TrainConfig,
        verbosity: Verbosity,
        start_step: usize,
    ) -> Result<Reporter> {
        let metrics = match &cfg.metrics {
            None => None,
            Some(p) => {
                if let Some(dir) = Path::new(p).parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
                let file = if start_step == 0 {
                    std::fs::File::create(p)
                        .with_context(|| format!("creating metrics file {p}"))?
                } else {
                    reopen_metrics(Path::new(p), start_step)?
                };
                Some(std::io::BufWriter::new(file))
            }
        };
        let quiet = verbosity == Verbosity::Quiet;
        let pb = if quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::with_draw_target(
                Some(cfg.train.steps as u64),
                ProgressDrawTarget::stderr(),
            )
        };
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb.set_position(start_step as u64);
        Ok(Reporter { quiet, pb, metrics })
    }

    /// A reporter that reports nothing (ranks other than the leader).
    pub(crate) fn silent() -> Reporter {
        Reporter {
            quiet: true,
            pb: ProgressBar::hidden(),
            metrics: None,
        }
    }

    /// Prints a log line (above the progress bar when there is one).
    pub(crate) fn say(&self, s: String) {
        if self.quiet {
        } else if self.pb.is_hidden() {
            println!("{s}");
        } else {
            self.pb.println(s);
        }
    }

    /// Writes one metrics line and flushes it, so the file holds every finished step even if
    /// the run is killed.
    pub(crate) fn metrics(&mut self, line: String) -> Result<()> {
        if let Some(w) = self.metrics.as_mut() {
            writeln!(w, "{line}")
                .and_then(|()| w.flush())
                .context("writing metrics")?;
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<()> {
        self.pb.finish_and_clear();
        if let Some(mut w) = self.metrics {
            w.flush().context("writing metrics")?;
        }
        Ok(())
    }
}

/// What the training loop reports back.
pub(crate) struct LoopResult {
    pub(crate) initial_val_loss: f64,
    pub(crate) final_val_loss: f64,
    pub(crate) final_train_loss: f64,
    pub(crate) tokens_per_s: f64,
    pub(crate) elapsed_s: f64,
}

/// The training loop, for one device or one data-parallel rank: each step, this rank's `rows`
/// of the global batch in `microbatches` micro-batches (losses scaled by `1/microbatches`,
/// gradients accumulated, synchronised by `sync` on the final one), clipping, the optimizer
/// step, the global loss, periodic validation and reporting.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_loop(
    cfg: &TrainConfig,
    data: &RunData,
    run: &mut RunModel,
    rows: Range<u64>,
    microbatches: usize,
    sync: &dyn GradSync,
    rep: &mut Reporter,
    ctl: &RunControl<'_>,
) -> Result<LoopResult> {
    let t = cfg.model.block_size;
    let micro = micro_rows(rows.clone(), microbatches)?;
    let RunModel {
        model,
        opt,
        schedule,
    } = run;
    let model = &*model;
    let params = model.parameters();
    let scaler = run_loss_scaler(cfg, ctl.loss_scaler.as_ref())?;
    // Reference mode: this rank's row groups, each its own pass, added over their tree.
    let reference = cfg.train.reference;
    let total_groups = cfg.train.batch_size / cfg.train.row_group;
    let groups = if reference {
        crate::reference::row_groups(rows.clone(), cfg.train.row_group)?
    } else {
        Vec::new()
    };
    let micro_step = |step: usize| -> Result<f64> {
        if reference {
            let factor = 1.0 / total_groups as f64;
            return crate::reference::reference_step(&params, &groups, factor, sync, |r| {
                let (ids, targets) = to_run_device(
                    cfg,
                    batch_tensors(&data.train, cfg.train.seed, step as u64, r.clone(), t)?,
                )?;
                let ctx = ForwardCtx::new(step as u64, r.start);
                Ok(ctx.scope(|| model.loss(&ids, &targets, None))?)
            });
        }
        let mut loss_sum = 0.0;
        for (m, r) in micro.iter().enumerate() {
            let (ids, targets) = to_run_device(
                cfg,
                batch_tensors(&data.train, cfg.train.seed, step as u64, r.clone(), t)?,
            )?;
            let ctx = ForwardCtx::new(step as u64, r.start);
            let loss = ctx.scope(|| model.loss(&ids, &targets, None))?;
            loss_sum += loss.tensor().item()?;
            // f16: the loss (f32) times the loss scale, so small gradients stay representable.
            let factor = scaler.as_ref().map_or(1.0, |s| s.borrow().scale()) / microbatches as f64;
            let loss = if factor != 1.0 {
                loss.mul_scalar(factor)?
            } else {
                loss
            };
            sync.set_sync(m + 1 == microbatches);
            loss.backward()?;
        }
        Ok(loss_sum / microbatches as f64)
    };
    let val = || {
        if reference {
            val_loss_reference(model, &data.val, cfg, &groups, total_groups, sync)
        } else {
            val_loss(model, &data.val, cfg, &rows, sync)
        }
    };
    // Reference mode: a step's share is the tree sum of its row groups' losses, summed (not
    // averaged) over the data-parallel ranks; the mean divides by the row groups.
    let loss_scale = if reference {
        1.0 / total_groups as f64
    } else {
        1.0
    };
    drive_loop(
        cfg,
        model,
        opt,
        schedule,
        &params,
        sync,
        rep,
        loss_scale,
        scaler.as_ref(),
        micro_step,
        val,
        ctl,
    )
}

/// The loss scaler a training loop keeps: the one a resumed checkpoint saved (`resumed`), else
/// a fresh one for an f16 run ([`loss_scaler`]); `None` for f32 and bf16.
pub(crate) fn run_loss_scaler(
    cfg: &TrainConfig,
    resumed: Option<&LossScaler>,
) -> Result<Option<std::cell::RefCell<LossScaler>>> {
    let scaler = match resumed {
        Some(s) => Some(s.clone()),
        None => loss_scaler(cfg)?,
    };
    Ok(scaler.map(std::cell::RefCell::new))
}

/// The dynamic loss scale of an f16 run (from `train.loss_scale_init`, doubling after
/// [`LossScaler::DEFAULT_GROWTH_INTERVAL`] good steps); `None` for f32 and bf16.
pub(crate) fn loss_scaler(cfg: &TrainConfig) -> Result<Option<LossScaler>> {
    if precision_dtype(cfg)? != DType::F16 {
        return Ok(None);
    }
    Ok(Some(LossScaler::new(
        cfg.train.loss_scale_init,
        LossScaler::DEFAULT_GROWTH_INTERVAL,
    )?))
}

/// What a training loop does besides training: where it starts (a resumed run starts after the
/// step its checkpoint was saved at), when it saves, and how the ranks agree to stop on a signal.
pub(crate) struct RunControl<'a> {
    /// The first step to run.
    pub(crate) start_step: usize,
    /// Every rank of the run, to agree on stopping (all ranks stop after the same step); `None`
    /// on one device.
    pub(crate) world: Option<&'a dyn Communicator>,
    /// Save a checkpoint after every this many steps.
    pub(crate) save_every: Option<usize>,
    /// Saves a checkpoint of the model (this rank's part), the optimizer and an f16 run's loss
    /// scaler after `steps` completed steps (every rank calls it); returns where.
    #[allow(clippy::type_complexity)]
    pub(crate) save:
        Option<&'a dyn Fn(usize, &dyn Module, &AdamW, Option<&LossScaler>) -> Result<String>>,
    /// An f16 run's loss scaler as a resumed checkpoint saved it (`None`: start from
    /// `train.loss_scale_init`).
    pub(crate) loss_scaler: Option<LossScaler>,
}

impl RunControl<'_> {
    /// Whether any rank was asked to stop (a collective over `world` when there is one).
    fn stop_requested(&self) -> Result<bool> {
        // No handler in this process (library use): nothing can ask, and every rank (a thread
        // of this process, or a process of the same binary) knows it without a collective.
        let Some(signal) = crate::stop::installed() else {
            return Ok(false);
        };
        let local = signal.requested();
        match self.world {
            None => Ok(local),
            Some(w) => Ok(all_reduce_scalar(w, f64::from(u8::from(local)), ReduceOp::Max)? > 0.0),
        }
    }
}

/// The part of the training loop that does not depend on the model (GPT or BERT): validation
/// before the first step; each step, `micro_step(step)` runs the forward and backward passes of
/// this rank's micro-batches and returns this rank's share of the step's loss (the global loss is
/// `sync.mean(share) * loss_scale`); then gradient synchronisation, clipping, the optimizer step,
/// the divergence checks (a non-finite gradient norm, when clipping computes one, stops before
/// the optimizer step; a non-finite loss or validation loss stops the run), validation with `val`
/// every `eval_interval` steps and at the end, the metrics line (flushed), the log line and the
/// progress bar.
///
/// Mixed precision (`train.precision` bf16 or f16): the step is [`GradSync::step_mixed`]
/// (unscaling and clipping applied in f32 on the master weights). f16 runs pass the `scaler`
/// whose scale `micro_step` multiplied the loss by: a step whose gradients are not finite is
/// skipped (parameters and AdamW state untouched, AdamW's step counts not advanced; the run's
/// step counter, learning-rate schedule and data still advance, so a skipped step's batch is
/// not retried), the scale is halved, and the skip is reported on stdout and in the metrics
/// line (`"skipped": true`); every f16 metrics line carries `"loss_scale"`, the scale after
/// this step's update (the one the next step uses). A bf16 step with non-finite gradients
/// stops the run as an f32 one does.
#[allow(clippy::too_many_arguments)]
pub(crate) fn drive_loop(
    cfg: &TrainConfig,
    model: &dyn Module,
    opt: &mut AdamW,
    schedule: &CosineSchedule,
    params: &[Var],
    sync: &dyn GradSync,
    rep: &mut Reporter,
    loss_scale: f64,
    scaler: Option<&std::cell::RefCell<LossScaler>>,
    mut micro_step: impl FnMut(usize) -> Result<f64>,
    mut val: impl FnMut() -> Result<f64>,
    ctl: &RunControl<'_>,
) -> Result<LoopResult> {
    let (t, b) = (cfg.model.block_size, cfg.train.batch_size);
    let half = precision_dtype(cfg)? != DType::F32;
    let initial_val = val()?;
    rep.say(format!("step 0: val_loss={initial_val:.4}"));

    let started = Instant::now();
    let mut last_loss = f64::NAN;
    let mut last_val = initial_val;
    let mut tokens_done = 0usize;
    for step in ctl.start_step..cfg.train.steps {
        if let Some(w) = ctl.world {
            crate::flight::test_stop_hook(w.global_rank(), step);
        }
        let t0 = Instant::now();
        sync.zero_grad(opt);
        let share = micro_step(step)?;
        sync.finish()?;
        let lr = schedule.lr_at(step);
        let mut skipped = false;
        let grad_norm = if half {
            let scale = scaler.map_or(1.0, |s| s.borrow().scale());
            let (norm, taken) = sync.step_mixed(opt, params, lr, cfg.train.grad_clip, scale)?;
            if let Some(s) = scaler {
                let new_scale = s.borrow_mut().update(taken);
                if !taken {
                    skipped = true;
                    rep.say(format!(
                        "step {}: non-finite gradients in f16, step skipped, loss scale -> {}",
                        step + 1,
                        new_scale
                    ));
                }
            }
            norm
        } else if cfg.train.reference {
            // Computed even without clipping: reference mode reports the norm it promises.
            let norm = sync.exact_norm(params)?;
            if cfg.train.grad_clip > 0.0 {
                sync.clip_with_norm(params, cfg.train.grad_clip, norm)?;
            }
            norm
        } else if cfg.train.grad_clip > 0.0 {
            sync.clip(params, cfg.train.grad_clip)?
        } else {
            f64::NAN
        };
        let must_be_finite = (half && scaler.is_none()) || cfg.train.grad_clip > 0.0;
        if must_be_finite && !skipped && !grad_norm.is_finite() {
            // Stop before the optimizer step spreads it into the weights. The norm is global,
            // so every rank stops here, after the same collectives.
            let loss = sync.mean(share)? * loss_scale;
            if !loss.is_finite() {
                anyhow::bail!("training diverged: loss is {loss} at step {}", step + 1);
            }
            anyhow::bail!(
                "training diverged: the gradient norm is {grad_norm} at step {} (loss {loss:.4})",
                step + 1
            );
        }
        if !half {
            sync.step(opt, lr)?;
        }
        last_loss = sync.mean(share)? * loss_scale;
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
        let val = if eval_now { Some(val()?) } else { None };
        if let Some(v) = val.filter(|v| !v.is_finite()) {
            anyhow::bail!(
                "training diverged: the validation loss is {v} after step {}",
                step + 1
            );
        }
        if let Some(v) = val {
            last_val = v;
            rep.say(format!("step {}: val_loss={v:.4}", step + 1));
        }
        let mut line = metrics_line(step + 1, last_loss, lr, tps, grad_norm, val);
        if let Some(s) = scaler {
            line = with_loss_scale(&line, s.borrow().scale(), skipped);
        }
        rep.metrics(line)?;
        if cfg.train.log_interval > 0
            && (step + 1) % cfg.train.log_interval == 0
            && rep.pb.is_hidden()
            && !rep.quiet
        {
            println!(
                "step {:>5}/{} | loss {last_loss:.4} | lr {lr:.2e} | {tps:.0} tok/s",
                step + 1,
                cfg.train.steps
            );
        }
        rep.pb
            .set_message(format!("loss {last_loss:.4} | {tps:.0} tok/s"));
        rep.pb.inc(1);
        let done = step + 1;
        let stop = ctl.stop_requested()?;
        let periodic = ctl.save_every.is_some_and(|n| n > 0 && done % n == 0);
        let saved = match ctl.save {
            // The last step is saved when the run saves periodically, and always when it
            // resumed: `checkpoints/latest` then names this run's final state, not the state
            // it resumed from (which `export` and `--resume` would otherwise take for it).
            Some(save)
                if periodic
                    || stop
                    || (is_last && (ctl.save_every.is_some() || ctl.start_step > 0)) =>
            {
                let scaler = scaler.map(|s| s.borrow().clone());
                Some(save(done, model, opt, scaler.as_ref())?)
            }
            _ => None,
        };
        if let Some(at) = &saved {
            rep.say(format!("step {done}: checkpoint {at}"));
        }
        if stop && !is_last {
            rep.pb.abandon();
            match saved {
                Some(at) => anyhow::bail!(
                    "stopped by a signal after step {done} of {}; checkpoint {at}; continue with \
                     --resume",
                    cfg.train.steps
                ),
                None => anyhow::bail!(
                    "stopped by a signal after step {done} of {}; no checkpoint written",
                    cfg.train.steps
                ),
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(LoopResult {
        initial_val_loss: initial_val,
        final_val_loss: last_val,
        final_train_loss: last_loss,
        tokens_per_s: tokens_done as f64 / elapsed,
        elapsed_s: elapsed,
    })
}

/// The first log line of a run.
pub(crate) fn header(cfg: &TrainConfig, model: &GptConfig, data: &RunData, layout: &str) -> String {
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
pub(crate) fn finish_run(
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

/// Trains a GPT on one device as `cfg` describes and writes the checkpoint to `cfg.out`.
pub fn train(cfg: &TrainConfig, verbosity: Verbosity) -> Result<TrainSummary> {
    train_with(cfg, &TrainOptions::default(), verbosity)
}

/// [`train`] with run options (gradient accumulation).
pub fn train_with(
    cfg: &TrainConfig,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    check_device_and_precision(cfg, None)?;
    check_sequence_parallel(opts, 1)?;
    crate::train_pipeline::check_pipeline_flags(opts, 1)?;
    opts.activation_checkpointing.check(1)?;
    check_run_options(cfg, opts)?;
    let (cfg, tokenizer) = resolve_tokenizer(cfg)?;
    let cfg = &cfg;
    check_microbatches(cfg, 1, opts.microbatches)?;
    crate::preflight::check_train(cfg, None, opts)?;
    let data = run_data(cfg, tokenizer)?;
    let mut run = run_model(cfg, None, false, opts.activation_checkpointing.on_stage(0))?;
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
    let micro = if opts.microbatches > 1 {
        format!(", {} micro-batches", opts.microbatches)
    } else {
        String::new()
    };
    rep.say(header(cfg, &run.model.config, &data, &micro));
    let rows = 0..cfg.train.batch_size as u64;
    let r = run_loop(
        cfg,
        &data,
        &mut run,
        rows,
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
    finish_run(
        cfg,
        &mut run.model,
        data.tokenizer.as_ref(),
        rep,
        r,
        verbosity,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_nn::optim::{AdamWConfig, ParamGroup};

    /// Runs `drive_loop` on one parameter whose gradient `grad(step)` sets, with a loss of
    /// `loss(step)`, and returns the error message.
    fn diverge(grad: impl Fn(usize) -> f32, loss: impl Fn(usize) -> f64, clip: f64) -> String {
        let mut cfg = TrainConfig::default();
        cfg.train.steps = 3;
        cfg.train.grad_clip = clip;
        let p = Var::leaf(Tensor::from_vec(vec![1f32; 4], 4, Device::Cpu).unwrap());
        let group = ParamGroup {
            params: vec![("p".to_string(), p.clone())],
            weight_decay: 0.0,
            lr_scale: 1.0,
        };
        let mut opt = AdamW::new(vec![group], AdamWConfig::default()).unwrap();
        let schedule = CosineSchedule::new(1e-3, 1e-4, 1, 3).unwrap();
        let params = vec![p.clone()];
        let micro_step = |step: usize| -> Result<f64> {
            let g = Tensor::from_vec(vec![grad(step); 4], 4, Device::Cpu)?;
            p.set_grad(Some(g));
            Ok(loss(step))
        };
        let mut rep = Reporter::silent();
        let ctl = RunControl {
            start_step: 0,
            world: None,
            save_every: None,
            save: None,
            loss_scaler: None,
        };
        // Only a save hook would read the model; there is none.
        let model = ParamBuilder::new(0)
            .build(|p| meshgrad_nn::Linear::new(p, 1, 1))
            .unwrap();
        let r = drive_loop(
            &cfg,
            &model,
            &mut opt,
            &schedule,
            &params,
            &SingleDevice,
            &mut rep,
            1.0,
            None,
            micro_step,
            || Ok(1.0),
            &ctl,
        );
        match r {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn non_finite_gradients_and_losses_stop_the_run() {
        // Finite values train.
        assert_eq!(diverge(|_| 0.5, |_| 2.0, 1.0), "");
        // A NaN gradient at the second step, with a finite loss: stopped, naming the norm.
        let msg = diverge(|s| if s == 1 { f32::NAN } else { 0.5 }, |_| 2.0, 1.0);
        assert!(
            msg.contains("training diverged: the gradient norm is NaN at step 2"),
            "{msg}"
        );
        let msg = diverge(|s| if s == 0 { f32::INFINITY } else { 0.5 }, |_| 2.0, 1.0);
        assert!(msg.contains("gradient norm is inf at step 1"), "{msg}");
        // A NaN loss is named as such, with or without a NaN gradient.
        let msg = diverge(|_| f32::NAN, |_| f64::NAN, 1.0);
        assert!(
            msg.contains("training diverged: loss is NaN at step 1"),
            "{msg}"
        );
        let msg = diverge(|_| 0.5, |s| if s == 2 { f64::NAN } else { 2.0 }, 1.0);
        assert!(msg.contains("loss is NaN at step 3"), "{msg}");
        // Without clipping no norm is computed; the NaN weights show in the validation loss
        // after the last step at the latest (here the fake validation stays finite, so the
        // loss check is what stops it).
        let msg = diverge(|_| 0.5, |s| if s == 1 { f64::INFINITY } else { 2.0 }, 0.0);
        assert!(msg.contains("loss is inf at step 2"), "{msg}");
    }
}
