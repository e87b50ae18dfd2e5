//! Hugging Face GPT-2 checkpoint folders: `config.json` and `model.safetensors`.
//!
//! meshgrad's GPT parameter names are Hugging Face's without the `transformer.` prefix
//! (`wte.weight`, `h.0.attn.c_attn.weight`, ..., `ln_f.bias`). Differences handled here:
//!
//! * HF's `Conv1D` layers (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`) store weights
//!   `[in, out]`; meshgrad's `Linear` stores `[out, in]`, so these four are transposed both ways.
//! * Files may name tensors with or without the `transformer.` prefix (both are accepted; this
//!   module writes them without it, like the `gpt2` checkpoints on the Hub).
//! * The causal-mask buffers `h.N.attn.bias` (shape `[1, 1, T, T]`; not to be confused with the
//!   parameter `h.N.attn.c_attn.bias`) and `h.N.attn.masked_bias` are ignored.
//! * The output head `lm_head.weight` is tied to `wte.weight`: it is ignored when present, after
//!   checking that it equals `wte.weight` (an untied head is an error).

use std::collections::HashMap;
use std::path::Path;

use meshgrad_tensor::{DType, Device, Error, GeluKind, Result, Tensor};
use serde_json::{json, Value};

use super::hf_folder::{
    read_config as read_folder_config, tensors_equal, write_folder, ConfigKeys, CONFIG_FILE,
    WEIGHTS_FILE,
};
use super::{check_shape, load_safetensors, load_state_dict, name_list};
use crate::gpt::{Gpt, GptConfig};
use crate::module::Module;

/// Whether `name` (without prefix) is one of the four HF `Conv1D` weights stored `[in, out]`:
/// `h.<N>.attn.c_attn.weight`, `h.<N>.attn.c_proj.weight`, `h.<N>.mlp.c_fc.weight` or
/// `h.<N>.mlp.c_proj.weight`.
fn is_conv1d_weight(name: &str) -> bool {
    let p: Vec<&str> = name.split('.').collect();
    p.len() == 5
        && p[0] == "h"
        && is_index(p[1])
        && matches!(
            (p[2], p[3]),
            ("attn", "c_attn") | ("attn", "c_proj") | ("mlp", "c_fc") | ("mlp", "c_proj")
        )
        && p[4] == "weight"
}

