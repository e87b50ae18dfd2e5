//! Model state: parameter values by name ([`state_dict`], [`load_state_dict`]), safetensors files
//! ([`save_safetensors`], [`load_safetensors`]) and Hugging Face checkpoint folders: GPT-2
//! ([`load_gpt2`], [`save_gpt2`]), BERT ([`load_bert`], [`save_bert`]) and Llama
//! ([`load_llama`], [`save_llama`]).

pub mod hf_bert;
mod hf_folder;
pub mod hf_gpt2;
pub mod hf_llama;
pub mod hf_mixtral;
pub mod safetensors_io;

pub use hf_bert::{load_bert, save_bert};
pub use hf_gpt2::{gpt_config_from_hf_json, hf_config_json, load_gpt2, load_gpt2_into, save_gpt2};
pub use hf_llama::{
    llama_config_from_hf_json, llama_hf_config_json, load_llama, load_llama_into,
    read_llama_config, save_llama,
};
pub use safetensors_io::{
    from_safetensors_dtype, load_safetensors, load_safetensors_with_metadata, save_safetensors,
    to_safetensors_dtype, write_bytes_atomic, NamedTensors,
};

use std::collections::{HashMap, HashSet};

use meshgrad_autograd::{no_grad, Var};
use meshgrad_tensor::{Error, Result, Tensor};

use crate::module::Module;

/// Every parameter's value by name, in the module's parameter order. The tensors share storage
/// with the live parameters (serialise them, or `deep_clone` them to keep a snapshot).
pub fn state_dict<M: Module + ?Sized>(module: &M) -> Vec<(String, Tensor)> {
    module
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.tensor().clone()))
        .collect()
}

/// Copies `tensors` into `module`'s parameters of the same names, in place (converting dtype and
/// device to the parameter's).
///
/// Every tensor's shape must equal its parameter's (the error names the tensor and both shapes).
/// With `strict`, every parameter must be present and every tensor must name a parameter; without
/// it, missing parameters keep their values and unknown tensors are ignored. Everything is
/// checked and converted before the first copy, so on error the module is unchanged.
pub fn load_state_dict<M: Module + ?Sized>(
    module: &M,
    tensors: &[(String, Tensor)],
    strict: bool,
) -> Result<()> {
    let params = module.named_parameters();
    let mut map: HashMap<&str, &Tensor> = HashMap::with_capacity(tensors.len());
    for (n, t) in tensors {
        if map.insert(n.as_str(), t).is_some() {
            meshgrad_tensor::bail!("load_state_dict: tensor {n} appears twice in the state dict");
        }
    }
    let mut missing = Vec::new();
    let mut plan: Vec<(&Var, Tensor)> = Vec::with_capacity(params.len());
    for (name, p) in &params {
        let Some(&t) = map.get(name.as_str()) else {
            missing.push(name.as_str());
            continue;
        };
        check_shape(name, t.dims(), p.tensor().dims())?;
        let pt = p.tensor();
        let v = t
            .to_device(pt.device())
            .and_then(|t| t.to_dtype(pt.dtype()))
            .map_err(|e| Error::Msg(format!("load_state_dict: {name}: {e}")))?;
        plan.push((p, v));
    }
    if strict {
        if !missing.is_empty() {
            meshgrad_tensor::bail!(
                "load_state_dict: the state dict is missing {}",
                name_list(&missing)
            );
        }
        let known: HashSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        let mut unexpected: Vec<&str> =
            map.keys().copied().filter(|k| !known.contains(k)).collect();
        if !unexpected.is_empty() {
            unexpected.sort_unstable();
            meshgrad_tensor::bail!(
                "load_state_dict: the model has no parameter named {}",
                name_list(&unexpected)
            );
        }
    }
    no_grad(|| {
        for (p, v) in plan {
            p.tensor().copy_from(&v)?;
        }
        Ok(())
    })
}

/// The error for a tensor whose shape differs from what the model expects.
pub(crate) fn check_shape(name: &str, file: &[usize], model: &[usize]) -> Result<()> {
    if file != model {
        meshgrad_tensor::bail!(
            "{name}: checkpoint has shape {file:?} but the model expects {model:?}"
        );
    }
    Ok(())
}

/// `a, b, c` for up to 10 names, then `and N more` (for error messages that list names).
pub fn name_list(names: &[&str]) -> String {
    const SHOWN: usize = 10;
    let mut s = names
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        s.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    s
}
