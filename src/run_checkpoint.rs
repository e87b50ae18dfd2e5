//! Periodic checkpoints and `--resume` for every training path (one device, data, sharded,
//! tensor and pipeline parallel), on top of [`meshgrad_parallel::checkpoint`].
//!
//! A run with `--save-every N` writes `OUT/checkpoints/step-NNNNNN` every N steps, when a
//! SIGINT / SIGTERM stops it, and after its last step: every rank writes its own pieces
//! (parameters and optimizer state as it holds them: whole, tensor-parallel splits or ZeRO
//! segments), and the checkpoint is published atomically once all are on disk. Its metadata
//! holds the step, the layout and the config; the batches, dropout masks and learning rate of a
//! step are functions of the seed and the step, so those are the whole position of the run.
//! `--resume DIR` (a run's `--out`, or a checkpoint) loads the pieces under the current layout,
//! whatever the layout that saved them, and continues after the saved step.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use meshgrad_nn::optim::{AdamW, LossScaler, Optimizer};
use meshgrad_nn::Module;
use meshgrad_parallel::checkpoint::{self, Checkpoint, Piece, Role, SaveOptions};
use meshgrad_parallel::comm::ReduceOp;
use meshgrad_parallel::Communicator;
use meshgrad_parallel::DataParallel;

use crate::config::TrainConfig;
use crate::run_dir::checkpoints_dir;
use crate::run_setup::TrainOptions;

/// The tokenizer file a run's checkpoint carries (when the run has a tokenizer).
const TOKENIZER_FILE: &str = "tokenizer.json";

/// Saves a run's checkpoints (see the [module docs](self)); one per rank.
pub(crate) struct Saver<'a> {
    dir: PathBuf,
    keep: Option<usize>,
    metadata: serde_json::Value,
    files: Vec<(String, Vec<u8>)>,
    world: Option<&'a dyn Communicator>,
}

impl<'a> Saver<'a> {
    /// The saver of a run: it saves every `--save-every` steps and after the last step when
    /// that is given, and when a signal stops the run in any case. `layout` is the `--layout`
    /// spec (or `single`). On the first rank, the run `--overwrite` replaces is removed (every
    /// check has passed and the run is set up: this is the moment before it writes), and
    /// leftovers of killed saves are removed (no save is running yet).
    pub(crate) fn new(
        cfg: &TrainConfig,
        opts: &TrainOptions,
        layout: &str,
        world: Option<&'a dyn Communicator>,
    ) -> Result<Saver<'a>> {
        let dir = checkpoints_dir(Path::new(&cfg.out));
        let first = world.is_none_or(|w| w.rank() == 0);
        if first && opts.overwrite {
            crate::run_dir::clear_old_run(Path::new(&cfg.out))?;
        }
        if first && dir.exists() {
            checkpoint::cleanup(&dir).with_context(|| format!("cleaning up {}", dir.display()))?;
        }
        let toml = cfg.to_toml_string()?;
        let mut files = vec![("meshgrad.toml".to_string(), toml.clone().into_bytes())];
        if let Some(t) = &cfg.data.tokenizer {
            let bytes = std::fs::read(t).with_context(|| format!("reading tokenizer {t}"))?;
            files.push((TOKENIZER_FILE.to_string(), bytes));
        }
        Ok(Saver {
            dir,
            keep: opts.keep,
            metadata: serde_json::json!({
                "layout": layout,
                "model_kind": cfg.model.kind,
                "config": toml,
            }),
            files,
            world,
        })
    }

    /// Writes the checkpoint after `steps` steps from this rank's `pieces` (every rank calls
    /// it), with an f16 run's dynamic `loss_scaler` state; returns its path. Keeps the newest
    /// `--keep` afterwards.
    pub(crate) fn save(
        &self,
        steps: usize,
        pieces: Vec<Piece>,
        loss_scaler: Option<&LossScaler>,
    ) -> Result<String> {
        self.check_finite(steps, &pieces)?;
        let mut metadata = self.metadata.clone();
        metadata["step"] = serde_json::json!(steps);
        if let Some(s) = loss_scaler {
            metadata[LOSS_SCALE_KEY] =
                serde_json::json!({"scale": s.scale(), "good_steps": s.good_steps()});
        }
        let opts = SaveOptions {
            metadata,
            files: self.files.clone(),
        };
        let name = checkpoint::checkpoint_name(steps as u64);
        let path = match self.world {
            Some(w) => checkpoint::save(&self.dir, &name, pieces, w, &opts)?,
            None => checkpoint::save_single(&self.dir, &name, pieces, &opts)?,
        };
        if self.world.is_none_or(|w| w.rank() == 0) {
            if let Some(k) = self.keep {
                checkpoint::keep(&self.dir, k)?;
            }
        }
        Ok(path.display().to_string())
    }
}