fn is_index(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `name` (without prefix) is a causal-mask buffer: exactly `h.<N>.attn.bias` or
/// `h.<N>.attn.masked_bias`.
fn is_mask_buffer(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    parts.len() == 4
        && parts[0] == "h"
        && is_index(parts[1])
        && parts[2] == "attn"
        && (parts[3] == "bias" || parts[3] == "masked_bias")
}

/// The GELU form named by HF's `activation_function`.
fn gelu_from_hf(name: &str) -> Result<GeluKind> {
    match name {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(GeluKind::Tanh),
        "gelu" => Ok(GeluKind::Erf),
        other => meshgrad_tensor::bail!(
            "GPT-2 config: activation_function {other:?} is not supported (gelu_new, gelu_pytorch_tanh, gelu_fast or gelu)"
        ),
    }
}

/// The model's GELU form (that of its first block; the tanh form if it has none).
fn model_gelu(model: &Gpt) -> GeluKind {
    model
        .h
        .blocks()
        .first()
        .map(|b| b.mlp.gelu)
        .unwrap_or(GeluKind::Tanh)
}

/// Parses the text of a Hugging Face GPT-2 `config.json` into a [`GptConfig`] (with `bias`
/// true) and the GELU form of its MLPs.
///
/// Keys read: `vocab_size`, `n_positions` (or `n_ctx`), `n_embd`, `n_layer`, `n_head` (required);
/// `layer_norm_epsilon` (default 1e-5), `resid_pdrop` (the model's dropout, default 0.1 as in HF;
/// meshgrad uses one rate for embeddings and residuals), `activation_function` (default
/// `gelu_new`). Settings meshgrad cannot represent are errors: a `model_type` other than `gpt2`,
/// `n_inner` other than `4 * n_embd`, `tie_word_embeddings: false`, `scale_attn_weights: false`,
/// `scale_attn_by_inverse_layer_idx` or `reorder_and_upcast_attn` true.
pub fn gpt_config_from_hf_json(text: &str) -> Result<(GptConfig, GeluKind)> {
    let keys = ConfigKeys::parse(text, "GPT-2 config")?;
    let int = |k: &str| keys.int(k);
    let req = |k: &str| keys.req(k);
    let float = |k: &str, default: f64| keys.float(k, default);
    let flag = |k: &str| keys.flag(k);
    if let Some(mt) = keys.string("model_type") {
        if mt != "gpt2" {
            meshgrad_tensor::bail!("GPT-2 config: model_type is {mt:?}, expected \"gpt2\"");
        }
    }
    let block_size = match int("n_positions")? {
        Some(n) => n,
        None => int("n_ctx")?
            .ok_or_else(|| Error::Msg("GPT-2 config: missing key n_positions (or n_ctx)".into()))?,
    };
    let n_embd = req("n_embd")?;
    if let Some(inner) = int("n_inner")? {
        if inner != 4 * n_embd {
            meshgrad_tensor::bail!("GPT-2 config: n_inner {inner} is not supported (meshgrad's MLP is 4 * n_embd = {})", 4 * n_embd);
        }
    }
    if flag("tie_word_embeddings") == Some(false) {
        meshgrad_tensor::bail!("GPT-2 config: tie_word_embeddings false is not supported (meshgrad ties the head to wte)");
    }
    if flag("scale_attn_weights") == Some(false) {
        meshgrad_tensor::bail!("GPT-2 config: scale_attn_weights false is not supported");
    }
    for k in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if flag(k) == Some(true) {
            meshgrad_tensor::bail!("GPT-2 config: {k} true is not supported");
        }
    }
    let gelu = match keys.get("activation_function") {
        None | Some(Value::Null) => GeluKind::Tanh,
        Some(Value::String(s)) => gelu_from_hf(s)?,
        Some(x) => {
            meshgrad_tensor::bail!("GPT-2 config: activation_function must be a string, got {x}")
        }
    };
    let config = GptConfig {
        vocab_size: req("vocab_size")?,
        block_size,
        n_layer: req("n_layer")?,
        n_head: req("n_head")?,
        n_embd,
        dropout: float("resid_pdrop", 0.1)?,
        bias: true,
        layer_norm_eps: float("layer_norm_epsilon", 1e-5)?,
    };
    config.validate()?;
    Ok((config, gelu))
}

/// The Hugging Face `config.json` text describing `model` (a `GPT2LMHeadModel`).
pub fn hf_config_json(model: &Gpt) -> Result<String> {
    check_whole(model, "save_gpt2")?;
    let c = &model.config;
    let activation = match model_gelu(model) {
        GeluKind::Tanh => "gelu_new",
        GeluKind::Erf => "gelu",
    };
    // A whole model holds the token table.
    let Some(wte) = &model.wte else {
        meshgrad_tensor::bail!("save_gpt2: the model has no token table wte");
    };
    let torch_dtype = match wte.weight.tensor().dtype() {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => meshgrad_tensor::bail!(
            "save_gpt2: parameters of dtype {other} cannot form a GPT-2 checkpoint"
        ),
    };
    let v = json!({
        "activation_function": activation,
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "embd_pdrop": c.dropout,
        "initializer_range": 0.02,
        "layer_norm_epsilon": c.layer_norm_eps,
        "model_type": "gpt2",
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_head": c.n_head,
        "n_inner": null,
        "n_layer": c.n_layer,
        "n_positions": c.block_size,
        "resid_pdrop": c.dropout,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "torch_dtype": torch_dtype,
        "vocab_size": c.vocab_size,
    });
    serde_json::to_string_pretty(&v)
        .map_err(|e| Error::Msg(format!("save_gpt2: cannot format config.json: {e}")))
}

