//! Index-driven ops: embedding lookup, `gather`, `index_select`, and their scatter-add
//! backward passes.
//!
//! The kernels take i64 indices: i64 views are used in place (or made contiguous on the
//! device); u32 and u8 indices are widened on the host (a synchronising round trip). An index
//! out of range is flagged by the kernel in a device word; it is read back after the launch (one
//! small synchronising copy per call) and raised as the CPU's error (value, position, size).
//! The backward passes accumulate into zeroed f32 buffers in a fixed order, deterministic run
//! to run (the embedding's atomic variant only on request, see [`embedding_backward`]), and are
//! rounded once to the gradient's dtype.

use std::sync::{Arc, OnceLock};

use meshgrad_kernels::cuda::{GatherArgs, MAX_DIMS};

use super::{
    acc_dtype, args, basic_sfx, cast, contiguous, download_view, from_host, full, mover, read_u64,
    to_host, zeros, Mover,
};
use crate::backend::api::{BackendStorage, In, Select};
use crate::cuda_backend::{CudaStorage, DeviceContext};
use crate::ops::fused::embedding::Embedding;
use crate::storage::CpuStorage;
use crate::{DType, Error, Layout, Result};

/// Integer indices as a contiguous i64 device buffer.
struct Ids {
    /// Device address of index 0.
    ptr: u64,
    /// Number of indices.
    len: usize,
    /// The converted or compacted copy, when one was made.
    _owned: Option<CudaStorage>,
}

impl Ids {
    /// The indices of the view `x` as i64 (see the module documentation); other dtypes are
    /// [`Error::UnsupportedDType`] naming `op`.
    fn of(op: &'static str, (s, l): In<'_, CudaStorage>) -> Result<Self> {
        let len = l.shape().elem_count();
        let wide: Vec<i64> = match s.dtype() {
            DType::I64 => {
                let (ptr, owned) = contiguous((s, l))?;
                return Ok(Ids {
                    ptr,
                    len,
                    _owned: owned,
                });
            }
            DType::U32 | DType::U8 => match to_host(s, l)? {
                CpuStorage::U32(v) => v.into_iter().map(i64::from).collect(),
                CpuStorage::U8(v) => v.into_iter().map(i64::from).collect(),
                _ => unreachable!("to_host keeps the dtype"),
            },
            dtype => return Err(Error::UnsupportedDType { op, dtype }),
        };
        let d = from_host(s.device(), CpuStorage::I64(wide))?;
        Ok(Ids {
            ptr: d.device_ptr(),
            len,
            _owned: Some(d),
        })
    }

    /// The index at `pos` (read from the device).
    fn value_at(&self, ctx: &DeviceContext, pos: usize) -> Result<i64> {
        Ok(read_u64(ctx, self.ptr + 8 * pos as u64)? as i64)
    }
}

/// The device word in which a kernel records the smallest position of an index out of range
/// (`~0` when none).
struct BadFlag(CudaStorage);

impl BadFlag {
    /// A flag set to `~0` on `ctx`'s device.
    fn new(ctx: &Arc<DeviceContext>) -> Result<Self> {
        Ok(BadFlag(full(ctx.device(), -1.0, DType::I64, 1)?))
    }

    /// Its device address.
    fn ptr(&self) -> u64 {
        self.0.device_ptr()
    }

    /// The flagged position, if any (waits for the kernel).
    fn position(&self) -> Result<Option<usize>> {
        let v = read_u64(self.0.ctx(), self.ptr())?;
        Ok((v != u64::MAX).then_some(v as usize))
    }

    /// `Ok` when nothing was flagged, else the error `msg(position, index value)`.
    fn check(&self, ids: &Ids, msg: impl FnOnce(usize, i64) -> String) -> Result<()> {
        match self.position()? {
            None => Ok(()),
            Some(pos) => Err(Error::Msg(msg(pos, ids.value_at(self.0.ctx(), pos)?))),
        }
    }
}

