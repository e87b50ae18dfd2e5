//! What the Hugging Face checkpoint folders of [`super::hf_gpt2`], [`super::hf_bert`] and
//! [`super::hf_llama`] share: the file names, reading the keys of a `config.json`, reading a
//! folder's config and weights (one file or shards) and writing a folder.

use std::collections::HashMap;
use std::path::Path;

use meshgrad_tensor::{Error, Result, Tensor};
use serde_json::{Map, Value};

use super::safetensors_io::write_atomic_with;
use super::save_safetensors;

pub(crate) const CONFIG_FILE: &str = "config.json";
pub(crate) const WEIGHTS_FILE: &str = "model.safetensors";
pub(crate) const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// The object of a `config.json`; errors begin with `what` (`"GPT-2 config"`).
pub(crate) struct ConfigKeys {
    obj: Map<String, Value>,
    what: &'static str,
}

impl ConfigKeys {
    /// Parses `text`, which must be a JSON object.
    pub(crate) fn parse(text: &str, what: &'static str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::Msg(format!("{what}: invalid JSON: {e}")))?;
        let Value::Object(obj) = v else {
            meshgrad_tensor::bail!("{what}: expected a JSON object");
        };
        Ok(Self { obj, what })
    }

    pub(crate) fn get(&self, k: &str) -> Option<&Value> {
        self.obj.get(k)
    }

    /// A non-negative integer, `None` when absent or null.
    pub(crate) fn int(&self, k: &str) -> Result<Option<usize>> {
        match self.obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => match x.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                None => meshgrad_tensor::bail!(
                    "{}: {k} must be a non-negative integer, got {x}",
                    self.what
                ),
            },
        }
    }

    /// A non-negative integer that must be there.
    pub(crate) fn req(&self, k: &str) -> Result<usize> {
        self.int(k)?
            .ok_or_else(|| Error::Msg(format!("{}: missing key {k}", self.what)))
    }

    /// A number, `default` when absent or null.
    pub(crate) fn float(&self, k: &str, default: f64) -> Result<f64> {
        match self.obj.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_f64()
                .ok_or_else(|| Error::Msg(format!("{}: {k} must be a number, got {x}", self.what))),
        }
    }

    /// A string, if the key holds one.
    pub(crate) fn string(&self, k: &str) -> Option<&str> {
        self.obj.get(k).and_then(Value::as_str)
    }

    /// A boolean, if the key holds one.
    pub(crate) fn flag(&self, k: &str) -> Option<bool> {
        self.obj.get(k).and_then(Value::as_bool)
    }
}

/// Reads `dir/config.json` and parses it with `parse`; errors begin with `op` (`"load_gpt2"`) and
/// name the file.
pub(crate) fn read_config<T>(
    dir: &Path,
    op: &str,
    parse: impl FnOnce(&str) -> Result<T>,
) -> Result<T> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::Msg(format!("{op}: cannot read {}: {e}", path.display())))?;
    parse(&text).map_err(|e| Error::Msg(format!("{op}: {}: {e}", path.display())))
}

/// The tensors of the folder `dir`: `model.safetensors`, or else the shards that
/// `model.safetensors.index.json` lists in its `weight_map` (each shard read once, every tensor
/// checked to be in the shard the map names). Errors begin with `op` and name the file.
pub(crate) fn read_weights(dir: &Path, op: &str) -> Result<Vec<(String, Tensor)>> {
    let single = dir.join(WEIGHTS_FILE);
    let index = dir.join(WEIGHTS_INDEX_FILE);
    if single.exists() || !index.exists() {
        return super::load_safetensors(&single)
            .map_err(|e| Error::Msg(format!("{op}: {}: {e}", single.display())));
    }
    let ctx = |e: String| Error::Msg(format!("{op}: {}: {e}", index.display()));
    let text = std::fs::read_to_string(&index).map_err(|e| ctx(e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| ctx(format!("invalid JSON: {e}")))?;
    let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
        return Err(ctx("missing the object weight_map".into()));
    };
    let mut shards: Vec<&str> = Vec::new();
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            return Err(ctx(format!(
                "weight_map[{name}] must be a file name, got {file}"
            )));
        };
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(ctx(format!(
                "weight_map[{name}] names {file:?}, not a file of the folder"
            )));
        }
        if !shards.contains(&file) {
            shards.push(file);
        }
    }
    let mut out = Vec::with_capacity(map.len());
    for file in shards {
        let path = dir.join(file);
        for (name, t) in super::load_safetensors(&path)
            .map_err(|e| Error::Msg(format!("{op}: {}: {e}", path.display())))?
        {
            if map.get(&name).and_then(Value::as_str) != Some(file) {
                return Err(ctx(format!(
                    "{file} holds tensor {name}, which the weight_map does not place there"
                )));
            }
            out.push((name, t));
        }
    }
    if out.len() != map.len() {
        return Err(ctx(format!(
            "the weight_map lists {} tensors but its shards hold {}",
            map.len(),
            out.len()
        )));
    }
    Ok(out)
}

/// Writes the checkpoint folder `dir` (created if missing): `model.safetensors` holding `tensors`
/// (metadata `{"format": "pt"}`), then `config.json` holding `config`, both atomically. Errors
/// begin with `op` (`"save_gpt2"`).
pub(crate) fn write_folder(
    dir: &Path,
    op: &str,
    config: &str,
    tensors: impl FnOnce() -> Result<Vec<(String, Tensor)>>,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Msg(format!("{op}: cannot create {}: {e}", dir.display())))?;
    let tensors = tensors()?;
    // Never a mix of two saves: an old config goes first and the new one is written last, so a
    // save killed half-way leaves a folder without config.json (which no loader takes for a
    // model) rather than new weights beside an old config.
    let config_path = dir.join(CONFIG_FILE);
    if config_path.exists() {
        std::fs::remove_file(&config_path).map_err(|e| {
            Error::Msg(format!(
                "{op}: cannot replace {}: {e}",
                config_path.display()
            ))
        })?;
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(dir.join(WEIGHTS_FILE), &tensors, Some(meta))?;
    write_atomic_with(&dir.join(CONFIG_FILE), op, |tmp| {
        std::fs::write(tmp, config.as_bytes()).map_err(|e| e.to_string())
    })
}

/// Whether two tensors have the same shape and values (compared as f64, in chunks of rows).
pub(crate) fn tensors_equal(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    if a.rank() == 0 || a.elem_count() == 0 {
        return Ok(a.to_vec_f64()? == b.to_vec_f64()?);
    }
    let rows = a.dims()[0];
    let per_row = (a.elem_count() / rows).max(1);
    let chunk = (1 << 20) / per_row + 1;
    let mut start = 0;
    while start < rows {
        let len = chunk.min(rows - start);
        if a.narrow(0, start, len)?.to_vec_f64()? != b.narrow(0, start, len)?.to_vec_f64()? {
            return Ok(false);
        }
        start += len;
    }
    Ok(true)
}
