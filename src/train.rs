//! `meshgrad train`: [`train`], the one entry for every model family and layout: the checks
//! before any work, the run's data, and the registry that maps the config's model kind to its
//! [`Recipe`](crate::recipe::Recipe) for the trainer ([`crate::rank_train`]). Also the run's
//! options ([`TrainOptions`]), its device and precision, AdamW with warmup + cosine, and loading
//! what a run wrote.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use meshgrad_nn::data::{load_split, split_dataset, Dataset, LoadOptions, TokenSource};
use meshgrad_nn::optim::{AdamW, CosineSchedule};
use meshgrad_nn::state::{hf_gpt2, hf_llama};
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::{CausalLm, Gpt, Llama, Module};
use meshgrad_parallel::ParallelLayout;
use meshgrad_tensor::{DType, Device, Tensor};

use crate::config::{ModelKind, TrainConfig};
use crate::recipe::Recipe;
use crate::recipe_bert::BertRecipe;
use crate::recipe_causal::CausalRecipe;

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
            crate::run_checkpoint::CheckpointModel::Llama(_) => anyhow::bail!(
                "{} is a Llama checkpoint; this command takes a GPT",
                ck.path().display()
            ),
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

/// Loads the next-token model in `dir` for `eval` and `generate`: a training checkpoint of a
/// GPT or Llama run, a Hugging Face `LlamaForCausalLM` folder (`config.json` with
/// `"model_type": "llama"`, through [`hf_llama::load_llama`], RoPE computed as transformers
/// does; sampling among the ids its run's data used when it has a `meshgrad.toml` or
/// `tokenizer.json`), else a GPT as [`load_checkpoint`] loads it.
pub fn load_causal_lm(dir: &Path) -> Result<Box<dyn CausalLm>> {
    if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(dir)? {
        if let crate::run_checkpoint::CheckpointModel::Llama(m) =
            crate::run_checkpoint::load_training_model(&ck)?
        {
            return Ok(m);
        }
    }
    if hf_llama::is_llama_folder(dir) {
        crate::preflight::check_checkpoint(dir)?;
        let mut model = hf_llama::load_llama(dir, DType::F32, Device::Cpu)
            .with_context(|| format!("loading checkpoint {}", dir.display()))?;
        model.vocab_in_use = exported_vocab_in_use(dir)?;
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
    pub pipeline: crate::pipeline_plan::PipelineOptions,
    /// Activation checkpointing (`--activation-checkpointing`): which blocks recompute their
    /// activations in the backward pass instead of keeping them.
    pub activation_checkpointing: ActivationCheckpointing,
    /// Save a checkpoint every this many steps (`--save-every`), into `OUT/checkpoints`.
    pub save_every: Option<usize>,
    /// Keep only the newest this many periodic checkpoints (`--keep`; all when `None`).
    pub keep: Option<usize>,
    /// Continue the run whose `--out` folder (or checkpoint) this is (`--resume`).
    pub resume: Option<PathBuf>,
    /// Start from the weights of this model folder or checkpoint, with a fresh optimizer and
    /// schedule (`--init-from`; see [`crate::init_from`]).
    pub init_from: Option<PathBuf>,
    /// Train into an `--out` folder that already holds a run, removing its checkpoints
    /// (`--overwrite`).
    pub overwrite: bool,
    /// How long a rank of a parallel layout waits for its peers in a collective or receive
    /// before the run fails naming the missing ranks (`--collective-timeout`; default
    /// [`crate::ranks::COLLECTIVE_TIMEOUT`]).
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
            init_from: None,
            overwrite: false,
            collective_timeout: crate::ranks::COLLECTIVE_TIMEOUT,
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

/// Trains the model `cfg` describes, on one device (`layout` `None`) or on the ranks of
/// `layout`, and writes the checkpoint to `cfg.out`: every check before any work (one line
/// each), the config resolved (a tokenizer's vocabulary), the data read, and the model kind's
/// recipe handed to the trainer.
pub fn train(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    cfg.validate()?;
    check_device_and_precision(cfg, layout)?;
    // Reference mode: the microbatches are the rank's row groups.
    let opts = &crate::pipeline_plan::reference_options(cfg, layout, opts)?;
    let (cfg, tokenizer) = resolve_tokenizer(cfg)?;
    let cfg = &cfg;
    match layout {
        Some(l) => crate::ranks::check_layout(cfg, l, opts)?,
        None => {
            check_sequence_parallel(opts, 1)?;
            crate::pipeline_plan::check_pipeline_flags(opts, 1)?;
            opts.activation_checkpointing.check(1)?;
            check_run_options(cfg, opts)?;
            check_microbatches(cfg, 1, opts.microbatches)?;
        }
    }
    // The registry: the one place a model kind maps to its recipe.
    match cfg.model.kind {
        ModelKind::Gpt => {
            train_recipe::<CausalRecipe<Gpt>>(cfg, tokenizer, layout, opts, verbosity)
        }
        ModelKind::Llama => {
            train_recipe::<CausalRecipe<Llama>>(cfg, tokenizer, layout, opts, verbosity)
        }
        ModelKind::Bert => train_recipe::<BertRecipe>(cfg, tokenizer, layout, opts, verbosity),
    }
}

/// [`train`] once the model kind is known: the recipe's own checks, the memory preflight, the
/// data, and the trainer.
fn train_recipe<R: Recipe>(
    cfg: &TrainConfig,
    tokenizer: Option<Tokenizer>,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
    verbosity: Verbosity,
) -> Result<TrainSummary> {
    R::check(cfg, layout, opts)?;
    crate::preflight::check_train(cfg, layout, opts)?;
    let data = run_data(cfg, tokenizer)?;
    let recipe = R::new(cfg.clone(), data)?;
    crate::rank_train::run(&recipe, layout, opts, verbosity)
}
