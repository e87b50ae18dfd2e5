//! Hugging Face `LlamaForCausalLM` checkpoint folders: `config.json` and `model.safetensors` (or
//! shards listed in `model.safetensors.index.json`).
//!
//! meshgrad's [`Llama`] uses Hugging Face's parameter names and layouts, so tensors map one to
//! one. Besides them a file may hold `lm_head.weight` for a tied model (accepted when it equals
//! `model.embed_tokens.weight`) and the rotary buffers `model.layers.{i}.self_attn.rotary_emb.inv_freq`
//! of old checkpoints (ignored: meshgrad computes the rotation from `rope_theta`).
//!
//! `config.json` as transformers writes it, old and new: `rope_theta` at the top level (up to
//! transformers 4.x) or inside `rope_parameters` (`{"rope_type": "default", "rope_theta": ...}`,
//! newer versions). What meshgrad's Llama cannot represent is refused with a one-line error
//! naming the file: RoPE scaling (`rope_scaling` not null, or a `rope_type` other than
//! `default`), `attention_bias` or `mlp_bias` true, a `hidden_act` other than `silu`, a
//! `head_dim` other than `hidden_size / num_attention_heads`, a `model_type` other than `llama`
//! or `mixtral` (whose additions are in [`super::hf_mixtral`]: the same functions read and write
//! `MixtralForCausalLM` folders).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use meshgrad_tensor::{DType, Device, Error, Result, Tensor};
use serde_json::{json, Value};

use super::hf_folder::{
    read_config, read_weights, tensors_equal, write_folder, ConfigKeys, CONFIG_FILE,
};
use super::{check_shape, hf_mixtral, load_state_dict, name_list};
use crate::llama::{Llama, LlamaConfig, RopeAngles};
use crate::module::Module;

const WHAT: &str = "Llama config";

/// Parses the text of a Hugging Face Llama `config.json` into a [`LlamaConfig`].
///
/// Keys read: `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
/// `num_attention_heads`, `max_position_embeddings` (required); `num_key_value_heads` (default
/// `num_attention_heads`), `rms_norm_eps` (default 1e-6, transformers' default), `rope_theta` at
/// the top level or in `rope_parameters` (default 10000), `tie_word_embeddings` (default false).
/// A Mixtral config's missing keys take transformers' `MixtralConfig` defaults instead
/// (`hf_mixtral`'s defaults: 8 kv heads, eps 1e-5, rope_theta 1e6).
/// The rotation's angles are transformers' ([`RopeAngles::Transformers`]). Unsupported settings
/// are errors (see the [module docs](self)).
pub fn llama_config_from_hf_json(text: &str) -> Result<LlamaConfig> {
    let keys = ConfigKeys::parse(text, WHAT)?;
    let mixtral = keys.string("model_type") == Some(hf_mixtral::MODEL_TYPE);
    if let Some(mt) = keys.string("model_type") {
        if mt != "llama" && !mixtral {
            meshgrad_tensor::bail!(
                "{WHAT}: model_type is {mt:?}, expected \"llama\" or \"mixtral\""
            );
        }
    }
    if let Some(act) = keys.get("hidden_act") {
        if act.as_str() != Some("silu") {
            meshgrad_tensor::bail!(
                "{WHAT}: hidden_act {act} is not supported (meshgrad's Llama MLP is SwiGLU, \"silu\")"
            );
        }
    }
    for k in ["attention_bias", "mlp_bias"] {
        match keys.get(k) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(v) => meshgrad_tensor::bail!(
                "{WHAT}: {k} {v} is not supported (meshgrad's Llama has no biases)"
            ),
        }
    }
    let defaults = if mixtral {
        hf_mixtral::DEFAULTS
    } else {
        Defaults {
            n_kv_head: None,
            norm_eps: 1e-6,
            rope_theta: 10_000.0,
        }
    };
    let rope_theta = rope_theta(&keys, defaults.rope_theta)?;
    let n_embd = keys.req("hidden_size")?;
    let n_head = keys.req("num_attention_heads")?;
    if let Some(d) = keys.int("head_dim")? {
        if n_head == 0 || d * n_head != n_embd {
            meshgrad_tensor::bail!(
                "{WHAT}: head_dim {d} is not supported (meshgrad's Llama heads are hidden_size / \
                 num_attention_heads = {n_embd} / {n_head} wide)"
            );
        }
    }
    let tie = match keys.get("tie_word_embeddings") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => meshgrad_tensor::bail!("{WHAT}: tie_word_embeddings must be a boolean, got {v}"),
    };
    let n_positions = keys.req("max_position_embeddings")?;
    let moe = if mixtral {
        Some(hf_mixtral::moe_from_keys(&keys, n_positions)?)
    } else {
        None
    };
    let config = LlamaConfig {
        vocab_size: keys.req("vocab_size")?,
        n_positions,
        n_embd,
        n_layer: keys.req("num_hidden_layers")?,
        n_head,
        n_kv_head: keys
            .int("num_key_value_heads")?
            .or(defaults.n_kv_head)
            .unwrap_or(n_head),
        intermediate_size: keys.req("intermediate_size")?,
        rope_theta,
        norm_eps: keys.float("rms_norm_eps", defaults.norm_eps)?,
        tie_embeddings: tie,
        rope_angles: RopeAngles::Transformers,
        moe,
    };
    config.validate()?;
    Ok(config)
}

