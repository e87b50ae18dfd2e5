//! The CPU backend's memory methods: allocation, host transfers (the host is this device),
//! fills, random draws and `arange`.

use half::{bf16, f16};
use meshgrad_kernels::rng;

use crate::backend::Distribution;
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

/// The buffer as a contiguous `[len]` view.
fn whole(s: &CpuStorage) -> Layout {
    Layout::contiguous(s.len())
}

/// A zero-filled buffer.
pub(crate) fn zeros(_device: Device, dtype: DType, len: usize) -> Result<CpuStorage> {
    Ok(CpuStorage::zeros(dtype, len))
}

/// A buffer for an output the caller overwrites: recycled f32 memory (see `crate::pool`), zeros for other dtypes.
pub(crate) fn output(_device: Device, dtype: DType, len: usize) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(crate::pool::output(len)),
        _ => CpuStorage::zeros(dtype, len),
    })
}

/// `n` copies of `value` in `dtype`.
pub(crate) fn full(_device: Device, value: f64, dtype: DType, n: usize) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F64 => CpuStorage::F64(vec![value; n]),
        DType::F32 => CpuStorage::F32(vec![value as f32; n]),
        DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(value); n]),
        DType::F16 => CpuStorage::F16(vec![f16::from_f64(value); n]),
        DType::U8 => CpuStorage::U8(vec![value as u8; n]),
        DType::U32 => CpuStorage::U32(vec![value as u32; n]),
        DType::I64 => CpuStorage::I64(vec![value as i64; n]),
    })
}

/// The host buffer itself.
pub(crate) fn from_host(_device: Device, host: CpuStorage) -> Result<CpuStorage> {
    Ok(host)
}

/// The contiguous view `l` of `s` as its own buffer.
pub(crate) fn to_host(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    match l.contiguous_range() {
        Some(r) if r.start == 0 && r.end == s.len() => Ok(s.clone()),
        Some(r) => Ok(crate::cpu_map!(s, v => crate::WithDType::into_cpu_storage(v[r].to_vec()))),
        None => super::copy_contiguous(s, l),
    }
}

/// The elements at the flat `indices`.
pub(crate) fn read_elements(s: &CpuStorage, indices: &[usize]) -> Result<CpuStorage> {
    Ok(crate::cpu_map!(s, v => crate::WithDType::into_cpu_storage(
        indices.iter().map(|&i| v[i]).collect()
    )))
}

/// `n` draws of `dist` (see `BackendStorage::random`).
pub(crate) fn random(
    _device: Device,
    dtype: DType,
    n: usize,
    seed: u64,
    offset: u64,
    dist: Distribution,
) -> Result<CpuStorage> {
    // f32 fills directly (the f64 -> f32 rounding inside the fill equals filling f64 and
    // casting); every other dtype fills f64 (i64 for integers) and casts.
    let wide = match dist {
        Distribution::Normal { mean, std } => float_fill(
            dtype,
            n,
            |v| rng::fill_normal(seed, offset, mean, std, v),
            |v| rng::fill_normal(seed, offset, mean, std, v),
        ),
        Distribution::Uniform { low, high } => float_fill(
            dtype,
            n,
            |v| rng::fill_uniform(seed, offset, low, high, v),
            |v| rng::fill_uniform(seed, offset, low, high, v),
        ),
        Distribution::RandInt { low, high } => {
            let mut v = vec![0i64; n];
            rng::fill_randint(seed, offset, low, high, &mut v);
            CpuStorage::I64(v)
        }
    };
    if wide.dtype() == dtype {
        return Ok(wide);
    }
    super::cast(&wide, &whole(&wide), dtype)
}

/// `n` values written by `f32s` when `dtype` is f32, else by `f64s` in f64 (cast to `dtype` by
/// the caller).
fn float_fill(
    dtype: DType,
    n: usize,
    f32s: impl FnOnce(&mut [f32]),
    f64s: impl FnOnce(&mut [f64]),
) -> CpuStorage {
    if dtype == DType::F32 {
        let mut v = vec![0f32; n];
        f32s(&mut v);
        return CpuStorage::F32(v);
    }
    let mut v = vec![0f64; n];
    f64s(&mut v);
    CpuStorage::F64(v)
}

/// `[start, start + 1, ...]` in `dtype`, computed in f64 and cast.
pub(crate) fn arange(_device: Device, start: i64, len: usize, dtype: DType) -> Result<CpuStorage> {
    let v: Vec<f64> = (0..len as i64).map(|i| (start + i) as f64).collect();
    let s = CpuStorage::F64(v);
    if dtype == DType::F64 {
        return Ok(s);
    }
    super::cast(&s, &whole(&s), dtype)
}
