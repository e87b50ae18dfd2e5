//! The weight-gradient partial sums of the norms (`norm_partials_reduce_<t>` of norm_partials.cu) and the
//! helpers the norms of layer_norm.cu and rms_norm.cu share (the CUDA paths of layer norm,
//! `ops/fused/layer_norm/cuda.rs`, and RMSNorm, `ops/fused/rms_norm/cuda.rs`, use them).
//!
//! Dtypes: f32, bf16 and f16 data (computed in f32); f64 is not provided on CUDA (`Ok(None)`).
//! The saved statistics (`mean`, `rstd`) are f32 `[rows]` for every data dtype: the CPU paths
//! also return them in compute precision (f32 for f32 / bf16 / f16: `ops/fused/*/cpu.rs` build
//! `CpuStorage::F32`, and the composed fallbacks keep them in `compute_dtype`), and the tensor
//! ops build the statistics' tensors from the storages' own dtype, so both backends give f32
//! statistics. The backward converts statistics of another dtype to f32.
//!
//! Mixed dtypes (a weight or bias of another float dtype than `x`, as the CPU accepts: it widens
//! every operand to f32): everything is widened to f32 exactly, computed with the f32 kernels,
//! and the results rounded to `x`'s dtype (`y`, `dx`) and the weight's (`dweight`, `dbias`),
//! as on the CPU.
//!
//! Rows of no columns get the CPU's statistics (mean 0, `rstd = 1/sqrt(eps)`) without a launch.
//!
//! Backward: `dweight`/`dbias` are summed over rows as per-block f32 partials
//! (`[blocks, cols]`, `blocks = min(rows, NORM_BWD_BLOCKS)`, at least 1) reduced by
//! `norm_partials_reduce_<t>` in increasing block order: deterministic, equal to the CPU's
//! row-order sums to rounding.

use std::sync::Arc;

use super::args::{args, flat_grid, i64_of, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{as_dtype, output, Operand};
use crate::backend::api::In;
use crate::cuda_backend::{basic, CudaStorage, DeviceContext};
use crate::{DType, Layout, Result};

/// The most blocks of a norm backward launch (and so rows of its partial-sum buffers).
pub(crate) const NORM_BWD_BLOCKS: usize = 512;

/// Blocks of a norm backward over `rows` rows.
pub(crate) fn norm_bwd_blocks(rows: usize) -> usize {
    rows.clamp(1, NORM_BWD_BLOCKS)
}

/// `norm_partials_reduce_<t>(partial, nparts, cols, out, accumulate)`: one thread per column.
pub(crate) fn partials_reduce_launch(
    t: &str,
    partial: u64,
    nparts: usize,
    cols: usize,
    out: u64,
    accumulate: bool,
) -> Launch {
    Launch {
        file: "norm_partials.cu",
        entry: format!("norm_partials_reduce_{t}"),
        grid: flat_grid(cols),
        block: BLOCK_1D,
        shared: 0,
        args: args![ptr partial, size nparts, size cols, ptr out, i32 accumulate as i32].to_vec(),
    }
}

/// The dtype the kernels run in for data `x` and parameters `params`: `x`'s when every
/// parameter has it, f32 when they differ (all widened exactly), `None` when one of them is not
/// a kernel dtype (f64).
pub(crate) fn kernel_dtype(x: DType, params: &[DType]) -> Option<DType> {
    sfx(x)?;
    for &p in params {
        sfx(p)?;
    }
    Some(if params.iter().all(|&p| p == x) {
        x
    } else {
        DType::F32
    })
}

/// `s` (contiguous) rounded to `dtype` (itself when it already is).
pub(crate) fn rounded(s: CudaStorage, dtype: DType) -> Result<CudaStorage> {
    if s.dtype() == dtype {
        Ok(s)
    } else {
        basic::cast(&s, &Layout::contiguous(s.len()), dtype)
    }
}

/// `Σ_rows` partials of `[blocks, cols]` reduced into a new `[cols]` buffer of `kd` (a kernel
/// dtype), rounded to `out_dt`.
pub(crate) fn reduce_partials(
    ctx: &Arc<DeviceContext>,
    partial: &CudaStorage,
    blocks: usize,
    cols: usize,
    kd: DType,
    out_dt: DType,
    what: &dyn Fn() -> String,
) -> Result<CudaStorage> {
    let out = output(ctx, kd, cols)?;
    partials_reduce_launch(
        sfx(kd).unwrap_or("f32"),
        partial.device_ptr(),
        blocks,
        cols,
        out.device_ptr(),
        false,
    )
    .run(ctx, what)?;
    rounded(out, out_dt)
}

/// The statistics of rows of no columns, as the CPU gives them (the kernel would divide 0 by
/// 0): mean 0 and `rstd = 1 / sqrt(eps)` in f32, for `rows` rows.
pub(crate) fn empty_row_stats(
    ctx: &Arc<DeviceContext>,
    rows: usize,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    let rstd = 1.0f32 / (eps as f32).sqrt();
    Ok((
        basic::zeros(ctx.device(), DType::F32, rows)?,
        basic::full(ctx.device(), rstd as f64, DType::F32, rows)?,
    ))
}

/// The operand `w` in `kd` (None when absent).
pub(crate) fn param<'a>(w: Option<In<'a, CudaStorage>>, kd: DType) -> Result<Option<Operand<'a>>> {
    w.map(|w| as_dtype(w, kd)).transpose()
}

