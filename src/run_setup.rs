//! A training run's set-up, shared by every model family and layout: its options
//! ([`TrainOptions`], the pipeline's [`PipelineOptions`]), their checks before any work, the
//! device and precision, the data (`RunData`), AdamW with warmup + cosine, the f16 loss
//! scaler, and what a run reports ([`TrainSummary`]).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use meshgrad_nn::data::{load_split, split_dataset, Dataset, LoadOptions, TokenSource};
use meshgrad_nn::optim::{AdamW, CosineSchedule, LossScaler};
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::Module;
use meshgrad_parallel::pipeline::ScheduleKind;
use meshgrad_parallel::plan::cost::CpMode;
use meshgrad_tensor::{DType, Device, Tensor};

use crate::config::TrainConfig;

/// How long a rank waits for its peers in any collective before failing the run, by default
/// (`--collective-timeout`). Ranks do the same work between collectives, so this only matters
/// when something is stuck.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

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
    /// Context parallelism's attention (`--cp-mode`): the ring (the default) or an all-gather of
    /// the keys and values. `allgather` needs `cp > 1` in the layout; refused otherwise.
    pub cp_mode: CpMode,
    /// Pipeline parallelism's options (schedule, chunks, partition, trace), for layouts with
    /// `pp` above 1; refused otherwise when set.
    pub pipeline: crate::run_setup::PipelineOptions,
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
    /// [`crate::run_setup::COLLECTIVE_TIMEOUT`]).
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
            cp_mode: CpMode::Ring,
            pipeline: Default::default(),
            activation_checkpointing: ActivationCheckpointing::None,
            save_every: None,
            keep: None,
            resume: None,
            init_from: None,
            overwrite: false,
            collective_timeout: crate::run_setup::COLLECTIVE_TIMEOUT,
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
/// The one-line refusal of `--cp-mode allgather` without context parallelism (`cp` of the
/// layout, 1 without one).
pub(crate) fn check_cp_mode(opts: &TrainOptions, cp: usize) -> Result<()> {
    if opts.cp_mode == CpMode::AllGather && cp <= 1 {
        anyhow::bail!(
            "--cp-mode allgather needs context parallelism: give cp=C (C > 1) in --layout"
        );
    }
    Ok(())
}

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

/// The pipeline options of `meshgrad train` (`--schedule`, `--chunks`, `--partition`,
/// `--trace`); used when the layout has `pp` above 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineOptions {
    /// The schedule (`--schedule`, default 1f1b).
    pub schedule: ScheduleKind,
    /// Model chunks per rank (`--chunks`, interleaved only; default 2 there, 1 otherwise).
    pub chunks: Option<usize>,
    /// How to cut the model (`--partition`: auto, speed, memory, even or `B0,B1,...`).
    pub partition: String,
    /// Write a Chrome trace of the run here (`--trace`).
    pub trace: Option<PathBuf>,
    /// The most memory the partitioner may give one stage, in bytes (`--max-stage-memory`).
    pub max_stage_memory: Option<u64>,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            schedule: ScheduleKind::OneFOneB,
            chunks: None,
            partition: "auto".into(),
            trace: None,
            max_stage_memory: None,
        }
    }
}

impl PipelineOptions {
    /// Whether any pipeline-only option differs from its default (refused without `pp` above
    /// 1); `--trace` is not one: every layout records its ranks' timelines.
    pub fn is_set(&self) -> bool {
        *self
            != PipelineOptions {
                trace: self.trace.clone(),
                ..PipelineOptions::default()
            }
    }
}

/// Parses a size in bytes: a whole number with an optional binary unit, `B`, `KiB`, `MiB`,
/// `GiB` or `TiB` (`512MiB`, `1.5GiB`, `4096`).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            anyhow::bail!("size {s:?}: unknown unit {other:?} (expected B, KiB, MiB, GiB or TiB)")
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("size {s:?}: {num:?} is not a number"))?;
    let bytes = v * scale as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        anyhow::bail!("size {s:?} must be at least 1 byte and below 2^64");
    }
    Ok(bytes as u64)
}

/// Refuses pipeline flags (`--schedule`, `--chunks`, `--partition`, `--max-stage-memory`) when
/// the layout has no pipeline (`pp` is its pipeline degree), in one line.
pub(crate) fn check_pipeline_flags(opts: &TrainOptions, pp: usize) -> Result<()> {
    if pp <= 1 && opts.pipeline.is_set() {
        anyhow::bail!(
            "--schedule, --chunks, --partition and --max-stage-memory need pipeline parallelism \
             (pp=P with P > 1 in --layout)"
        );
    }
    Ok(())
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
