//! `train --init-from DIR`: fine-tuning. The run starts from the weights of a model folder with a
//! fresh optimizer and schedule:
//!
//! * a Hugging Face folder written by transformers: GPT-2 (`"model_type": "gpt2"`) or Llama
//!   (`"llama"`); its `config.json` fixes the model (the context length from `n_positions` /
//!   `max_position_embeddings`), and its `tokenizer.json`, when it has one, becomes the run's
//!   tokenizer unless `--tokenizer` names another;
//! * a folder or training checkpoint written by `meshgrad train` (any model kind): the model
//!   section of its `meshgrad.toml` (or of the checkpoint's config) fixes the model, and its
//!   tokenizer is the run's.
//!
//! A flag or `--set` that changes a key fixing the model's shape ([`ModelConfig::shape_keys`])
//! is refused in one line; `model.dropout` and everything outside `[model]` stay the run's.
//! The weights are read once per process, on the CPU, into the single-device model's names and
//! shapes ([`InitialValues`]); each rank's [`ParamBuilder`](meshgrad_nn::ParamBuilder) copies
//! out only its own part (its tensor-parallel slice, a pipeline stage's parameters, a ZeRO-3
//! unit when it is first gathered), and the whole copy is dropped once the ranks have built
//! their models.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use meshgrad_nn::state::{hf_bert, hf_gpt2, hf_llama, hf_mixtral, state_dict};
use meshgrad_nn::InitialValues;
use meshgrad_tensor::{DType, Device};

use crate::config::{ModelConfig, ModelKind, TrainConfig};
use crate::run_setup::TOKENIZER_FILE;

/// What a model folder fixes of a run: its model section, and its tokenizer file if it has one.
#[derive(Clone, Debug, PartialEq)]
pub struct FolderModel {
    /// The model's section of the config (shape keys from the folder, the rest defaults).
    pub model: ModelConfig,
    /// The folder's `tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
}

/// The model `dir` holds (see the [module docs](self)), or a one-line reason it holds none this
/// command can start from.
pub fn folder_model(dir: &Path) -> Result<FolderModel> {
    let what = || format!("--init-from {}", dir.display());
    if !dir.is_dir() {
        anyhow::bail!("{}: no such folder", what());
    }
    let tokenizer = Some(dir.join(TOKENIZER_FILE)).filter(|p| p.is_file());
    // A meshgrad training checkpoint, or a folder meshgrad wrote (its run's config beside it).
    if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(dir).with_context(what)? {
        let cfg = crate::run_checkpoint::checkpoint_config(&ck).with_context(what)?;
        let tokenizer = crate::run_checkpoint::checkpoint_tokenizer_file(&ck);
        return Ok(FolderModel {
            model: cfg.model,
            tokenizer,
        });
    }
    let toml = dir.join("meshgrad.toml");
    if toml.is_file() {
        let text = std::fs::read_to_string(&toml)
            .with_context(|| format!("{}: reading {}", what(), toml.display()))?;
        let cfg = TrainConfig::from_toml_str(&text, &toml.display().to_string())?;
        return Ok(FolderModel {
            model: cfg.model,
            tokenizer,
        });
    }
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).map_err(|e| {
        anyhow::anyhow!(
            "{}: cannot read {} ({e}); expected a Hugging Face model folder or a meshgrad \
             checkpoint",
            what(),
            config.display()
        )
    })?;
    let mut model = ModelConfig::default();
    if hf_llama::is_llama_folder(dir) || hf_mixtral::is_mixtral_folder(dir) {
        let c = hf_llama::llama_config_from_hf_json(&text).with_context(what)?;
        model.kind = ModelKind::Llama;
        if let Some(moe) = c.moe {
            model.kind = ModelKind::Mixtral;
            model.n_experts = moe.n_experts;
            model.experts_per_token = moe.experts_per_token;
            model.router_aux_loss_coef = moe.router_aux_loss_coef;
        }
        model.n_layer = c.n_layer;
        model.n_head = c.n_head;
        model.n_kv_head = c.n_kv_head;
        model.n_embd = c.n_embd;
        model.intermediate_size = c.intermediate_size;
        model.block_size = c.n_positions;
        model.vocab_size = c.vocab_size;
        model.rope_theta = c.rope_theta;
        model.norm_eps = c.norm_eps;
        model.tie_embeddings = Some(c.tie_embeddings);
        model.bias = false;
    } else if hf_bert::is_bert_checkpoint(dir) {
        anyhow::bail!(
            "{}: a transformers BERT folder (its own WordPiece vocabulary and special ids) \
             cannot start `train --model bert`, which reads byte-level ids with [PAD] [UNK] \
             [CLS] [SEP] [MASK] appended; a BERT folder or checkpoint written by meshgrad can",
            what()
        );
    } else {
        let (c, _) = hf_gpt2::gpt_config_from_hf_json(&text)
            .with_context(|| format!("{}: {}", what(), config.display()))?;
        model.kind = ModelKind::Gpt;
        model.n_layer = c.n_layer;
        model.n_head = c.n_head;
        model.n_embd = c.n_embd;
        model.block_size = c.block_size;
        model.vocab_size = c.vocab_size;
        model.bias = c.bias;
    }
    Ok(FolderModel { model, tokenizer })
}

/// Starts `cfg` from the folder: its shape keys become the folder's (the run keeps its
/// `model.dropout`), and the folder's tokenizer becomes the run's when `cfg` names none.
/// Returns the folder's model, for [`check`] once the flags are applied.
pub fn apply(cfg: &mut TrainConfig, dir: &Path) -> Result<FolderModel> {
    let folder = folder_model(dir)?;
    let dropout = cfg.model.dropout;
    cfg.model = folder.model.clone();
    cfg.model.dropout = dropout;
    if cfg.data.tokenizer.is_none() {
        cfg.data.tokenizer = folder.tokenizer.as_ref().map(|p| p.display().to_string());
    }
    Ok(folder)
}

/// Refuses, in one line, a run whose model differs in shape from the folder's (a flag or
/// `--set` that changed a shape key).
pub fn check(cfg: &TrainConfig, folder: &FolderModel, dir: &Path) -> Result<()> {
    for ((k, want), (_, got)) in folder
        .model
        .shape_keys()
        .into_iter()
        .zip(cfg.model.shape_keys())
    {
        if want != got {
            anyhow::bail!(
                "--init-from {}: {k} is {want} in the folder but {got} in this run; the folder \
                 fixes the model (drop the flag or --set that changes it)",
                dir.display()
            );
        }
    }
    Ok(())
}

/// The weights of the model in `dir` for a run of `cfg`, in f32 on the CPU, under the
/// single-device model's names and shapes (a Hugging Face GPT-2's `Conv1D` weights transposed,
/// a tied head once).
pub(crate) fn initial_values(dir: &Path, cfg: &TrainConfig) -> Result<InitialValues> {
    let what = || format!("--init-from {}", dir.display());
    let named = if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(dir)? {
        ck.full_parameters().with_context(what)?
    } else {
        match cfg.model.kind {
            ModelKind::Gpt => {
                hf_gpt2::load_gpt2(dir, DType::F32, Device::Cpu).map(|m| state_dict(&m))
            }
            ModelKind::Llama | ModelKind::Mixtral => {
                hf_llama::load_llama(dir, DType::F32, Device::Cpu).map(|m| state_dict(&m))
            }
            ModelKind::Bert => {
                hf_bert::load_bert(dir, DType::F32, Device::Cpu).map(|m| state_dict(&m))
            }
        }
        .with_context(what)?
    };
    Ok(named.into_iter().collect::<HashMap<_, _>>())
}
