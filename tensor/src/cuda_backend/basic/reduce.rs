//! Reductions over the middle dim of `[outer, red, inner]`.

use meshgrad_kernels::ops::ReduceOp;

use super::{args, basic_sfx, contiguous};
use crate::backend::api::{In, ReduceDims};
use crate::cuda_backend::CudaStorage;
use crate::{DType, Error, Result};

/// Rows at least this long (with `inner == 1`) are reduced by a block each (`_lastdim`);
/// shorter ones by one thread each (`_strided`, which adds in the CPU's order).
pub(crate) const LASTDIM_MIN_RED: usize = 64;

/// Sums over at least this many rows with `inner > 1` and at most [`COLS_MAX_OUTPUTS`] outputs
/// use `sum_cols_<t>` (a block per 32 outputs) rather than one thread per output.
pub(crate) const COLS_MIN_RED: usize = 256;

/// The most outputs a `sum_cols_<t>` reduction has; with more, one thread per output keeps the
/// GPU busy by itself.
pub(crate) const COLS_MAX_OUTPUTS: usize = 1 << 16;

/// Whether a sum over the middle dim of `[outer, red, inner]` uses `sum_cols_<t>`: rows
/// (`inner > 1`) long enough and outputs too few for one thread each (a bias gradient, the
/// column sum of `[rows, out]`, whose one-thread-per-column loop over 8192 rows dominated the
/// GPT-2 124M linear backward on an H200).
pub(crate) fn use_cols(op: ReduceOp, outer: usize, red: usize, inner: usize) -> bool {
    op == ReduceOp::Sum
        && inner > 1
        && red >= COLS_MIN_RED
        && outer.saturating_mul(inner) <= COLS_MAX_OUTPUTS
}

/// Whether a reduction of `[outer, red, inner]` uses the `_lastdim` kernels (one block per
/// row: `inner == 1` and rows of at least [`LASTDIM_MIN_RED`]) rather than `_strided` (one
/// thread per output element).
pub(crate) fn use_lastdim(red: usize, inner: usize) -> bool {
    inner == 1 && red >= LASTDIM_MIN_RED
}

/// See `BackendStorage::reduce` (f32, bf16, f16 accumulated in f32, f64 in f64; output in the input's dtype, i64 for argmax as
/// on the CPU). `_strided` sums add in increasing index order in f32 like the CPU (bitwise
/// equal for f32); `_lastdim` and `sum_cols` sums add in a fixed tree order (deterministic, equal
/// to rounding).
/// Max and argmax are exact either way.
pub(crate) fn reduce(
    op: ReduceOp,
    (s, l): In<'_, CudaStorage>,
    d: ReduceDims,
) -> Result<CudaStorage> {
    let ReduceDims { outer, red, inner } = d;
    let sfx = basic_sfx("reduce", s.dtype())?;
    let out_dtype = if op == ReduceOp::ArgMax {
        DType::I64
    } else {
        s.dtype()
    };
    let out = CudaStorage::uninit(s.ctx(), out_dtype, outer * inner)?;
    if outer * inner == 0 {
        return Ok(out);
    }
    if red == 0 && op != ReduceOp::Sum {
        // The CPU kernels refuse this too (the CUDA ones would write NaN / 0).
        return Err(Error::Msg(format!(
            "reduce: {op:?} over an empty dimension (shape [{outer}, 0, {inner}])"
        )));
    }
    let (x, _keep) = contiguous((s, l))?;
    let launch = if use_lastdim(red, inner) {
        args::reduce_lastdim(op, sfx, x, out.device_ptr(), outer, red)
    } else if use_cols(op, outer, red, inner) {
        args::reduce_cols(sfx, x, out.device_ptr(), d)
    } else {
        args::reduce_strided(op, sfx, x, out.device_ptr(), d)
    };
    launch.run(s.ctx())?;
    Ok(out)
}