/// What a `config.json` without the key gives (transformers' config class defaults).
pub(crate) struct Defaults {
    /// `num_key_value_heads` (`None`: `num_attention_heads`).
    pub n_kv_head: Option<usize>,
    /// `rms_norm_eps`.
    pub norm_eps: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
}

/// The RoPE base of the config: `rope_parameters.rope_theta` (newer transformers) or the top
/// level `rope_theta` (`default` when neither is given), refusing any RoPE scaling.
fn rope_theta(keys: &ConfigKeys, default: f64) -> Result<f64> {
    match keys.get("rope_scaling") {
        None | Some(Value::Null) => {}
        Some(v) => meshgrad_tensor::bail!(
            "{WHAT}: rope_scaling {v} is not supported (meshgrad's Llama uses the default RoPE)"
        ),
    }
    let top = keys.float("rope_theta", f64::NAN)?;
    let params = match keys.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(p)) => Some(p),
        Some(v) => meshgrad_tensor::bail!("{WHAT}: rope_parameters must be an object, got {v}"),
    };
    let Some(p) = params else {
        return Ok(if top.is_nan() { default } else { top });
    };
    match p.get("rope_type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "default" => {}
        Some(t) => meshgrad_tensor::bail!(
            "{WHAT}: rope_parameters.rope_type {t} is not supported (only \"default\")"
        ),
    }
    match p.get("rope_theta") {
        None | Some(Value::Null) => Ok(if top.is_nan() { default } else { top }),
        Some(v) => {
            let Some(theta) = v.as_f64() else {
                meshgrad_tensor::bail!(
                    "{WHAT}: rope_parameters.rope_theta must be a number, got {v}"
                );
            };
            if !top.is_nan() && top != theta {
                meshgrad_tensor::bail!(
                    "{WHAT}: rope_theta {top} and rope_parameters.rope_theta {theta} disagree"
                );
            }
            Ok(theta)
        }
    }
}

