//! Memory ops: allocation, host transfers, fills, random fills and `arange`.

use cudarc::driver::{result, sys};
use half::{bf16, f16};

use super::{args, basic_sfx, copy_contiguous, ctx_of, float_sfx};
use crate::backend::api::{BackendStorage, Distribution};
use crate::cuda_backend::CudaStorage;
use crate::storage::CpuStorage;
use crate::{DType, Device, Error, Layout, Result};

/// See `BackendStorage::zeros`.
pub(crate) fn zeros(device: Device, dtype: DType, len: usize) -> Result<CudaStorage> {
    let ctx = ctx_of(device)?;
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    let bytes = len * dtype.size_in_bytes();
    if bytes > 0 {
        ctx.bind()?;
        // SAFETY: `out` owns at least `bytes` bytes at its address on this context; the memset
        // is ordered on the compute stream before any later use of the buffer.
        unsafe { result::memset_d8_async(out.device_ptr(), 0, bytes, ctx.stream.cu_stream()) }
            .map_err(|e| ctx.err("zero-filling a buffer", e))?;
    }
    Ok(out)
}

/// See `BackendStorage::output`: the caching allocator's block as it is (no memset).
pub(crate) fn output(device: Device, dtype: DType, len: usize) -> Result<CudaStorage> {
    CudaStorage::uninit(&ctx_of(device)?, dtype, len)
}

/// See `BackendStorage::full`: the value converted as the CPU converts it (`as` for integers,
/// one rounding for floats), written by a memset of its bit pattern for 1-, 2- and 4-byte
/// dtypes and by `fill_f64` / `fill_i64` for 8-byte ones.
pub(crate) fn full(device: Device, value: f64, dtype: DType, len: usize) -> Result<CudaStorage> {
    let ctx = ctx_of(device)?;
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    if len == 0 {
        return Ok(out);
    }
    let (ptr, stream) = (out.device_ptr(), ctx.stream.cu_stream());
    match dtype {
        DType::F64 => return args::fill_f64(ptr, len, value).run(&ctx).map(|()| out),
        DType::I64 => {
            return args::fill_i64(ptr, len, value as i64)
                .run(&ctx)
                .map(|()| out)
        }
        _ => {}
    }
    ctx.bind()?;
    // SAFETY: `out` owns `len` elements of the memset's width at `ptr` (each block is its own
    // driver allocation, aligned to at least 256 bytes); ordered on the compute stream.
    let r = unsafe {
        match dtype {
            DType::U8 => result::memset_d8_async(ptr, value as u8, len, stream),
            DType::BF16 => {
                sys::cuMemsetD16Async(ptr, bf16::from_f64(value).to_bits(), len, stream).result()
            }
            DType::F16 => {
                sys::cuMemsetD16Async(ptr, f16::from_f64(value).to_bits(), len, stream).result()
            }
            DType::F32 => {
                sys::cuMemsetD32Async(ptr, (value as f32).to_bits(), len, stream).result()
            }
            _ => sys::cuMemsetD32Async(ptr, value as u32, len, stream).result(), // U32
        }
    };
    r.map_err(|e| ctx.err("filling a buffer", e))?;
    Ok(out)
}

/// See `BackendStorage::from_host`.
pub(crate) fn from_host(device: Device, host: CpuStorage) -> Result<CudaStorage> {
    let ctx = ctx_of(device)?;
    let out = CudaStorage::uninit(&ctx, host.dtype(), host.len())?;
    let bytes = host.as_bytes();
    if !bytes.is_empty() {
        ctx.bind()?;
        // SAFETY: `out` holds at least `bytes.len()` bytes. The copy is synchronous with respect
        // to the host buffer (the stream is synchronised below before `host` is dropped).
        unsafe { result::memcpy_htod_async(out.device_ptr(), bytes, ctx.stream.cu_stream()) }
            .map_err(|e| ctx.err("copying to the device", e))?;
        ctx.synchronize()?;
    }
    Ok(out)
}

/// See `BackendStorage::to_host`.
pub(crate) fn to_host(s: &CudaStorage, l: &Layout) -> Result<CpuStorage> {
    let Some(range) = l.contiguous_range() else {
        let c = copy_contiguous(s, l)?;
        return to_host(&c, &Layout::contiguous(c.len()));
    };
    let ctx = s.ctx();
    let mut host = CpuStorage::zeros(s.dtype(), range.len());
    let dst: &mut [u8] =
        crate::cpu_map!(&mut host, v => bytemuck::cast_slice_mut(v.as_mut_slice()));
    if !dst.is_empty() {
        ctx.bind()?;
        // SAFETY: the view `range` lies inside `s` (its layout was checked against the buffer
        // by the tensor layer); `dst` has exactly its byte size; the stream is synchronised
        // before `dst` is read.
        unsafe { result::memcpy_dtoh_async(dst, s.ptr_at(range.start), ctx.stream.cu_stream()) }
            .map_err(|e| ctx.err("copying to the host", e))?;
        ctx.synchronize()?;
    }
    Ok(host)
}