/// An accumulator (f32, or f64 for f64: [`acc_dtype`]) rounded once to `dtype` (itself when it
/// is of `dtype`).
fn finish(acc: CudaStorage, dtype: DType) -> Result<CudaStorage> {
    if acc.dtype() == dtype {
        return Ok(acc);
    }
    cast(&acc, &Layout::contiguous(acc.len()), dtype)
}

/// Row-major multi-index of flat index `i` over `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        if dims[d] > 0 {
            idx[d] = i % dims[d];
            i /= dims[d];
        }
    }
    idx
}

/// Whether the embedding backward uses the atomic kernel: only when the environment variable
/// `MESHGRAD_CUDA_EMBEDDING_BWD` is `atomic` (faster for long token batches, but its sums are
/// not reproducible run to run). Read once.
fn atomic_embedding_backward() -> bool {
    static ATOMIC: OnceLock<bool> = OnceLock::new();
    *ATOMIC.get_or_init(|| {
        std::env::var("MESHGRAD_CUDA_EMBEDDING_BWD").is_ok_and(|v| v.trim() == "atomic")
    })
}

/// The CUDA path of the embedding lookup (`ops/fused/embedding`): `embedding_fwd_<t>` for every dtype of 2, 4 or 8 bytes
/// (rows of 8-byte elements as rows of twice as many words); u8 tables through the host.
pub(crate) fn embedding(
    w: In<'_, CudaStorage>,
    ids: In<'_, CudaStorage>,
    vocab: usize,
    dim: usize,
) -> Result<CudaStorage> {
    let Mover::Kernel { sfx, words } = mover(w.0.dtype()) else {
        let ((hw, hwl), (hi, hil)) = (download_view(w)?, download_view(ids)?);
        let r = crate::ops::fused::embedding::cpu::forward(&Embedding {
            table: (&hw, &hwl),
            ids: (&hi, &hil),
            vocab,
            dim,
            out_dims: Vec::new(),
        })?;
        return from_host(w.0.device(), r);
    };
    let ctx = w.0.ctx();
    let ids = Ids::of("embedding (ids)", ids)?;
    let n = ids.len;
    let out = CudaStorage::uninit(ctx, w.0.dtype(), n * dim)?;
    if n * dim == 0 {
        return Ok(out);
    }
    let (wp, _keep) = contiguous(w)?;
    let bad = BadFlag::new(ctx)?;
    args::embedding_fwd(
        sfx,
        [ids.ptr, wp, out.device_ptr(), bad.ptr()],
        n,
        vocab,
        dim * words,
    )
    .run(ctx)?;
    bad.check(&ids, |i, id| {
        format!("embedding: id {id} at position {i} is outside 0..{vocab}")
    })?;
    Ok(out)
}

/// The CUDA path of the embedding backward (`ops/fused/embedding`): `embedding_bwd_det_<t>` (one warp per id range and
/// 32-column tile, positions in increasing order: the CPU's order, so f32 sums are bitwise the
/// CPU's), or
/// `embedding_bwd_atomic_<t>` when `MESHGRAD_CUDA_EMBEDDING_BWD=atomic`. f32, bf16, f16 (f32
/// sums); f64.
pub(crate) fn embedding_backward(
    dout: In<'_, CudaStorage>,
    ids: In<'_, CudaStorage>,
    vocab: usize,
    dim: usize,
) -> Result<CudaStorage> {
    let dtype = dout.0.dtype();
    let sfx = basic_sfx("embedding_backward", dtype)?;
    let ctx = dout.0.ctx();
    let ids = Ids::of("embedding_backward (ids)", ids)?;
    let n = ids.len;
    let dw = zeros(ctx.device(), acc_dtype(dtype), vocab * dim)?;
    if n * dim > 0 {
        let (g, _keep) = contiguous(dout)?;
        let bad = BadFlag::new(ctx)?;
        let det = !atomic_embedding_backward();
        args::embedding_bwd(
            det,
            sfx,
            [ids.ptr, g, dw.device_ptr(), bad.ptr()],
            n,
            vocab,
            dim,
        )
        .run(ctx)?;
        bad.check(&ids, |i, id| {
            format!("embedding_backward: id {id} at position {i} is outside 0..{vocab}")
        })?;
    }
    finish(dw, dtype)
}