/// A row kernel of `file` (layer_norm.cu or rms_norm.cu, the row kernels of norm.cuh): the
/// pointers `p` in order, then `rows`, `cols` (i64) and, for the forward kernels, `eps` (f32), on
/// `grid` blocks of [`BLOCK_1D`] threads.
pub(crate) fn norm_launch(
    file: &'static str,
    entry: String,
    p: &[u64],
    rows: usize,
    cols: usize,
    grid: (u32, u32, u32),
    eps: Option<f64>,
) -> Launch {
    let mut args: Vec<Arg> = p.iter().map(|&x| Arg::Ptr(x)).collect();
    args.extend([i64_of(rows), i64_of(cols)]);
    args.extend(eps.map(|e| Arg::F32(e as f32)));
    Launch {
        file,
        entry,
        grid,
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

#[cfg(test)]
mod tests {
    use super::super::args::assert_launch;
    use super::super::args::Kind::*;
    use super::*;
    use crate::cuda_backend::fused::args::args;

    #[test]
    fn partials_reduce_launch_matches_the_kernel_signature() {
        assert_eq!(norm_bwd_blocks(0), 1);
        assert_eq!(norm_bwd_blocks(5000), NORM_BWD_BLOCKS);
        // norm_partials_reduce_<t>(const float *partial, i64 nparts, i64 cols, T *out,
        //                          int accumulate)
        let l = partials_reduce_launch("bf16", 1, 7, 300, 2, false);
        assert_launch(&l, "norm_partials_reduce_bf16", &[P, I64, I64, P, I32]);
        assert_eq!(l.args, args![ptr 1, i64 7, i64 300, ptr 2, i32 0]);
        assert_eq!(l.grid, (2, 1, 1));
    }

    #[test]
    fn mixed_dtypes_run_in_f32_and_f64_is_declined() {
        assert_eq!(kernel_dtype(DType::BF16, &[]), Some(DType::BF16));
        assert_eq!(kernel_dtype(DType::BF16, &[DType::BF16]), Some(DType::BF16));
        assert_eq!(kernel_dtype(DType::BF16, &[DType::F32]), Some(DType::F32));
        assert_eq!(kernel_dtype(DType::F32, &[DType::F16]), Some(DType::F32));
        assert_eq!(kernel_dtype(DType::F64, &[]), None);
        assert_eq!(kernel_dtype(DType::F32, &[DType::F64]), None);
    }
}
