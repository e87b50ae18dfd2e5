//! Hugging Face BERT checkpoint folders: `config.json` (`"model_type": "bert"`) and
//! `model.safetensors`.
//!
//! meshgrad's [`BertForMaskedLM`] parameter names are Hugging Face's `BertForMaskedLM` names
//! (`bert.embeddings...`, `bert.encoder.layer.N...`, `cls.predictions...`), and `nn.Linear`
//! weights are `[out, in]` in both, so tensors map one to one. On loading:
//!
//! * names with and without the `bert.` prefix are accepted (a file may also mix them; the same
//!   tensor under both names is an error);
//! * the buffers `embeddings.position_ids` and `embeddings.token_type_ids`, the pooler
//!   (`pooler.dense.*`) and the next-sentence head of `BertForPreTraining`
//!   (`cls.seq_relationship.*`) are ignored;
//! * the tied decoder (`cls.predictions.decoder.weight`, `cls.predictions.decoder.bias`), when
//!   present, must equal the word embeddings and `cls.predictions.bias`;
//! * the old TensorFlow-era names `LayerNorm.gamma` / `LayerNorm.beta` are read as
//!   `LayerNorm.weight` / `LayerNorm.bias` (as Hugging Face does).
//!
//! On saving, the names carry the `bert.` prefix and the tied decoder is not stored: that is what
//! Hugging Face's `save_pretrained` writes for a `BertForMaskedLM` in safetensors format (it drops
//! the aliases listed in the model's tied-weight keys, `cls.predictions.decoder.weight` and
//! `cls.predictions.decoder.bias`, and re-ties them on loading).

use std::collections::HashMap;
use std::path::Path;

use meshgrad_tensor::{DType, Device, Error, Result, Tensor};
use serde_json::json;

use super::hf_folder::{read_config, tensors_equal, write_folder, ConfigKeys, WEIGHTS_FILE};
use super::{check_shape, load_safetensors, load_state_dict, name_list};
use crate::bert::{BertConfig, BertForMaskedLM};
use crate::module::Module;

/// Parses the text of a Hugging Face BERT `config.json` into a [`BertConfig`].
///
/// Required: `vocab_size`, `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
/// `intermediate_size`. Optional, with Hugging Face's defaults: `max_position_embeddings` (512),
/// `type_vocab_size` (2), `layer_norm_eps` (1e-12), `hidden_dropout_prob` (0.1),
/// `attention_probs_dropout_prob` (0.1), `pad_token_id` (0), `initializer_range` (0.02).
/// Settings meshgrad cannot represent are errors: a `model_type` other than `bert`, a
/// `hidden_act` other than `gelu`, a `position_embedding_type` other than `absolute`,
/// `is_decoder` or `add_cross_attention` true, `tie_word_embeddings` false.
pub fn bert_config_from_hf_json(text: &str) -> Result<BertConfig> {
    let keys = ConfigKeys::parse(text, "BERT config")?;
    match keys.string("model_type") {
        Some("bert") => {}
        Some(other) => {
            meshgrad_tensor::bail!("BERT config: model_type is {other:?}, expected \"bert\"")
        }
        None => meshgrad_tensor::bail!("BERT config: missing key model_type (expected \"bert\")"),
    }
    let int = |k: &str| keys.int(k);
    let req = |k: &str| keys.req(k);
    let float = |k: &str, default: f64| keys.float(k, default);
    let string = |k: &str| keys.string(k);
    if let Some(act) = string("hidden_act") {
        if act != "gelu" {
            meshgrad_tensor::bail!(
                "BERT config: hidden_act {act:?} is not supported (meshgrad's BERT uses \"gelu\", the exact erf form)"
            );
        }
    }
    if let Some(p) = string("position_embedding_type") {
        if p != "absolute" {
            meshgrad_tensor::bail!(
                "BERT config: position_embedding_type {p:?} is not supported (only \"absolute\")"
            );
        }
    }
    for k in ["is_decoder", "add_cross_attention"] {
        if keys.flag(k) == Some(true) {
            meshgrad_tensor::bail!("BERT config: {k} true is not supported (encoder only)");
        }
    }
    if keys.flag("tie_word_embeddings") == Some(false) {
        meshgrad_tensor::bail!(
            "BERT config: tie_word_embeddings false is not supported (meshgrad ties the decoder to the word embeddings)"
        );
    }
    let d = BertConfig::default();
    let config = BertConfig {
        vocab_size: req("vocab_size")?,
        hidden_size: req("hidden_size")?,
        num_hidden_layers: req("num_hidden_layers")?,
        num_attention_heads: req("num_attention_heads")?,
        intermediate_size: req("intermediate_size")?,
        max_position_embeddings: int("max_position_embeddings")?
            .unwrap_or(d.max_position_embeddings),
        type_vocab_size: int("type_vocab_size")?.unwrap_or(d.type_vocab_size),
        layer_norm_eps: float("layer_norm_eps", d.layer_norm_eps)?,
        hidden_dropout_prob: float("hidden_dropout_prob", d.hidden_dropout_prob)?,
        attention_probs_dropout_prob: float(
            "attention_probs_dropout_prob",
            d.attention_probs_dropout_prob,
        )?,
        pad_token_id: int("pad_token_id")?.unwrap_or(d.pad_token_id),
        initializer_range: float("initializer_range", d.initializer_range)?,
    };
    config.validate()?;
    Ok(config)
}