/// A Hugging Face folder holds the whole model: a one-line error for a stage.
fn check_whole(model: &Gpt, what: &str) -> Result<()> {
    if !model.is_full() {
        meshgrad_tensor::bail!(
            "{what}: this gpt is a stage ({}); a Hugging Face folder holds the whole model",
            model.spec
        );
    }
    Ok(())
}

fn read_config(dir: &Path) -> Result<(GptConfig, GeluKind)> {
    read_folder_config(dir, "load_gpt2", gpt_config_from_hf_json)
}

/// Builds a GPT from the Hugging Face GPT-2 checkpoint folder `dir` (`config.json` and
/// `model.safetensors`), with parameters of `dtype` on `device` (converted from the file's
/// dtype). Like HF's `from_pretrained`, the model is returned in eval mode (no dropout).
///
/// Every model parameter must be in the file and every file tensor must be a parameter, a mask
/// buffer or the tied head (see the module docs); errors name the file and the tensor, and
/// a wrong shape names both shapes.
pub fn load_gpt2(dir: impl AsRef<Path>, dtype: DType, device: Device) -> Result<Gpt> {
    let dir = dir.as_ref();
    let (config, gelu) = read_config(dir)?;
    let mut model = Gpt::new(config, 0, dtype, device)?;
    for b in model.h.blocks_mut() {
        match std::sync::Arc::get_mut(b) {
            Some(b) => b.mlp.gelu = gelu,
            None => meshgrad_tensor::bail!("load_gpt2: internal error: a new block is shared"),
        }
    }
    load_weights(&model, dir)?;
    model.set_training(false);
    Ok(model)
}

/// Loads the Hugging Face GPT-2 checkpoint folder `dir` into an existing `model` (in place),
/// after checking that its `config.json` describes the same architecture (sizes, layer-norm
/// epsilon, GELU form; dropout may differ). The model's training mode is left as it is.
pub fn load_gpt2_into(model: &Gpt, dir: impl AsRef<Path>) -> Result<()> {
    check_whole(model, "load_gpt2")?;
    let dir = dir.as_ref();
    let (c, gelu) = read_config(dir)?;
    let m = &model.config;
    let pairs = [
        ("vocab_size", c.vocab_size, m.vocab_size),
        ("n_positions", c.block_size, m.block_size),
        ("n_layer", c.n_layer, m.n_layer),
        ("n_head", c.n_head, m.n_head),
        ("n_embd", c.n_embd, m.n_embd),
    ];
    for (k, file, ours) in pairs {
        if file != ours {
            meshgrad_tensor::bail!(
                "load_gpt2: {}: {k} is {file} but the model has {ours}",
                dir.join(CONFIG_FILE).display()
            );
        }
    }
    if !m.bias {
        meshgrad_tensor::bail!(
            "load_gpt2: the model has no biases, but GPT-2 checkpoints always have them"
        );
    }
    if c.layer_norm_eps != m.layer_norm_eps {
        meshgrad_tensor::bail!(
            "load_gpt2: {}: layer_norm_epsilon is {} but the model has {}",
            dir.join(CONFIG_FILE).display(),
            c.layer_norm_eps,
            m.layer_norm_eps
        );
    }
    if gelu != model_gelu(model) {
        meshgrad_tensor::bail!(
            "load_gpt2: {}: activation is {gelu:?} GELU but the model uses {:?}",
            dir.join(CONFIG_FILE).display(),
            model_gelu(model)
        );
    }
    load_weights(model, dir)
}