impl Saver<'_> {
    /// Refuses to publish weights that are not finite (a run without clipping can step into NaN
    /// while its loss, computed before the step, still looks finite): the ranks agree whether
    /// any parameter piece holds a NaN or an infinity, and if one does, no rank saves and the
    /// run stops, so `latest` keeps naming the last finite checkpoint (which `--keep` then never
    /// deletes, as it deletes only older ones).
    fn check_finite(&self, steps: usize, pieces: &[Piece]) -> Result<()> {
        let mut bad: Option<&str> = None;
        for p in pieces.iter().filter(|p| p.role == Role::Parameter) {
            // x * 0 is 0 for every finite x and NaN for NaN and the infinities.
            let probe = p.data.mul_scalar(0.0)?.sum_all()?.item()?;
            if !probe.is_finite() {
                bad = Some(&p.name);
                break;
            }
        }
        let any_bad = match self.world {
            Some(w) => {
                meshgrad_parallel::comm::all_reduce_scalar(
                    w,
                    f64::from(u8::from(bad.is_some())),
                    ReduceOp::Max,
                )? > 0.0
            }
            None => bad.is_some(),
        };
        if any_bad {
            let which = bad.map_or("a parameter on another rank".to_string(), |n| {
                format!("parameter {n}")
            });
            anyhow::bail!(
                "training diverged: {which} holds NaN or infinite values after step {steps}; no \
                 checkpoint is written for it (checkpoints/latest, if any, still names the \
                 last finite one)"
            );
        }
        Ok(())
    }
}

/// The checkpoint metadata key of an f16 run's loss scale (`{"scale": S, "good_steps": N}`).
const LOSS_SCALE_KEY: &str = "loss_scale";

/// The saving hook of a training loop ([`crate::run_setup::RunControl::save`]): the steps done, the
/// model, the optimizer and an f16 run's loss scaler.
pub(crate) type SaveHook<'b> =
    Box<dyn Fn(usize, &dyn Module, &AdamW, Option<&LossScaler>) -> Result<String> + 'b>;

impl Saver<'_> {
    /// The training loop's hook: saves this rank's pieces of the model and optimizer it is
    /// given, as its data-parallel `wrapper` holds them ([`DataParallel::local_pieces`]).
    pub(crate) fn hook<'b>(&'b self, wrapper: &'b DataParallel) -> SaveHook<'b> {
        Box::new(move |steps, model, opt, scaler| {
            self.save(steps, wrapper.local_pieces(model, opt)?, scaler)
        })
    }
}

/// Where a rank's run starts.
pub(crate) struct Start {
    /// The first step to run (0, or the step `--resume`'s checkpoint was saved after).
    pub(crate) step: usize,
    /// An f16 run's loss scaler as the checkpoint saved it, unless this run changed
    /// `train.loss_scale_init` (which restarts the scale from the new value) or the checkpoint
    /// holds none.
    pub(crate) loss_scaler: Option<LossScaler>,
}

/// What a rank of a run starts from ([`Start`]: after `--resume`'s checkpoint, loaded into
/// `model` and `opt` as its data-parallel `wrapper` holds them) and its saver (with
/// `--save-every`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn begin_rank<'a>(
    cfg: &TrainConfig,
    opts: &TrainOptions,
    layout: &str,
    world: Option<&'a dyn Communicator>,
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    wrapper: &DataParallel,
    partial: bool,
) -> Result<(Start, Saver<'a>)> {
    let start = match &opts.resume {
        Some(dir) => {
            let (ck, step) = open_resume(cfg, dir)?;
            wrapper
                .load_pieces(&ck, model, opt, !partial)
                .with_context(|| format!("--resume {}", ck.path().display()))?;
            Start {
                step,
                loss_scaler: resumed_loss_scaler(cfg, &ck)
                    .with_context(|| format!("--resume {}", ck.path().display()))?,
            }
        }
        None => Start {
            step: 0,
            loss_scaler: None,
        },
    };
    Ok((start, Saver::new(cfg, opts, layout, world)?))
}