/// The Hugging Face `config.json` text describing `model` (a `BertForMaskedLM`).
pub fn hf_bert_config_json(model: &BertForMaskedLM) -> Result<String> {
    check_whole(model, "save_bert")?;
    let c = &model.config;
    // A whole model holds the word-embedding table.
    let Some(table) = model.word_embeddings() else {
        meshgrad_tensor::bail!("save_bert: the model has no word-embedding table");
    };
    let torch_dtype = match table.tensor().dtype() {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => meshgrad_tensor::bail!(
            "save_bert: parameters of dtype {other} cannot form a BERT checkpoint"
        ),
    };
    let v = json!({
        "architectures": ["BertForMaskedLM"],
        "attention_probs_dropout_prob": c.attention_probs_dropout_prob,
        "classifier_dropout": null,
        "hidden_act": "gelu",
        "hidden_dropout_prob": c.hidden_dropout_prob,
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size,
        "layer_norm_eps": c.layer_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "bert",
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "pad_token_id": c.pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": true,
        "torch_dtype": torch_dtype,
        "type_vocab_size": c.type_vocab_size,
        "use_cache": true,
        "vocab_size": c.vocab_size,
    });
    serde_json::to_string_pretty(&v)
        .map_err(|e| Error::Msg(format!("save_bert: cannot format config.json: {e}")))
}

/// A Hugging Face folder holds the whole model: a one-line error for a stage.
fn check_whole(model: &BertForMaskedLM, what: &str) -> Result<()> {
    if !model.is_full() {
        meshgrad_tensor::bail!(
            "{what}: this bert is a stage ({}); a Hugging Face folder holds the whole model",
            model.spec
        );
    }
    Ok(())
}

/// Reads `dir/config.json` as a BERT config (errors name the file).
pub fn read_bert_config(dir: impl AsRef<Path>) -> Result<BertConfig> {
    read_config(dir.as_ref(), "load_bert", bert_config_from_hf_json)
}

/// Whether the checkpoint folder `dir` holds a BERT model: its `config.json` has
/// `"model_type": "bert"`. A missing or unreadable config is `false`.
pub fn is_bert_checkpoint(dir: impl AsRef<Path>) -> bool {
    super::hf_folder::model_type(dir.as_ref()).as_deref() == Some("bert")
}

/// Builds a BERT from the Hugging Face checkpoint folder `dir` (`config.json` and
/// `model.safetensors`, from a `BertForMaskedLM`), with parameters of `dtype` on `device`
/// (converted from the file's dtype). Like Hugging Face's `from_pretrained`, the model is
/// returned in eval mode (no dropout).
///
/// Every model parameter must be in the file, and every file tensor must be a parameter or one of
/// the ignored or tied tensors of the module docs; errors name the file and the tensor, and a
/// wrong shape names both shapes.
pub fn load_bert(dir: impl AsRef<Path>, dtype: DType, device: Device) -> Result<BertForMaskedLM> {
    let dir = dir.as_ref();
    let config = read_bert_config(dir)?;
    let model = BertForMaskedLM::new(config, 0, dtype, device)?;
    load_bert_weights(&model, dir)?;
    model.set_training(false);
    Ok(model)
}

/// Whether the short name (without `bert.`) is a tensor that loading ignores.
fn is_ignored(short: &str) -> bool {
    short == "embeddings.position_ids"
        || short == "embeddings.token_type_ids"
        || short.starts_with("pooler.")
        || short.starts_with("cls.seq_relationship.")
}

