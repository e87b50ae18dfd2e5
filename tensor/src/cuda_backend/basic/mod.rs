//! The required ops of the CUDA backend (memory, casts, copies, elementwise, reductions,
//! indexing): each launches the kernels of `kernels/cuda/*.cu` on the operands' compute stream.
//!
//! Files: `memory.rs` (allocation, host transfers, fills, random, arange), `copy.rs` (casts and
//! copies), `elementwise.rs`, `reduce.rs`, `indexing.rs` (embedding, gather, index_select),
//! `strided.rs` (the index arithmetic of strided views, pure), `args.rs` (every launch's
//! argument list, built by pure functions that `tests.rs` checks against the kernels' parsed
//! declarations without a GPU).
//!
//! Dtypes: float math runs in f32 for f32, bf16 and f16 (the kernels' precision); f64 math is
//! not provided on CUDA ([`Error::UnsupportedDType`] naming the op). Ops that only move
//! elements (copies, `where`, gather, index_select, embedding) run for every dtype of 2, 4 or 8
//! bytes (8-byte elements as pairs of 4-byte words); u8 data and the casts, fills and random
//! draws no kernel covers go through the host (correct, but synchronising: each such call says
//! so in its documentation).

use std::sync::Arc;

use cudarc::driver::result;

use super::{context, CudaStorage, DeviceContext};
use crate::storage::CpuStorage;
use crate::{DType, Device, Error, Layout, Result};

mod args;
mod copy;
mod elementwise;
mod indexing;
mod memory;
mod reduce;
mod strided;
#[cfg(test)]
mod tests;

pub(super) use copy::{cast, copy_contiguous, copy_into};
pub(super) use elementwise::{add_assign_contiguous, binary, compare, unary, where_cond};
pub(crate) use indexing::{embedding, embedding_backward};
pub(super) use indexing::{gather, gather_backward, index_select, index_select_backward};
pub(super) use memory::{arange, from_host, full, output, random, read_elements, to_host, zeros};
pub(super) use reduce::reduce;
// The backend trait's matmul is cuBLAS's (`blas/`); listed here with the other required ops.
pub(super) use super::blas::matmul;

/// The context of a CUDA device (the dispatch only hands CUDA devices to this backend).
fn ctx_of(device: Device) -> Result<Arc<DeviceContext>> {
    match device {
        Device::Cuda(n) => context(n),
        Device::Cpu => Err(Error::Msg("the CUDA backend was handed the CPU".to_owned())),
    }
}

/// The entry-name suffix of the kernels for a float dtype they compute on in f32 (f32, bf16,
/// f16); anything else is [`Error::UnsupportedDType`] naming `op`.
fn float_sfx(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        _ => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// The entry-name suffix of the basic kernels (elementwise maps, comparisons, reductions,
/// gather and index_select backward), which also take f64 (computed in f64): [`float_sfx`]'s
/// dtypes and f64.
pub(crate) fn basic_sfx(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F64 => Ok("f64"),
        d => float_sfx(op, d),
    }
}

/// The accumulator dtype of the scatter-add backward kernels for data of `dtype`: f64 for f64,
/// f32 otherwise (the kernels' `Acc<T>`).
fn acc_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// How the data-movement kernels (which copy elements without converting them) move a dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mover {
    /// With the kernels of suffix `sfx` (the same byte width), `words` kernel elements per
    /// element (2 for 8-byte dtypes, moved as two 4-byte words).
    Kernel { sfx: &'static str, words: usize },
    /// No kernel of that width (1-byte u8): through the host.
    Host,
}

/// The [`Mover`] of `dtype`.
fn mover(dtype: DType) -> Mover {
    match dtype {
        DType::F32 | DType::U32 => Mover::Kernel {
            sfx: "f32",
            words: 1,
        },
        DType::BF16 => Mover::Kernel {
            sfx: "bf16",
            words: 1,
        },
        DType::F16 => Mover::Kernel {
            sfx: "f16",
            words: 1,
        },
        DType::F64 | DType::I64 => Mover::Kernel {
            sfx: "f32",
            words: 2,
        },
        DType::U8 => Mover::Host,
    }
}

/// The whole buffer, copied to the host.
fn download(s: &CudaStorage) -> Result<CpuStorage> {
    to_host(s, &Layout::contiguous(s.len()))
}

/// The view `x`, copied to the host, with its contiguous layout there.
fn download_view((s, l): (&CudaStorage, &Layout)) -> Result<(CpuStorage, Layout)> {
    Ok((to_host(s, l)?, Layout::contiguous(l.shape().clone())))
}

/// The device address of the view `l` of `s` when it is contiguous.
fn contiguous_ptr(s: &CudaStorage, l: &Layout) -> Option<u64> {
    l.contiguous_range().map(|r| s.ptr_at(r.start))
}

/// A contiguous view of `x` on the device: its own address when contiguous, else a copy (kept
/// alive by the returned storage).
fn contiguous((s, l): (&CudaStorage, &Layout)) -> Result<(u64, Option<CudaStorage>)> {
    match contiguous_ptr(s, l) {
        Some(p) => Ok((p, None)),
        None => {
            let c = copy_contiguous(s, l)?;
            Ok((c.device_ptr(), Some(c)))
        }
    }
}

/// Copies `bytes` from the host to device address `dst` of `ctx` and waits for the copy.
fn upload_to(ctx: &DeviceContext, dst: u64, bytes: &[u8]) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    ctx.bind()?;
    // SAFETY: the caller hands a device range of at least `bytes.len()` bytes on this context;
    // the stream is synchronised before `bytes` can be dropped.
    unsafe { result::memcpy_htod_async(dst, bytes, ctx.stream.cu_stream()) }
        .map_err(|e| ctx.err("copying to the device", e))?;
    ctx.synchronize()
}

/// Reads the 8 bytes at device address `src` (waits for queued work).
fn read_u64(ctx: &DeviceContext, src: u64) -> Result<u64> {
    let mut v = [0u64; 1];
    ctx.bind()?;
    // SAFETY: the caller hands the address of 8 readable bytes on this context; the stream is
    // synchronised before `v` is read.
    unsafe { result::memcpy_dtoh_async(&mut v[..], src, ctx.stream.cu_stream()) }
        .map_err(|e| ctx.err("copying to the host", e))?;
    ctx.synchronize()?;
    Ok(v[0])
}