/// The loss scaler `ck` saved, for an f16 run that keeps the checkpoint's
/// `train.loss_scale_init` (a run that sets another one restarts the scale from it).
fn resumed_loss_scaler(cfg: &TrainConfig, ck: &Checkpoint) -> Result<Option<LossScaler>> {
    let Some(base) = crate::run_setup::loss_scaler(cfg)? else {
        return Ok(None);
    };
    let saved = &ck.metadata()[LOSS_SCALE_KEY];
    if saved.is_null() || checkpoint_config(ck)?.train.loss_scale_init != cfg.train.loss_scale_init
    {
        return Ok(None);
    }
    let (Some(scale), Some(good)) = (saved["scale"].as_f64(), saved["good_steps"].as_u64()) else {
        anyhow::bail!("the checkpoint's loss scale {saved} is not {{\"scale\", \"good_steps\"}}");
    };
    Ok(Some(LossScaler::restore(
        scale,
        base.growth_interval(),
        good,
    )?))
}

/// The checkpoint `--resume` names, opened: `DIR/checkpoints`' latest when `DIR` is a run's
/// `--out`, else `DIR` itself (a checkpoint, or a folder of them). Checks that the run continues
/// the same model and data (model sizes, seed, batch size) in the same precision
/// (`train.precision`: a bf16 run's optimizer state has f32 master weights an f32 run lacks) and
/// still has steps to run; returns
/// the checkpoint and its step.
pub(crate) fn open_resume(cfg: &TrainConfig, dir: &Path) -> Result<(Checkpoint, usize)> {
    let ck = resume_checkpoint(dir)?;
    let meta = ck.metadata();
    let step = meta["step"].as_u64().ok_or_else(|| {
        anyhow::anyhow!("--resume {}: the checkpoint records no step", dir.display())
    })? as usize;
    if let Some(saved) = saved_config(&ck, dir)? {
        type Key = (&'static str, fn(&TrainConfig) -> String);
        // A half-precision run's optimizer state holds f32 master weights that an f32 run does
        // not have (and the reverse), so the precision must match too.
        let run_keys: [Key; 3] = [
            ("train.seed", |c| c.train.seed.to_string()),
            ("train.batch_size", |c| c.train.batch_size.to_string()),
            ("train.precision", |c| c.train.precision.clone()),
        ];
        let pairs: Vec<(&str, String, String)> = saved
            .model
            .shape_keys()
            .into_iter()
            .zip(cfg.model.shape_keys())
            .map(|((k, s), (_, n))| (k, s, n))
            .chain(run_keys.map(|(k, f)| (k, f(&saved), f(cfg))))
            .collect();
        if let Some((k, s, n)) = pairs.iter().find(|(_, s, n)| s != n) {
            anyhow::bail!(
                "--resume {}: {k} is {s} in the checkpoint but {n} in this run; a resumed run \
                 continues the same model, data and precision",
                ck.path().display()
            );
        }
    }
    if step > cfg.train.steps {
        anyhow::bail!(
            "--resume {}: the checkpoint is at step {step}, past this run's {} steps \
             (train.steps)",
            ck.path().display(),
            cfg.train.steps
        );
    }
    Ok((ck, step))
}

/// The checkpoint `--resume DIR` names, opened: `DIR/checkpoints`' latest when `DIR` is a run's
/// `--out`, else `DIR` itself.
fn resume_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let ckpts = checkpoints_dir(dir);
    let at = if ckpts.is_dir() {
        ckpts
    } else {
        dir.to_path_buf()
    };
    Checkpoint::open(&at).with_context(|| format!("--resume {}", dir.display()))
}

/// The config `ck` (opened from `--resume dir`) was saved with, if it records one.
fn saved_config(ck: &Checkpoint, dir: &Path) -> Result<Option<TrainConfig>> {
    ck.metadata()["config"]
        .as_str()
        .map(|text| {
            TrainConfig::from_toml_str(text, "the checkpoint's config")
                .with_context(|| format!("--resume {}: its config", dir.display()))
        })
        .transpose()
}