/// The [`GatherArgs`] of a gather of `x_dims` by an index of `index_dims` along `dim`; ranks
/// that differ, exceed 8, or an index larger than the input off `dim` are errors naming the
/// shapes.
pub(crate) fn gather_args(
    op: &str,
    x_dims: &[usize],
    index_dims: &[usize],
    dim: usize,
) -> Result<GatherArgs> {
    let rank = x_dims.len();
    let fits = index_dims.len() == rank
        && dim < rank
        && x_dims
            .iter()
            .zip(index_dims)
            .enumerate()
            .all(|(k, (&a, &b))| k == dim || b <= a);
    if !fits || rank > MAX_DIMS {
        return Err(Error::Msg(format!(
            "{op}: an index of shape {index_dims:?} cannot gather along dim {dim} of shape \
             {x_dims:?} on CUDA (same rank, at most {MAX_DIMS} dims, no larger off dim {dim})"
        )));
    }
    let mut g = GatherArgs {
        ndim: rank as i32,
        dim: dim as i32,
        ..Default::default()
    };
    for k in 0..rank {
        g.x_dims[k] = x_dims[k] as i64;
        g.index_dims[k] = index_dims[k] as i64;
    }
    Ok(g)
}

/// The error message of a gather index out of range, as the CPU words it.
fn gather_msg(
    op: &str,
    pos: usize,
    v: i64,
    index_dims: &[usize],
    dim: usize,
    size: usize,
) -> String {
    format!(
        "{op}: index {v} at position {:?} is out of range for dim {dim} of size {size}",
        unravel(pos, index_dims)
    )
}

/// See `BackendStorage::gather`: `gather_<t>` for 2- and 4-byte dtypes; u8 and 8-byte inputs
/// through the host.
pub(crate) fn gather(
    x: In<'_, CudaStorage>,
    index: In<'_, CudaStorage>,
    dim: usize,
) -> Result<CudaStorage> {
    let (xl, il) = (x.1, index.1);
    let g = gather_args("gather", xl.dims(), il.dims(), dim)?;
    let sfx = match mover(x.0.dtype()) {
        Mover::Kernel { sfx, words: 1 } => sfx,
        _ => {
            let ((hx, hxl), (hi, hil)) = (download_view(x)?, download_view(index)?);
            let r = <CpuStorage as BackendStorage>::gather((&hx, &hxl), (&hi, &hil), dim)?;
            return from_host(x.0.device(), r);
        }
    };
    let ctx = x.0.ctx();
    let idx = Ids::of("gather (index)", index)?;
    let out = CudaStorage::uninit(ctx, x.0.dtype(), idx.len)?;
    if idx.len == 0 {
        return Ok(out);
    }
    let (xp, _keep) = contiguous(x)?;
    let bad = BadFlag::new(ctx)?;
    args::gather(
        sfx,
        false,
        g,
        [xp, idx.ptr, out.device_ptr(), bad.ptr()],
        idx.len,
    )
    .run(ctx)?;
    bad.check(&idx, |p, v| {
        gather_msg("gather", p, v, il.dims(), dim, xl.dims()[dim])
    })?;
    Ok(out)
}