/// See `BackendStorage::read_elements`: one copy per run of consecutive indices, one wait.
pub(crate) fn read_elements(s: &CudaStorage, indices: &[usize]) -> Result<CpuStorage> {
    if let Some(&bad) = indices.iter().find(|&&i| i >= s.len()) {
        return Err(Error::Msg(format!(
            "read_elements: index {bad} out of range for a buffer of {} elements",
            s.len()
        )));
    }
    let ctx = s.ctx();
    let es = s.dtype().size_in_bytes();
    let mut host = CpuStorage::zeros(s.dtype(), indices.len());
    let dst: &mut [u8] =
        crate::cpu_map!(&mut host, v => bytemuck::cast_slice_mut(v.as_mut_slice()));
    if indices.is_empty() {
        return Ok(host);
    }
    ctx.bind()?;
    let mut i = 0;
    while i < indices.len() {
        let mut j = i + 1;
        while j < indices.len() && indices[j] == indices[j - 1] + 1 {
            j += 1;
        }
        // SAFETY: indices i..j are the consecutive elements indices[i].. of `s` (checked in
        // range above); `dst[i * es..j * es]` is their room on the host; the stream is
        // synchronised below before `host` is read.
        unsafe {
            result::memcpy_dtoh_async(
                &mut dst[i * es..j * es],
                s.ptr_at(indices[i]),
                ctx.stream.cu_stream(),
            )
        }
        .map_err(|e| ctx.err("copying elements to the host", e))?;
        i = j;
    }
    ctx.synchronize()?;
    Ok(host)
}

/// See `BackendStorage::random`. Drawn on the device with the Philox kernels of random.cu for
/// uniform and normal fills of f32, bf16, f16 and f64 (each rounded once from the f64 value, as
/// the CPU does: uniform bit for bit, normal up to the last f64 bit of CUDA's log/cos, see
/// random.cu) and for integer fills of i64 (bit for bit). Other pairs (integer dtypes of
/// uniform/normal draws, non-i64 `randint`) are drawn on the host by the CPU backend
/// (`meshgrad_kernels::rng`, the same values) and copied over.
pub(crate) fn random(
    device: Device,
    dtype: DType,
    len: usize,
    seed: u64,
    offset: u64,
    dist: Distribution,
) -> Result<CudaStorage> {
    let ctx = ctx_of(device)?;
    let sfx = match dtype {
        DType::F64 => Some("f64"),
        d => float_sfx("random", d).ok(),
    };
    let launch = |out: u64| match (dist, sfx) {
        (Distribution::Uniform { low, high }, Some(sfx)) => {
            Some(args::uniform(sfx, out, len, seed, offset, low, high - low))
        }
        (Distribution::Normal { mean, std }, Some(sfx)) => {
            Some(args::normal(sfx, out, len, seed, offset, mean, std))
        }
        (Distribution::RandInt { low, high }, _) if dtype == DType::I64 => {
            let width = (i128::from(high) - i128::from(low)) as u64;
            Some(args::randint(out, len, seed, offset, low, width))
        }
        _ => None,
    };
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    match launch(out.device_ptr()) {
        Some(_) if len == 0 => Ok(out),
        Some(l) => l.run(&ctx).map(|()| out),
        None => {
            let host = <CpuStorage as BackendStorage>::random(
                Device::Cpu,
                dtype,
                len,
                seed,
                offset,
                dist,
            )?;
            from_host(device, host)
        }
    }
}

/// See `BackendStorage::arange`: `arange_<t>` for f32, bf16, f16 and f64 (f64 start + i
/// rounded once, as the CPU), `arange_i64` for i64 (exact); u8 and u32 on the host (CPU
/// backend) and copied over.
pub(crate) fn arange(device: Device, start: i64, len: usize, dtype: DType) -> Result<CudaStorage> {
    let ctx = ctx_of(device)?;
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    let ptr = out.device_ptr();
    let launch = match dtype {
        DType::I64 => args::arange_i64(ptr, len, start),
        d => match basic_sfx("arange", d) {
            Ok(sfx) => args::arange_float(sfx, ptr, len, start),
            Err(_) => {
                let host = <CpuStorage as BackendStorage>::arange(Device::Cpu, start, len, dtype)?;
                return from_host(device, host);
            }
        },
    };
    if len > 0 {
        launch.run(&ctx)?;
    }
    Ok(out)
}
