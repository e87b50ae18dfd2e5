//! Reading and writing `.safetensors` files, and atomic file writes.
//!
//! Dtypes map both ways: F64, F32, BF16, F16, U8, U32 and I64 (meshgrad's dtypes). A file tensor
//! of any other dtype is an error naming the file, the tensor and the dtype. Data is
//! little-endian, as the format requires (every platform meshgrad targets is little-endian).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};
use safetensors::{Dtype, SafeTensors, View};

/// Tensors with their names, as files and state dicts hold them.
pub type NamedTensors = Vec<(String, Tensor)>;

/// A tensor's bytes prepared for serialisation.
struct CpuView {
    dtype: Dtype,
    shape: Vec<usize>,
    storage: CpuStorage,
}

impl View for &CpuView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.storage.as_bytes())
    }
    fn data_len(&self) -> usize {
        self.storage.as_bytes().len()
    }
}

/// The safetensors dtype of a meshgrad dtype.
pub fn to_safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::U8 => Dtype::U8,
        DType::U32 => Dtype::U32,
        DType::I64 => Dtype::I64,
    }
}

/// The meshgrad dtype of a safetensors dtype, if meshgrad has one.
pub fn from_safetensors_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

/// Writes `tensors` (names must be unique) to the safetensors file `path`, with optional
/// string metadata (the `__metadata__` header; Hugging Face tools expect `{"format": "pt"}`).
///
/// The write is atomic: the data goes to a temporary file in the same directory, is flushed to
/// disk (fsync) and then renamed over `path`, so `path` holds either its old contents or the
/// complete new file, never a partial one. Errors name the file.
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    let mut seen = HashSet::new();
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            meshgrad_tensor::bail!(
                "save_safetensors {}: tensor name {name} appears twice",
                path.display()
            );
        }
        let storage = t.to_cpu_storage().map_err(|e| {
            Error::Msg(format!(
                "save_safetensors {}: tensor {name}: {e}",
                path.display()
            ))
        })?;
        views.push((
            name.clone(),
            CpuView {
                dtype: to_safetensors_dtype(t.dtype()),
                shape: t.dims().to_vec(),
                storage,
            },
        ));
    }
    write_atomic_with(path, "save_safetensors", |tmp| {
        safetensors::serialize_to_file(views.iter().map(|(n, v)| (n.as_str(), v)), &metadata, tmp)
            .map_err(|e| e.to_string())
    })
}

/// Reads every tensor of the safetensors file `path`, sorted by name, as CPU tensors of the file's
/// dtypes. Errors name the file (and the tensor, for an unsupported dtype).
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    Ok(load_safetensors_with_metadata(path)?.0)
}

/// As [`load_safetensors`], also returning the file's `__metadata__` strings, if any.
pub fn load_safetensors_with_metadata(
    path: impl AsRef<Path>,
) -> Result<(NamedTensors, Option<HashMap<String, String>>)> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| {
        Error::Msg(format!(
            "load_safetensors: cannot read {}: {e}",
            path.display()
        ))
    })?;
    let bad = |e: safetensors::SafeTensorError| {
        Error::Msg(format!(
            "load_safetensors: {} is not a valid safetensors file: {e}",
            path.display()
        ))
    };
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(bad)?;
    let st = SafeTensors::deserialize(&bytes).map_err(bad)?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        let Some(dtype) = from_safetensors_dtype(view.dtype()) else {
            meshgrad_tensor::bail!(
                "load_safetensors: {}: tensor {name} has dtype {:?}, which meshgrad does not support (supported: F64, F32, BF16, F16, U8, U32, I64)",
                path.display(),
                view.dtype()
            );
        };
        let data = view.data();
        if data.len() % dtype.size_in_bytes() != 0 {
            meshgrad_tensor::bail!("load_safetensors: {}: tensor {name} has {} bytes, not a whole number of {dtype} elements", path.display(), data.len());
        }
        let storage = match dtype {
            DType::F64 => CpuStorage::F64(pod_vec::<f64>(data)),
            DType::F32 => CpuStorage::F32(pod_vec::<f32>(data)),
            DType::BF16 => CpuStorage::BF16(pod_vec::<bf16>(data)),
            DType::F16 => CpuStorage::F16(pod_vec::<f16>(data)),
            DType::U8 => CpuStorage::U8(data.to_vec()),
            DType::U32 => CpuStorage::U32(pod_vec::<u32>(data)),
            DType::I64 => CpuStorage::I64(pod_vec::<i64>(data)),
        };
        let t = Tensor::from_cpu(storage, view.shape().to_vec(), Device::Cpu).map_err(|e| {
            Error::Msg(format!(
                "load_safetensors: {}: tensor {name}: {e}",
                path.display()
            ))
        })?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((out, meta.metadata().clone()))
}

/// The elements of little-endian `bytes` (a whole number of `T`s), copied into an aligned vector.
fn pod_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

/// Writes `bytes` to `path` atomically (temporary file in the same directory, fsync, rename).
pub fn write_bytes_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path.as_ref(), "write", |tmp| {
        std::fs::write(tmp, bytes).map_err(|e| e.to_string())
    })
}

/// Runs `write` on a fresh temporary path next to `path`, fsyncs the result and renames it over
/// `path`. On any failure the temporary file is removed and `path` is left untouched; the error
/// (prefixed by `op`) names `path`.
pub(crate) fn write_atomic_with(
    path: &Path,
    op: &str,
    write: impl FnOnce(&Path) -> std::result::Result<(), String>,
) -> Result<()> {
    let fail = |why: String| Error::Msg(format!("{op}: cannot write {}: {why}", path.display()));
    if path.file_name().is_none() {
        return Err(fail("the path has no file name".into()));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = temp_beside(path);
    let result = (|| -> std::result::Result<(), String> {
        write(&tmp)?;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .map_err(|e| e.to_string())?;
        f.sync_all().map_err(|e| format!("fsync failed: {e}"))?;
        drop(f);
        std::fs::rename(&tmp, path)
            .map_err(|e| format!("renaming the temporary file into place failed: {e}"))
    })();
    if let Err(why) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(why));
    }
    // Make the rename itself durable (best effort: not every platform can open a directory).
    #[cfg(unix)]
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A fresh temporary path beside `path`: `.NAME.tmp-PID-N`, the pattern a run's start removes when
/// a killed process left one.
pub(crate) fn temp_beside(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}