/// The model's name for a file name: `bert.` prefix added unless it is a head tensor, old
/// `gamma`/`beta` names mapped to `weight`/`bias`.
fn model_name(file_name: &str) -> (String, String) {
    let short = file_name.strip_prefix("bert.").unwrap_or(file_name);
    let short = if let Some(p) = short.strip_suffix("LayerNorm.gamma") {
        format!("{p}LayerNorm.weight")
    } else if let Some(p) = short.strip_suffix("LayerNorm.beta") {
        format!("{p}LayerNorm.bias")
    } else {
        short.to_string()
    };
    let full = if short.starts_with("cls.") {
        short.clone()
    } else {
        format!("bert.{short}")
    };
    (short, full)
}

/// Reads `dir/model.safetensors` into `model` (in place), as [`load_bert`] describes. The
/// model's structure must match the file (build it from the folder's config).
pub fn load_bert_weights(model: &BertForMaskedLM, dir: impl AsRef<Path>) -> Result<()> {
    check_whole(model, "load_bert")?;
    let path = dir.as_ref().join(WEIGHTS_FILE);
    let ctx = |e: Error| Error::Msg(format!("load_bert: {}: {e}", path.display()));
    let raw = load_safetensors(&path)?;
    // model name -> (name in the file, tensor)
    let mut by_name: HashMap<String, (String, Tensor)> = HashMap::with_capacity(raw.len());
    let mut tied: Vec<(String, String, Tensor)> = Vec::new();
    for (file_name, t) in raw {
        let (short, full) = model_name(&file_name);
        if is_ignored(&short) {
            continue;
        }
        let tied_to = match short.as_str() {
            "cls.predictions.decoder.weight" => Some("bert.embeddings.word_embeddings.weight"),
            "cls.predictions.decoder.bias" => Some("cls.predictions.bias"),
            _ => None,
        };
        if let Some(target) = tied_to {
            tied.push((file_name, target.to_string(), t));
            continue;
        }
        if let Some((other, _)) = by_name.get(&full) {
            return Err(ctx(Error::Msg(format!(
                "tensor {full} appears twice (as {other} and as {file_name})"
            ))));
        }
        by_name.insert(full, (file_name, t));
    }
    let mut missing = Vec::new();
    let mut converted = Vec::new();
    for (name, p) in model.named_parameters() {
        let Some((file_name, t)) = by_name.remove(&name) else {
            missing.push(name);
            continue;
        };
        check_shape(&file_name, t.dims(), p.tensor().dims()).map_err(ctx)?;
        converted.push((name, t));
    }
    if !missing.is_empty() {
        let head_only = missing.iter().all(|n| n.starts_with("cls."));
        let names: Vec<&str> = missing.iter().map(String::as_str).collect();
        let hint = if head_only {
            " (the file has no MLM head: a bare BertModel checkpoint?)"
        } else {
            ""
        };
        return Err(ctx(Error::Msg(format!(
            "missing tensor {}{hint}",
            name_list(&names)
        ))));
    }
    if !by_name.is_empty() {
        let mut names: Vec<&str> = by_name.values().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        return Err(ctx(Error::Msg(format!(
            "unexpected tensor {} (not a BertForMaskedLM parameter)",
            name_list(&names)
        ))));
    }
    for (file_name, target, t) in tied {
        if let Some((_, want)) = converted.iter().find(|(n, _)| *n == target) {
            if !tensors_equal(&t, want).map_err(ctx)? {
                return Err(ctx(Error::Msg(format!(
                    "{file_name} (shape {}) differs from {target} (shape {}); an untied decoder is not supported",
                    t.shape(),
                    want.shape()
                ))));
            }
        }
    }
    load_state_dict(model, &converted, true).map_err(ctx)
}

/// Writes `model` as a Hugging Face BERT checkpoint folder `dir` (created if missing):
/// `model.safetensors` with Hugging Face's `BertForMaskedLM` names (`bert.` prefix, no tied
/// decoder tensors, metadata `{"format": "pt"}`) and `config.json` (see
/// [`hf_bert_config_json`]). Both files are written atomically.
pub fn save_bert(model: &BertForMaskedLM, dir: impl AsRef<Path>) -> Result<()> {
    let dir = dir.as_ref();
    let config = hf_bert_config_json(model)?;
    write_folder(dir, "save_bert", &config, || {
        Ok(model
            .named_parameters()
            .into_iter()
            .map(|(n, p)| (n, p.tensor().clone()))
            .collect())
    })
}