/// See `BackendStorage::gather_backward`: `gather_bwd_<t>` (one thread per (outer, inner) pair
/// of the index, increasing position along `dim`: the CPU's order). f32, bf16, f16 (f32 sums); f64.
pub(crate) fn gather_backward(
    dout: In<'_, CudaStorage>,
    index: In<'_, CudaStorage>,
    x_dims: &[usize],
    dim: usize,
) -> Result<CudaStorage> {
    let dtype = dout.0.dtype();
    let sfx = basic_sfx("gather_backward", dtype)?;
    let il = index.1;
    let g = gather_args("gather_backward", x_dims, il.dims(), dim)?;
    let ctx = dout.0.ctx();
    let idx = Ids::of("gather_backward (index)", index)?;
    let dx = zeros(ctx.device(), acc_dtype(dtype), x_dims.iter().product())?;
    let pairs: usize =
        il.dims()[..dim].iter().product::<usize>() * il.dims()[dim + 1..].iter().product::<usize>();
    if idx.len > 0 {
        let (gp, _keep) = contiguous(dout)?;
        let bad = BadFlag::new(ctx)?;
        args::gather(
            sfx,
            true,
            g,
            [gp, idx.ptr, dx.device_ptr(), bad.ptr()],
            pairs,
        )
        .run(ctx)?;
        bad.check(&idx, |p, v| {
            gather_msg("gather_backward", p, v, il.dims(), dim, x_dims[dim])
        })?;
    }
    finish(dx, dtype)
}

/// The error message of an index_select id out of range, as the CPU words it.
fn select_msg(op: &str, j: usize, v: i64, Select { dim, x_n, .. }: Select) -> String {
    format!("{op}: index {v} at position [{j}] is out of range for dim {dim} of size {x_n}")
}

/// See `BackendStorage::index_select`: `index_select_<t>` for every dtype of 2, 4 or 8 bytes
/// (8-byte elements as word pairs); u8 inputs through the host.
pub(crate) fn index_select(
    x: In<'_, CudaStorage>,
    ids: In<'_, CudaStorage>,
    s: Select,
) -> Result<CudaStorage> {
    let Mover::Kernel { sfx, words } = mover(x.0.dtype()) else {
        let ((hx, hxl), (hi, hil)) = (download_view(x)?, download_view(ids)?);
        let r = <CpuStorage as BackendStorage>::index_select((&hx, &hxl), (&hi, &hil), s)?;
        return from_host(x.0.device(), r);
    };
    let Select {
        outer, x_n, inner, ..
    } = s;
    let ctx = x.0.ctx();
    let ids = Ids::of("index_select (ids)", ids)?;
    let m = ids.len;
    let out = CudaStorage::uninit(ctx, x.0.dtype(), outer * m * inner)?;
    if outer * m * inner == 0 {
        return Ok(out);
    }
    let (xp, _keep) = contiguous(x)?;
    let bad = BadFlag::new(ctx)?;
    let ptrs = [xp, ids.ptr, out.device_ptr(), bad.ptr()];
    args::index_select(sfx, false, ptrs, [outer, x_n, inner * words, m]).run(ctx)?;
    bad.check(&ids, |j, v| select_msg("index_select", j, v, s))?;
    Ok(out)
}

/// See `BackendStorage::index_select_backward`: `index_select_bwd_<t>` (one thread per
/// (outer, inner) pair, ids in increasing position: the CPU's order). f32, bf16, f16 (f32
/// sums); f64.
pub(crate) fn index_select_backward(
    dout: In<'_, CudaStorage>,
    ids: In<'_, CudaStorage>,
    s: Select,
) -> Result<CudaStorage> {
    let Select {
        outer, x_n, inner, ..
    } = s;
    let dtype = dout.0.dtype();
    let sfx = basic_sfx("index_select_backward", dtype)?;
    let ctx = dout.0.ctx();
    let ids = Ids::of("index_select_backward (ids)", ids)?;
    let m = ids.len;
    let dx = zeros(ctx.device(), acc_dtype(dtype), outer * x_n * inner)?;
    if outer * m * inner > 0 {
        let (g, _keep) = contiguous(dout)?;
        let bad = BadFlag::new(ctx)?;
        let ptrs = [g, ids.ptr, dx.device_ptr(), bad.ptr()];
        args::index_select(sfx, true, ptrs, [outer, x_n, inner, m]).run(ctx)?;
        bad.check(&ids, |j, v| select_msg("index_select_backward", j, v, s))?;
    }
    finish(dx, dtype)
}