/// The Hugging Face `config.json` text of a `LlamaForCausalLM` of `config` with parameters of
/// `dtype`. RoPE is written both ways (`rope_theta` at the top level and
/// `rope_parameters: {"rope_type": "default", "rope_theta": ...}`) so old and new transformers
/// versions read it.
pub fn llama_hf_config_json(config: &LlamaConfig, dtype: DType) -> Result<String> {
    let c = config;
    let torch_dtype = match dtype {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => meshgrad_tensor::bail!(
            "save_llama: parameters of dtype {other} cannot form a Llama checkpoint"
        ),
    };
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "head_dim": c.head_dim(),
        "hidden_act": "silu",
        "hidden_size": c.n_embd,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.n_positions,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": c.n_head,
        "num_hidden_layers": c.n_layer,
        "num_key_value_heads": c.n_kv_head,
        "rms_norm_eps": c.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_scaling": null,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": true,
        "vocab_size": c.vocab_size,
    });
    if let Some(moe) = &c.moe {
        hf_mixtral::add_keys(&mut v, moe);
    }
    serde_json::to_string_pretty(&v)
        .map_err(|e| Error::Msg(format!("save_llama: cannot format config.json: {e}")))
}

/// Reads the [`LlamaConfig`] of the checkpoint folder `dir` (its `config.json`).
pub fn read_llama_config(dir: impl AsRef<Path>) -> Result<LlamaConfig> {
    read_config(dir.as_ref(), "load_llama", llama_config_from_hf_json)
}

/// Whether `dir` holds a Llama checkpoint (its `config.json` says `"model_type": "llama"`).
pub fn is_llama_folder(dir: impl AsRef<Path>) -> bool {
    super::hf_folder::model_type(dir.as_ref()).as_deref() == Some("llama")
}

/// Builds the whole [`Llama`] of the Hugging Face checkpoint folder `dir`, with parameters of
/// `dtype` on `device` (converted from the file's dtype). Every parameter must be in the files
/// and every tensor in them must be a parameter (or an accepted extra, see the
/// [module docs](self)); errors name the file and the tensor, a wrong shape both shapes.
pub fn load_llama(dir: impl AsRef<Path>, dtype: DType, device: Device) -> Result<Llama> {
    let dir = dir.as_ref();
    let config = read_llama_config(dir)?;
    let model = Llama::new(config, 0, dtype, device)?;
    load_weights(&model, dir)?;
    Ok(model)
}

/// Loads the checkpoint folder `dir` into `model` in place: the whole model or a stage of it
/// (which takes its own parameters and leaves the other stages' tensors). The folder's
/// `config.json` must describe the model's architecture.
pub fn load_llama_into(model: &Llama, dir: impl AsRef<Path>) -> Result<()> {
    let dir = dir.as_ref();
    // The rotation's rounding is the model's choice, not the folder's.
    let file = LlamaConfig {
        rope_angles: model.config.rope_angles,
        ..read_llama_config(dir)?
    };
    if file != model.config {
        meshgrad_tensor::bail!(
            "load_llama: {} describes {file:?} but the model is {:?}",
            dir.join(CONFIG_FILE).display(),
            model.config
        );
    }
    load_weights(model, dir)
}

/// Every parameter name of the whole model of `c`.
fn full_names(c: &LlamaConfig) -> HashSet<String> {
    let mut names: HashSet<String> = ["model.embed_tokens.weight", "model.norm.weight"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if !c.tie_embeddings {
        names.insert("lm_head.weight".into());
    }
    for i in 0..c.n_layer {
        for leaf in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ] {
            names.insert(format!("model.layers.{i}.{leaf}.weight"));
        }
        let ffn = match &c.moe {
            None => ["gate_proj", "up_proj", "down_proj"]
                .iter()
                .map(|p| format!("model.layers.{i}.mlp.{p}.weight"))
                .collect(),
            Some(moe) => hf_mixtral::layer_names(i, moe),
        };
        names.extend(ffn);
    }
    names
}

/// Whether `name` is an old checkpoint's rotary buffer `model.layers.{i}.self_attn.rotary_emb.inv_freq`.
fn is_rotary_buffer(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with(".self_attn.rotary_emb.inv_freq")
}

