//! Hugging Face `MixtralForCausalLM` checkpoint folders: a Llama whose feed-forwards are
//! mixtures of experts ([`crate::moe::SparseMoe`]). The folder is read and written by
//! [`crate::state::hf_llama`] (the same names, layouts and checks); this file holds what
//! Mixtral adds: `config.json`'s `"model_type": "mixtral"` and its keys `num_local_experts`,
//! `num_experts_per_tok`, `router_aux_loss_coef` (default 0.001, transformers'), and the layers'
//! `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w{1,2,3}.weight` in place of
//! `mlp.*`. Refused with one line: a `sliding_window` shorter than the context (meshgrad's
//! attention sees the whole causal context) and `router_jitter_noise` other than 0.
//!
//! A `config.json` without `num_key_value_heads`, `rms_norm_eps` or `rope_theta` gets
//! `MixtralConfig`'s defaults (`DEFAULTS` below), not Llama's. Besides the classic layout above (what
//! transformers 4 and 5 write by default), folders in transformers 5's fused layout are read
//! (`save_pretrained(..., save_original_format=False)`): `model.layers.{i}.mlp.gate.weight`,
//! `mlp.experts.gate_up_proj` `[E, 2 * I, H]` (each expert's `w1` then `w3`) and
//! `mlp.experts.down_proj` `[E, H, I]` (each expert's `w2`). meshgrad writes the classic layout.

use std::path::Path;

use meshgrad_tensor::{DType, Device, Result, Tensor};
use serde_json::{json, Value};

use super::hf_folder::ConfigKeys;
use super::hf_llama::Defaults;
use crate::llama::{Llama, LlamaConfig};
use crate::moe::MoeSettings;

/// The `model_type` of a Mixtral folder.
pub const MODEL_TYPE: &str = "mixtral";

const WHAT: &str = "Mixtral config";

/// transformers' `MixtralConfig` defaults for keys a `config.json` may leave out: 8 kv heads,
/// `rms_norm_eps` 1e-5, `rope_theta` 1e6 (Llama's are the query heads, 1e-6 and 1e4).
pub(crate) const DEFAULTS: Defaults = Defaults {
    n_kv_head: Some(8),
    norm_eps: 1e-5,
    rope_theta: 1e6,
};

/// The mixture-of-experts settings of a Mixtral `config.json` (whose context is `n_positions`).
pub(crate) fn moe_from_keys(keys: &ConfigKeys, n_positions: usize) -> Result<MoeSettings> {
    if let Some(w) = keys.int("sliding_window")? {
        if w < n_positions {
            meshgrad_tensor::bail!(
                "{WHAT}: sliding_window {w} is shorter than max_position_embeddings \
                 {n_positions} (meshgrad's attention sees the whole causal context)"
            );
        }
    }
    let jitter = keys.float("router_jitter_noise", 0.0)?;
    if jitter != 0.0 {
        meshgrad_tensor::bail!("{WHAT}: router_jitter_noise {jitter} is not supported (only 0)");
    }
    let moe = MoeSettings {
        n_experts: keys.req("num_local_experts")?,
        experts_per_token: keys.req("num_experts_per_tok")?,
        router_aux_loss_coef: keys.float("router_aux_loss_coef", 0.001)?,
        capacity_factor: None,
    };
    moe.validate()
        .map_err(|e| meshgrad_tensor::Error::msg(format!("{WHAT}: {e}")))?;
    Ok(moe)
}

/// Mixtral's keys added to (or replacing) a Llama `config.json` object.
pub(crate) fn add_keys(v: &mut Value, moe: &MoeSettings) {
    let extra = json!({
        "architectures": ["MixtralForCausalLM"],
        "model_type": MODEL_TYPE,
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "router_aux_loss_coef": moe.router_aux_loss_coef,
        "output_router_logits": false,
        "router_jitter_noise": 0.0,
        "sliding_window": null,
    });
    if let (Some(obj), Value::Object(add)) = (v.as_object_mut(), extra) {
        for key in ["mlp_bias", "attention_bias"] {
            obj.remove(key);
        }
        obj.extend(add);
    }
}