/// The config a run resumed from `dir` starts from when no `--config` file is given: the one its
/// checkpoint was saved with (model, data, hyper-parameters, `out`, `train.steps`), so that
/// `--resume` needs no flag repeated; flags and `--set` then apply on top (a model or data flag
/// that differs from the checkpoint is refused when the run opens it). The defaults when the
/// checkpoint records no config.
pub fn resume_base_config(dir: &Path) -> Result<TrainConfig> {
    let ck = resume_checkpoint(dir)?;
    Ok(saved_config(&ck, dir)?.unwrap_or_default())
}

/// A model loaded from a training checkpoint, with the run's tokenizer if it had one.
pub enum CheckpointModel {
    /// A GPT run.
    Gpt(Box<meshgrad_nn::Gpt>),
    /// A Llama run.
    Llama(Box<meshgrad_nn::Llama>),
    /// A BERT (masked LM) run.
    Bert(Box<meshgrad_nn::bert::BertForMaskedLM>),
}

/// The training checkpoint `dir` names, if it names one: `dir` itself (`index.json`), the
/// latest of a folder of checkpoints, or the latest under a run's `OUT/checkpoints` when `OUT`
/// holds no exported model (`config.json`). `None` for anything else (a Hugging Face folder).
pub fn open_training_checkpoint(dir: &Path) -> Result<Option<Checkpoint>> {
    let index = dir.join(checkpoint::INDEX_FILE);
    let candidates = [dir.to_path_buf(), checkpoints_dir(dir)];
    for c in candidates {
        let is_ckpt =
            c.join(checkpoint::INDEX_FILE).is_file() || c.join(checkpoint::LATEST_FILE).is_file();
        if is_ckpt && (index.is_file() || !dir.join("config.json").is_file()) {
            return Ok(Some(
                Checkpoint::open(&c)
                    .with_context(|| format!("opening checkpoint {}", c.display()))?,
            ));
        }
    }
    Ok(None)
}

/// The model kind of a training checkpoint.
pub fn training_model_kind(ck: &Checkpoint) -> Result<crate::config::ModelKind> {
    Ok(checkpoint_config(ck)?.model.kind)
}

/// The tokenizer file a training checkpoint holds (`tokenizer.json` among its files), if any.
pub fn checkpoint_tokenizer_file(ck: &Checkpoint) -> Option<PathBuf> {
    ck.index()
        .files
        .iter()
        .any(|f| f == TOKENIZER_FILE)
        .then(|| ck.path().join(TOKENIZER_FILE))
}

/// The training config a checkpoint was saved with (its metadata's `config`).
pub fn checkpoint_config(ck: &Checkpoint) -> Result<TrainConfig> {
    let text = ck.metadata()["config"].as_str().ok_or_else(|| {
        anyhow::anyhow!(
            "checkpoint {}: its metadata holds no config",
            ck.path().display()
        )
    })?;
    Ok(TrainConfig::from_toml_str(text, "the checkpoint's config")?)
}

/// Builds the run's model on one device from a training checkpoint (its config is in the
/// metadata) and loads every parameter, one tensor at a time.
pub fn load_training_model(ck: &Checkpoint) -> Result<CheckpointModel> {
    use meshgrad_tensor::{DType, Device};
    let cfg = checkpoint_config(ck)?;
    crate::preflight::check_model_memory(
        &crate::model_configs::model_shape(&cfg),
        &format!("checkpoint {}", ck.path().display()),
    )?;
    let seed = cfg.train.seed;
    use crate::config::ModelKind;
    Ok(match cfg.model.kind {
        ModelKind::Bert => {
            let m = meshgrad_nn::bert::BertForMaskedLM::new(
                crate::model_configs::bert_config(&cfg),
                seed,
                DType::F32,
                Device::Cpu,
            )?;
            ck.load_into_module(&m, true)?;
            CheckpointModel::Bert(Box::new(m))
        }
        ModelKind::Gpt => {
            CheckpointModel::Gpt(Box::new(causal_model::<meshgrad_nn::Gpt>(ck, &cfg)?))
        }
        ModelKind::Llama => {
            CheckpointModel::Llama(Box::new(causal_model::<meshgrad_nn::Llama>(ck, &cfg)?))
        }
        // A Mixtral is a Llama with experts: one model type.
        ModelKind::Mixtral => {
            CheckpointModel::Llama(Box::new(causal_model::<meshgrad_nn::Mixtral>(ck, &cfg)?))
        }
    })
}