/// Reads the folder's tensors, checks them against the whole model's names and `model`'s shapes
/// and copies `model`'s own.
fn load_weights(model: &Llama, dir: &Path) -> Result<()> {
    let ctx = |e: Error| Error::Msg(format!("load_llama: {}: {e}", dir.display()));
    let c = &model.config;
    let known = full_names(c);
    let mut by_name: HashMap<String, Tensor> = HashMap::new();
    let mut unexpected = Vec::new();
    let mut tied_head = None;
    let tensors = hf_mixtral::unfuse_experts(read_weights(dir, "load_llama")?, c.moe.as_ref())
        .map_err(ctx)?;
    for (name, t) in tensors {
        if is_rotary_buffer(&name) {
            continue;
        }
        if c.tie_embeddings && name == "lm_head.weight" {
            tied_head = Some(t);
            continue;
        }
        if !known.contains(&name) {
            unexpected.push(name);
            continue;
        }
        if by_name.insert(name.clone(), t).is_some() {
            return Err(ctx(Error::Msg(format!("tensor {name} appears twice"))));
        }
    }
    if !unexpected.is_empty() {
        unexpected.sort_unstable();
        let names: Vec<&str> = unexpected.iter().map(String::as_str).collect();
        return Err(ctx(Error::Msg(format!(
            "unexpected tensor {} (not a parameter of a Llama of this config)",
            name_list(&names)
        ))));
    }
    if let (Some(head), Some(table)) = (&tied_head, by_name.get("model.embed_tokens.weight")) {
        if !tensors_equal(head, table).map_err(ctx)? {
            return Err(ctx(Error::Msg(
                "lm_head.weight differs from model.embed_tokens.weight, but config.json says \
                 tie_word_embeddings: true"
                    .into(),
            )));
        }
    }
    let mut missing = Vec::new();
    let mut tensors = Vec::new();
    for (name, p) in model.named_parameters() {
        if p.placement().is_some() {
            return Err(ctx(Error::Msg(format!(
                "{name} is split over tensor-parallel ranks; load into a single-device model \
                 and shard it"
            ))));
        }
        match by_name.remove(&name) {
            Some(t) => {
                check_shape(&name, t.dims(), p.tensor().dims()).map_err(ctx)?;
                tensors.push((name, t));
            }
            None => missing.push(name),
        }
    }
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(String::as_str).collect();
        return Err(ctx(Error::Msg(format!(
            "missing tensor {}",
            name_list(&names)
        ))));
    }
    load_state_dict(model, &tensors, true).map_err(ctx)
}

/// Writes the whole `model` as a Hugging Face `LlamaForCausalLM` folder `dir` (created if
/// missing): `model.safetensors` with its parameters under their names (no `lm_head.weight`
/// when tied; metadata `{"format": "pt"}`) and `config.json` ([`llama_hf_config_json`]), both
/// written atomically. The model must be whole and on one device (gather a tensor-parallel or
/// staged model's state first).
pub fn save_llama(model: &Llama, dir: impl AsRef<Path>) -> Result<()> {
    if !model.is_full() {
        meshgrad_tensor::bail!(
            "save_llama: this llama is a stage ({}); a Hugging Face folder holds the whole model",
            model.spec
        );
    }
    let params = model.named_parameters();
    if let Some((name, _)) = params.iter().find(|(_, p)| p.placement().is_some()) {
        meshgrad_tensor::bail!(
            "save_llama: {name} is split over tensor-parallel ranks; gather the state first \
             (crate::tp::full_state_dict) and save a single-device model"
        );
    }
    let dtype = params
        .first()
        .map(|(_, p)| p.tensor().dtype())
        .unwrap_or(DType::F32);
    let config = llama_hf_config_json(&model.config, dtype)?;
    write_folder(dir.as_ref(), "save_llama", &config, || {
        Ok(params
            .iter()
            .map(|(n, p)| (n.clone(), p.tensor().clone()))
            .collect())
    })
}
