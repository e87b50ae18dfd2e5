//! `meshgrad train`: [`train`], the one entry for every model family and layout: the checks
//! before any work, the run's data, and the registry that maps the config's model kind to its
//! `Recipe` for the trainer (`crate::rank_train`); and loading the
//! model a run wrote ([`load_checkpoint`], [`load_causal_lm`]). The run's options and set-up
//! are in [`crate::run_setup`].

use std::path::Path;

use anyhow::{Context, Result};
use meshgrad_nn::state::{hf_gpt2, hf_llama, hf_mixtral};
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::{CausalLm, Gpt, Llama, Mixtral};
use meshgrad_parallel::ParallelLayout;
use meshgrad_tensor::{DType, Device};

use crate::config::{ModelKind, TrainConfig};
use crate::recipe::Recipe;
use crate::recipe_bert::BertRecipe;
use crate::recipe_causal::CausalRecipe;
use crate::run_setup::{
    check_device_and_precision, check_microbatches, check_run_options, check_sequence_parallel,
    resolve_tokenizer, run_data, TrainOptions, TrainSummary, Verbosity, TOKENIZER_FILE,
};

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
/// GPT, Llama or Mixtral run, a Hugging Face `LlamaForCausalLM` or `MixtralForCausalLM` folder
/// (`config.json` with `"model_type": "llama"` or `"mixtral"`, through
/// [`hf_llama::load_llama`], RoPE computed as transformers
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
    if hf_llama::is_llama_folder(dir) || hf_mixtral::is_mixtral_folder(dir) {
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
    let (cfg, tokenizer, opts) = prepare(cfg, layout, opts)?;
    let job = TrainJob {
        cfg: &cfg,
        tokenizer,
        layout,
        opts: &opts,
        verbosity,
    };
    with_recipe(cfg.model.kind, job)
}

/// The checks every run makes before any work (one line each), and the resolved config (a
/// tokenizer's vocabulary), its tokenizer and the options (reference mode's microbatches are
/// its row groups).
fn prepare(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
) -> Result<(TrainConfig, Option<Tokenizer>, TrainOptions)> {
    cfg.validate()?;
    check_device_and_precision(cfg, layout)?;
    // Reference mode: the microbatches are the rank's row groups.
    let opts = crate::pipeline_plan::reference_options(cfg, layout, opts)?;
    let (cfg, tokenizer) = resolve_tokenizer(cfg)?;
    match layout {
        Some(l) => crate::ranks::check_layout(&cfg, l, &opts)?,
        None => {
            check_sequence_parallel(&opts, 1)?;
            crate::run_setup::check_cp_mode(&opts, 1)?;
            crate::run_setup::check_pipeline_flags(&opts, 1)?;
            opts.activation_checkpointing.check(1)?;
            check_run_options(&cfg, &opts)?;
            check_microbatches(&cfg, 1, opts.microbatches)?;
        }
    }
    Ok((cfg, tokenizer, opts))
}

/// `train --dry-run`: the run's checks (the `--out` folder's included: it is created if absent
/// and locked, as for the run), then the planner's line for it on this machine
/// ([`crate::plan_cmd::dry_run`], with the `[tcp]` link when `over_tcp`: the ranks are processes
/// of `meshgrad launch`); nothing is trained, nothing written into the folder.
pub fn dry_run(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
    over_tcp: bool,
) -> Result<()> {
    let (cfg, _, opts) = prepare(cfg, layout, opts)?;
    crate::plan_cmd::dry_run(&cfg, layout, &opts, over_tcp)
}

/// Work that needs the model kind's recipe type: [`with_recipe`] calls [`RecipeJob::run`] with
/// the recipe of the config's model kind.
pub(crate) trait RecipeJob {
    /// What the work returns.
    type Output;
    /// Does the work with recipe `R`.
    fn run<R: Recipe>(self) -> Result<Self::Output>;
}

/// The registry: the one place a model kind maps to its recipe.
pub(crate) fn with_recipe<J: RecipeJob>(kind: ModelKind, job: J) -> Result<J::Output> {
    match kind {
        ModelKind::Gpt => job.run::<CausalRecipe<Gpt>>(),
        ModelKind::Llama => job.run::<CausalRecipe<Llama>>(),
        ModelKind::Mixtral => job.run::<CausalRecipe<Mixtral>>(),
        ModelKind::Bert => job.run::<BertRecipe>(),
    }
}

/// [`train`] once the model kind is known: the recipe's own checks, the memory preflight, the
/// data, and the trainer.
struct TrainJob<'a> {
    cfg: &'a TrainConfig,
    tokenizer: Option<Tokenizer>,
    layout: Option<&'a ParallelLayout>,
    opts: &'a TrainOptions,
    verbosity: Verbosity,
}

impl RecipeJob for TrainJob<'_> {
    type Output = TrainSummary;

    fn run<R: Recipe>(self) -> Result<TrainSummary> {
        let (cfg, layout, opts) = (self.cfg, self.layout, self.opts);
        R::check(cfg, layout, opts)?;
        crate::preflight::check_train(cfg, layout, opts)?;
        let data = run_data(cfg, self.tokenizer)?;
        let recipe = R::new(cfg.clone(), data)?;
        crate::rank_train::run(&recipe, layout, opts, self.verbosity)
    }
}
