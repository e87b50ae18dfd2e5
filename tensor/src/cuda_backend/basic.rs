//! The required ops of the CUDA backend (memory, casts, copies, elementwise, reductions,
//! indexing): each launches the kernels of `kernels/cuda/*.cu` on the operands' compute stream.
#![allow(clippy::too_many_arguments, clippy::type_complexity)]
use std::sync::Arc;

use cudarc::driver::result;

use super::{context, CudaStorage, DeviceContext};
use crate::backend::api::{Distribution, In};
use crate::storage::CpuStorage;
use crate::{DType, Device, Error, Layout, Result};
use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

/// The context of a CUDA device (the dispatch only hands CUDA devices to this backend).
fn ctx_of(device: Device) -> Result<Arc<DeviceContext>> {
    match device {
        Device::Cuda(n) => context(n),
        Device::Cpu => Err(Error::Msg("the CUDA backend was handed the CPU".to_owned())),
    }
}

/// See `BackendStorage::zeros`.
pub(super) fn zeros(device: Device, dtype: DType, len: usize) -> Result<CudaStorage> {
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

/// See `BackendStorage::full`.
pub(super) fn full(
    _device: Device,
    _value: f64,
    _dtype: DType,
    _len: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "full",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::from_host`.
pub(super) fn from_host(device: Device, host: CpuStorage) -> Result<CudaStorage> {
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
pub(super) fn to_host(s: &CudaStorage, l: &Layout) -> Result<CpuStorage> {
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

/// See `BackendStorage::read_elements`.
pub(super) fn read_elements(_s: &CudaStorage, _indices: &[usize]) -> Result<CpuStorage> {
    Err(Error::NotImplemented {
        op: "read_elements",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::random`.
pub(super) fn random(
    _device: Device,
    _dtype: DType,
    _len: usize,
    _seed: u64,
    _offset: u64,
    _dist: Distribution,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "random",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::arange`.
pub(super) fn arange(
    _device: Device,
    _start: i64,
    _len: usize,
    _dtype: DType,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "arange",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::cast`.
pub(super) fn cast(_s: &CudaStorage, _l: &Layout, _dtype: DType) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "cast",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::copy_contiguous`.
pub(super) fn copy_contiguous(_s: &CudaStorage, _l: &Layout) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "copy_contiguous",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::copy_into`.
pub(super) fn copy_into(
    _s: &mut CudaStorage,
    _dl: &Layout,
    _src: In<'_, CudaStorage>,
) -> Result<()> {
    Err(Error::NotImplemented {
        op: "copy_into",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::add_assign_contiguous`.
pub(super) fn add_assign_contiguous(
    _s: &mut CudaStorage,
    _dl: &Layout,
    _src: In<'_, CudaStorage>,
) -> Result<bool> {
    Err(Error::NotImplemented {
        op: "add_assign_contiguous",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::unary`.
pub(super) fn unary(_x: In<'_, CudaStorage>, _op: UnaryOp) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "unary",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::binary`.
pub(super) fn binary(
    _op: BinaryOp,
    _a: In<'_, CudaStorage>,
    _b: In<'_, CudaStorage>,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "binary",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::compare`.
pub(super) fn compare(
    _op: CmpOp,
    _a: In<'_, CudaStorage>,
    _b: In<'_, CudaStorage>,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "compare",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::where_cond`.
pub(super) fn where_cond(
    _cond: In<'_, CudaStorage>,
    _t: In<'_, CudaStorage>,
    _f: In<'_, CudaStorage>,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "where_cond",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::reduce`.
pub(super) fn reduce(
    _op: ReduceOp,
    _x: In<'_, CudaStorage>,
    _outer: usize,
    _red: usize,
    _inner: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "reduce",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::embedding`.
pub(super) fn embedding(
    _w: In<'_, CudaStorage>,
    _ids: In<'_, CudaStorage>,
    _vocab: usize,
    _dim: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "embedding",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::embedding_backward`.
pub(super) fn embedding_backward(
    _dout: In<'_, CudaStorage>,
    _ids: In<'_, CudaStorage>,
    _vocab: usize,
    _dim: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "embedding_backward",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::gather`.
pub(super) fn gather(
    _x: In<'_, CudaStorage>,
    _index: In<'_, CudaStorage>,
    _dim: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "gather",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::gather_backward`.
pub(super) fn gather_backward(
    _dout: In<'_, CudaStorage>,
    _index: In<'_, CudaStorage>,
    _x_dims: &[usize],
    _dim: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "gather_backward",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::index_select`.
pub(super) fn index_select(
    _x: In<'_, CudaStorage>,
    _ids: In<'_, CudaStorage>,
    _outer: usize,
    _x_n: usize,
    _inner: usize,
    _dim: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "index_select",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::index_select_backward`.
pub(super) fn index_select_backward(
    _dout: In<'_, CudaStorage>,
    _ids: In<'_, CudaStorage>,
    _outer: usize,
    _x_n: usize,
    _inner: usize,
    _dim: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "index_select_backward",
        device: Device::Cuda(0),
    })
}
