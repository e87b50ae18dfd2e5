//! Reading single tensors out of a rank's safetensors file without reading the rest of it: the
//! header is parsed once, then each tensor's bytes are read from their offset.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use half::{bf16, f16};
use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

/// The largest header accepted (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// A tensor of a rank file: its dtype, shape and bytes within the data section.
pub(crate) struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    start: u64,
    end: u64,
}

/// One open rank file.
pub(crate) struct RankFile {
    path: PathBuf,
    file: Mutex<File>,
    data_start: u64,
    entries: HashMap<String, Entry>,
}

fn dtype_of(s: &str) -> Option<DType> {
    Some(match s {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        "U8" => DType::U8,
        "U32" => DType::U32,
        "I64" => DType::I64,
        _ => return None,
    })
}

impl RankFile {
    /// Opens `path` and parses its header.
    pub(crate) fn open(path: &Path) -> Result<RankFile> {
        let bad = |why: String| Error::msg(format!("checkpoint file {}: {why}", path.display()));
        let mut file = File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| bad(format!("cannot stat: {e}")))?
            .len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|e| bad(format!("cannot read the header size: {e}")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || 8 + n > len {
            return Err(bad(format!(
                "header of {n} bytes does not fit the file's {len} (truncated or not safetensors)"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| bad(format!("cannot read the header: {e}")))?;
        let header: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("the header is not valid JSON: {e}")))?;
        let obj = header
            .as_object()
            .ok_or_else(|| bad("the header is not a JSON object".into()))?;
        let data_start = 8 + n;
        let mut entries = HashMap::new();
        for (name, v) in obj {
            if name == "__metadata__" {
                continue;
            }
            let dtype = v["dtype"].as_str().and_then(dtype_of).ok_or_else(|| {
                bad(format!(
                    "tensor {name} has an unsupported dtype {}",
                    v["dtype"]
                ))
            })?;
            let shape: Vec<usize> = serde_json::from_value(v["shape"].clone())
                .map_err(|e| bad(format!("tensor {name}: bad shape: {e}")))?;
            let [start, end]: [u64; 2] = serde_json::from_value(v["data_offsets"].clone())
                .map_err(|e| bad(format!("tensor {name}: bad data offsets: {e}")))?;
            let bytes = shape
                .iter()
                .try_fold(dtype.size_in_bytes() as u64, |a, &d| {
                    a.checked_mul(d as u64)
                })
                .ok_or_else(|| bad(format!("tensor {name}: shape {shape:?} is too large")))?;
            if end < start || end - start != bytes || data_start.saturating_add(end) > len {
                return Err(bad(format!(
                    "tensor {name}: data offsets {start}..{end} do not hold its {bytes} bytes \
                     within the file (truncated?)"
                )));
            }
            entries.insert(
                name.clone(),
                Entry {
                    dtype,
                    shape,
                    start,
                    end,
                },
            );
        }
        Ok(RankFile {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            data_start,
            entries,
        })
    }

    /// The entry of the tensor stored under `key`, checked to have `dtype` and `numel`
    /// elements (what the index says of it), or a one-line error naming the file and the key.
    pub(crate) fn entry(&self, key: &str, dtype: DType, numel: usize) -> Result<&Entry> {
        let bad = |why: String| {
            Error::msg(format!(
                "checkpoint file {}: tensor {key}: {why}",
                self.path.display()
            ))
        };
        let e = self
            .entries
            .get(key)
            .ok_or_else(|| bad("not in the file (the index and the file disagree)".into()))?;
        let n: usize = e.shape.iter().product();
        if e.dtype != dtype || n != numel {
            return Err(bad(format!(
                "the file has {} x {n} elements, the index says {dtype} x {numel}",
                e.dtype
            )));
        }
        Ok(e)
    }

    /// The tensor stored under `key`, checked to have `dtype` and `numel` elements, as a CPU
    /// tensor of its stored shape.
    pub(crate) fn read(&self, key: &str, dtype: DType, numel: usize) -> Result<Tensor> {
        let bad = |why: String| {
            Error::msg(format!(
                "checkpoint file {}: tensor {key}: {why}",
                self.path.display()
            ))
        };
        let e = self.entry(key, dtype, numel)?;
        let mut bytes = vec![0u8; (e.end - e.start) as usize];
        {
            let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
            f.seek(SeekFrom::Start(self.data_start + e.start))
                .and_then(|_| f.read_exact(&mut bytes))
                .map_err(|err| bad(format!("cannot read: {err}")))?;
        }
        let storage = match dtype {
            DType::F64 => CpuStorage::F64(pod_vec::<f64>(&bytes)),
            DType::F32 => CpuStorage::F32(pod_vec::<f32>(&bytes)),
            DType::BF16 => CpuStorage::BF16(pod_vec::<bf16>(&bytes)),
            DType::F16 => CpuStorage::F16(pod_vec::<f16>(&bytes)),
            DType::U8 => CpuStorage::U8(bytes),
            DType::U32 => CpuStorage::U32(pod_vec::<u32>(&bytes)),
            DType::I64 => CpuStorage::I64(pod_vec::<i64>(&bytes)),
        };
        Tensor::from_cpu(storage, e.shape.clone(), Device::Cpu).map_err(|err| bad(err.to_string()))
    }
}

/// The elements of little-endian `bytes` (a whole number of `T`s), copied into an aligned vector.
fn pod_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}
