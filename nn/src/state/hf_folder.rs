//! What the Hugging Face checkpoint folders of [`super::hf_gpt2`], [`super::hf_bert`] and
//! [`super::hf_llama`] share: the file names, reading the keys of a `config.json`, reading a
//! folder's config and weights (one file or shards) and writing a folder.

use std::collections::HashMap;
use std::path::Path;

use meshgrad_tensor::{Error, Result, Tensor};
use serde_json::{Map, Value};

use super::safetensors_io::{temp_beside, write_atomic_with};
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

/// The `model_type` a checkpoint folder's `config.json` names (`"gpt2"`, `"bert"`, `"llama"`), or
/// `None` when it has no readable config or names none.
pub(crate) fn model_type(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(CONFIG_FILE)).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("model_type")?.as_str().map(str::to_string)
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
/// (metadata `{"format": "pt"}`) and `config.json` holding `config`. Errors begin with `op`
/// (`"save_gpt2"`).
///
/// Both files are written completely as temporary files beside their places first; a failure
/// there (a full disk, say) removes them and leaves a model already in `dir` exactly as it was,
/// still loadable. Only then do they replace the old files: the old config goes first and the
/// new one comes last, so even a process killed between the renames leaves a folder without
/// `config.json` (which no loader takes for a model), never new weights beside an old config.
pub(crate) fn write_folder(
    dir: &Path,
    op: &str,
    config: &str,
    tensors: impl FnOnce() -> Result<Vec<(String, Tensor)>>,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Msg(format!("{op}: cannot create {}: {e}", dir.display())))?;
    let tensors = tensors()?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let config_path = dir.join(CONFIG_FILE);
    let weights_tmp = temp_beside(&weights_path);
    let config_tmp = temp_beside(&config_path);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let written = save_safetensors(&weights_tmp, &tensors, Some(meta)).and_then(|_| {
        write_atomic_with(&config_tmp, op, |tmp| {
            std::fs::write(tmp, config.as_bytes()).map_err(|e| e.to_string())
        })
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&weights_tmp);
        let _ = std::fs::remove_file(&config_tmp);
        return Err(e);
    }
    let replace = || -> std::io::Result<()> {
        match std::fs::remove_file(&config_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::rename(&weights_tmp, &weights_path)?;
        std::fs::rename(&config_tmp, &config_path)?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    };
    replace().map_err(|e| {
        let _ = std::fs::remove_file(&weights_tmp);
        let _ = std::fs::remove_file(&config_tmp);
        Error::Msg(format!(
            "{op}: cannot move the new files into {}: {e}",
            dir.display()
        ))
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

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_tensor::Device;

    #[test]
    fn a_failed_write_leaves_the_previous_folder_as_it_was() {
        let dir = std::env::temp_dir().join(format!("meshgrad-hf-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let t = |v: f32| Tensor::from_vec(vec![v; 4], (2, 2), Device::Cpu).unwrap();
        write_folder(&dir, "test", "{\"v\": 1}", || {
            Ok(vec![("w".into(), t(1.0))])
        })
        .unwrap();
        let before: Vec<Vec<u8>> = [CONFIG_FILE, WEIGHTS_FILE]
            .iter()
            .map(|f| std::fs::read(dir.join(f)).unwrap())
            .collect();
        // The new weights cannot be written (a name twice): nothing of the old folder goes.
        let e = write_folder(&dir, "test", "{\"v\": 2}", || {
            Ok(vec![("w".into(), t(2.0)), ("w".into(), t(3.0))])
        })
        .unwrap_err();
        assert!(e.to_string().contains("appears twice"), "{e}");
        let after: Vec<Vec<u8>> = [CONFIG_FILE, WEIGHTS_FILE]
            .iter()
            .map(|f| std::fs::read(dir.join(f)).unwrap())
            .collect();
        assert_eq!(before, after);
        // No temporary file is left behind.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // A good write replaces both.
        write_folder(&dir, "test", "{\"v\": 3}", || {
            Ok(vec![("w".into(), t(3.0))])
        })
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap(),
            "{\"v\": 3}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