/// The parameter names of layer `i`'s mixture of experts.
pub(crate) fn layer_names(i: usize, moe: &MoeSettings) -> Vec<String> {
    let mut names = vec![format!("model.layers.{i}.block_sparse_moe.gate.weight")];
    for e in 0..moe.n_experts {
        for w in ["w1", "w2", "w3"] {
            names.push(format!(
                "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
            ));
        }
    }
    names
}

/// The folder's tensors with transformers 5's fused expert tensors (see the [module
/// docs](self)) split into the classic names; other tensors, and every tensor of a model without
/// experts (`moe` `None`), pass unchanged. A fused tensor that is not `[n_experts, _, _]` (with
/// an even middle size for `gate_up_proj`) is an error naming it; the split tensors' shapes are
/// checked with the others'.
pub(crate) fn unfuse_experts(
    tensors: Vec<(String, Tensor)>,
    moe: Option<&MoeSettings>,
) -> Result<Vec<(String, Tensor)>> {
    let Some(moe) = moe else {
        return Ok(tensors);
    };
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let Some((layer, leaf)) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once(".mlp."))
            .filter(|(i, _)| i.parse::<usize>().is_ok())
        else {
            out.push((name, t));
            continue;
        };
        let prefix = format!("model.layers.{layer}.block_sparse_moe");
        let fused = |middle_even: bool| -> Result<()> {
            let d = t.dims();
            if d.len() != 3 || d[0] != moe.n_experts || (middle_even && d[1] % 2 != 0) {
                meshgrad_tensor::bail!(
                    "tensor {name} has shape {:?}, expected [{}, {}, _] (experts fused)",
                    d,
                    moe.n_experts,
                    if middle_even {
                        "2 * intermediate_size"
                    } else {
                        "hidden_size"
                    }
                );
            }
            Ok(())
        };
        let expert = |e: usize| -> Result<Tensor> { t.narrow(0, e, 1)?.squeeze(0) };
        match leaf {
            "gate.weight" => out.push((format!("{prefix}.gate.weight"), t)),
            "experts.gate_up_proj" => {
                fused(true)?;
                let i = t.dims()[1] / 2;
                for e in 0..moe.n_experts {
                    let w = expert(e)?;
                    for (k, start) in [("w1", 0), ("w3", i)] {
                        let part = w.narrow(0, start, i)?.contiguous()?;
                        out.push((format!("{prefix}.experts.{e}.{k}.weight"), part));
                    }
                }
            }
            "experts.down_proj" => {
                fused(false)?;
                for e in 0..moe.n_experts {
                    let w2 = expert(e)?.contiguous()?;
                    out.push((format!("{prefix}.experts.{e}.w2.weight"), w2));
                }
            }
            _ => out.push((name, t)),
        }
    }
    Ok(out)
}

/// Whether `dir` holds a Mixtral checkpoint (its `config.json` says `"model_type": "mixtral"`).
pub fn is_mixtral_folder(dir: impl AsRef<Path>) -> bool {
    super::hf_folder::model_type(dir.as_ref()).as_deref() == Some(MODEL_TYPE)
}

/// Builds the whole Mixtral (a [`Llama`] with `config.moe` set) of the folder `dir`; see
/// [`crate::state::hf_llama::load_llama`].
pub fn load_mixtral(dir: impl AsRef<Path>, dtype: DType, device: Device) -> Result<Llama> {
    let model = super::hf_llama::load_llama(dir.as_ref(), dtype, device)?;
    if model.config.moe.is_none() {
        meshgrad_tensor::bail!(
            "load_mixtral: {} holds a Llama, not a Mixtral",
            dir.as_ref().display()
        );
    }
    Ok(model)
}

/// Writes the whole Mixtral `model` as a `MixtralForCausalLM` folder; see
/// [`crate::state::hf_llama::save_llama`].
pub fn save_mixtral(model: &Llama, dir: impl AsRef<Path>) -> Result<()> {
    if model.config.moe.is_none() {
        meshgrad_tensor::bail!("save_mixtral: the model is a Llama without experts");
    }
    super::hf_llama::save_llama(model, dir)
}

/// The [`LlamaConfig`] of a Mixtral `config.json` text.
pub fn mixtral_config_from_hf_json(text: &str) -> Result<LlamaConfig> {
    let c = super::hf_llama::llama_config_from_hf_json(text)?;
    if c.moe.is_none() {
        meshgrad_tensor::bail!("{WHAT}: model_type is not \"mixtral\"");
    }
    Ok(c)
}