/// The whole next-token model of family `F` a run of `cfg` trained, from checkpoint `ck`, on
/// the CPU in f32 (sampling among the run's `model.vocab_size` ids).
fn causal_model<F: crate::recipe_causal::TrainFamily>(
    ck: &Checkpoint,
    cfg: &TrainConfig,
) -> Result<F::Whole> {
    let builder = meshgrad_nn::ParamBuilder::new(cfg.train.seed);
    let m = F::build_whole(F::config(cfg), builder, cfg.model.vocab_size)?;
    ck.load_into_module(&m, true)?;
    Ok(m)
}

/// The tokenizer a training checkpoint carries (the run's `--tokenizer`), if any.
pub fn load_training_tokenizer(
    ck: &Checkpoint,
) -> Result<Option<meshgrad_nn::tokenizer::Tokenizer>> {
    if !ck.index().files.iter().any(|f| f == TOKENIZER_FILE) {
        return Ok(None);
    }
    let bytes = ck.read_file(TOKENIZER_FILE)?;
    let json = String::from_utf8(bytes)
        .with_context(|| format!("{}/{TOKENIZER_FILE} is not UTF-8", ck.path().display()))?;
    Ok(Some(meshgrad_nn::tokenizer::Tokenizer::from_json(
        &json,
        ck.path().join(TOKENIZER_FILE),
    )?))
}

/// `meshgrad export`: writes the model of a training checkpoint as a Hugging Face folder
/// (`config.json`, `model.safetensors`, and the tokenizer and `meshgrad.toml` when it has them).
///
/// `out` is locked for the export ([`crate::run_dir::lock_out_dir`]: a run or another export in
/// progress there refuses it). A folder that holds a run's checkpoints is refused; one that
/// holds a model (an earlier export, or a run's final model) is refused unless `overwrite`.
/// Every file is replaced atomically, the model's two files as one (a failed export leaves the
/// previous one loadable), and a `tokenizer.json` the new model does not have is removed.
pub fn export(checkpoint: &Path, out: &Path, overwrite: bool) -> Result<PathBuf> {
    // A run's folder may hold a final model too: export its checkpoints.
    let ckpts = checkpoints_dir(checkpoint);
    let at = if ckpts.is_dir() {
        ckpts
    } else {
        checkpoint.to_path_buf()
    };
    if !(at.join(checkpoint::INDEX_FILE).is_file() || at.join(checkpoint::LATEST_FILE).is_file()) {
        anyhow::bail!(
            "{} is not a meshgrad training checkpoint (no {} here or under checkpoints/)",
            checkpoint.display(),
            checkpoint::INDEX_FILE
        );
    }
    crate::run_dir::lock_out_dir(out, "--out")?;
    if checkpoints_dir(out).exists() {
        anyhow::bail!(
            "{} holds a run's checkpoints ({}): export into another folder",
            out.display(),
            checkpoints_dir(out).display()
        );
    }
    if let Some(marker) = crate::run_dir::run_marker(out).filter(|_| !overwrite) {
        anyhow::bail!(
            "{} already holds a model ({} exists); pass --overwrite to replace it",
            out.display(),
            marker.display()
        );
    }
    let ck =
        Checkpoint::open(&at).with_context(|| format!("opening checkpoint {}", at.display()))?;
    let model = load_training_model(&ck)?;
    let tokenizer = load_training_tokenizer(&ck)?;
    match &model {
        CheckpointModel::Gpt(m) => meshgrad_nn::state::hf_gpt2::save_gpt2(m, out)?,
        CheckpointModel::Llama(m) => meshgrad_nn::state::hf_llama::save_llama(m, out)?,
        CheckpointModel::Bert(m) => meshgrad_nn::state::hf_bert::save_bert(m, out)?,
    }
    let tokenizer_path = out.join(TOKENIZER_FILE);
    match tokenizer {
        Some(t) => t.save(&tokenizer_path)?,
        None if tokenizer_path.exists() => std::fs::remove_file(&tokenizer_path)
            .with_context(|| format!("removing the stale {}", tokenizer_path.display()))?,
        None => {}
    }
    if ck.index().files.iter().any(|f| f == "meshgrad.toml") {
        meshgrad_nn::state::write_bytes_atomic(
            out.join("meshgrad.toml"),
            &ck.read_file("meshgrad.toml")?,
        )?;
    }
    Ok(ck.path().to_path_buf())
}