/// Reads `dir/model.safetensors`, maps HF names and layouts to the model's, and copies the values.
fn load_weights(model: &Gpt, dir: &Path) -> Result<()> {
    let path = dir.join(WEIGHTS_FILE);
    let ctx = |e: Error| Error::Msg(format!("load_gpt2: {}: {e}", path.display()));
    let raw = load_safetensors(&path)?;
    // name without prefix -> (name in the file, tensor)
    let mut by_name: HashMap<String, (String, Tensor)> = HashMap::with_capacity(raw.len());
    let mut lm_head = None;
    for (file_name, t) in raw {
        let short = file_name
            .strip_prefix("transformer.")
            .unwrap_or(&file_name)
            .to_string();
        if is_mask_buffer(&short) {
            continue;
        }
        if short == "lm_head.weight" {
            lm_head = Some((file_name, t));
            continue;
        }
        if let Some((other, _)) = by_name.get(&short) {
            return Err(ctx(Error::Msg(format!(
                "tensor {short} appears twice (as {other} and as {file_name})"
            ))));
        }
        by_name.insert(short, (file_name, t));
    }
    let mut missing = Vec::new();
    let mut converted = Vec::new();
    for (name, p) in model.named_parameters() {
        let Some((file_name, t)) = by_name.remove(&name) else {
            missing.push(name);
            continue;
        };
        let dims = p.tensor().dims();
        let v = if is_conv1d_weight(&name) && dims.len() == 2 {
            check_shape(&file_name, t.dims(), &[dims[1], dims[0]])
                .map_err(|e| ctx(Error::Msg(format!("{e} (HF Conv1D layout [in, out])"))))?;
            t.t().and_then(|x| x.contiguous()).map_err(ctx)?
        } else {
            check_shape(&file_name, t.dims(), dims).map_err(ctx)?;
            t
        };
        converted.push((name, v));
    }
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(String::as_str).collect();
        return Err(ctx(Error::Msg(format!(
            "missing tensor {}",
            name_list(&names)
        ))));
    }
    if !by_name.is_empty() {
        let mut names: Vec<&str> = by_name.values().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        return Err(ctx(Error::Msg(format!(
            "unexpected tensor {} (not a GPT-2 parameter)",
            name_list(&names)
        ))));
    }
    if let Some((head_name, head)) = lm_head {
        let wte = converted
            .iter()
            .find(|(n, _)| n == "wte.weight")
            .map(|(_, t)| t);
        if let Some(wte) = wte {
            if !tensors_equal(&head, wte).map_err(ctx)? {
                return Err(ctx(Error::Msg(format!(
                    "{head_name} (shape {}) differs from wte.weight (shape {}); untied output heads are not supported",
                    head.shape(),
                    wte.shape()
                ))));
            }
        }
    }
    load_state_dict(model, &converted, true).map_err(ctx)
}

/// Writes `model` as a Hugging Face GPT-2 checkpoint folder `dir` (created if missing):
/// `model.safetensors` with HF names (no `transformer.` prefix, `Conv1D` weights transposed to
/// `[in, out]`, metadata `{"format": "pt"}`, no mask buffers, no `lm_head.weight`) and
/// `config.json` (see [`hf_config_json`]). Both files are written atomically. The model must have
/// biases (GPT-2 always has them).
pub fn save_gpt2(model: &Gpt, dir: impl AsRef<Path>) -> Result<()> {
    let dir = dir.as_ref();
    if !model.config.bias {
        meshgrad_tensor::bail!(
            "save_gpt2: the model has no biases, which a GPT-2 checkpoint cannot express"
        );
    }
    let config = hf_config_json(model)?;
    write_folder(dir, "save_gpt2", &config, || {
        let mut tensors = Vec::new();
        for (name, p) in model.named_parameters() {
            let t = p.tensor();
            let t = if is_conv1d_weight(&name) {
                t.t()?.contiguous()?
            } else {
                t.clone()
            };
            tensors.push((name, t));
        }
        Ok(tensors)
    })
}
