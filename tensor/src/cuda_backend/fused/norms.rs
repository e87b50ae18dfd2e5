//! Layer norm, forward and backward (norms.cu), and the helpers every norm of norms.cu shares
//! (RMSNorm's CUDA path, `ops/fused/rms_norm/cuda.rs`, uses them too).
//!
//! Dtypes: f32, bf16 and f16 data (computed in f32); f64 is not provided on CUDA (`Ok(None)`).
//! The saved statistics (`mean`, `rstd`) are f32 `[rows]` for every data dtype: the CPU backend
//! also returns them in compute precision (f32 for f32 / bf16 / f16: `cpu_backend/layer_norm.rs`
//! and `ops/fused/rms_norm/cpu.rs` build `CpuStorage::F32`, and the composed fallbacks keep them
//! in `compute_dtype`), and the tensor op builds the `mean` / `rstd` tensors from the storages'
//! own dtype, so both backends give f32 statistics. The backward converts statistics of another
//! dtype to f32.
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

use super::args::{flat_grid, i64_of, row_grid, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{as_dtype, check_len, output, ptr_or_null, Operand};
use crate::backend::api::{Fused, In};
use crate::cuda_backend::{basic, CudaStorage, DeviceContext};
use crate::{DType, Layout, Result};

/// The most blocks of a norm backward launch (and so rows of its partial-sum buffers).
pub(crate) const NORM_BWD_BLOCKS: usize = 512;

/// Blocks of a norm backward over `rows` rows.
pub(crate) fn norm_bwd_blocks(rows: usize) -> usize {
    rows.clamp(1, NORM_BWD_BLOCKS)
}

/// `layer_norm_fwd_<t>(x, w, b, y, mean, rstd, rows, cols, eps)`; `[x, w, b, y, mean, rstd]`
/// (w, b: 0 when absent).
pub(crate) fn layer_norm_fwd_launch(
    t: &str,
    p: [u64; 6],
    rows: usize,
    cols: usize,
    eps: f64,
) -> Launch {
    norm_launch(
        format!("layer_norm_fwd_{t}"),
        &p,
        rows,
        cols,
        row_grid(rows),
        Some(eps),
    )
}

/// `layer_norm_bwd_<t>(x, w, mean, rstd, dy, dx, dw_partial, db_partial, rows, cols)` on
/// `blocks` blocks; `[x, w, mean, rstd, dy, dx, dw_partial, db_partial]` (w and the partials: 0
/// when absent / not wanted).
pub(crate) fn layer_norm_bwd_launch(
    t: &str,
    p: [u64; 8],
    rows: usize,
    cols: usize,
    blocks: usize,
) -> Launch {
    norm_launch(
        format!("layer_norm_bwd_{t}"),
        &p,
        rows,
        cols,
        (blocks as u32, 1, 1),
        None,
    )
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
        file: "norms.cu",
        entry: format!("norm_partials_reduce_{t}"),
        grid: flat_grid(cols),
        block: BLOCK_1D,
        shared: 0,
        args: vec![
            Arg::Ptr(partial),
            i64_of(nparts),
            i64_of(cols),
            Arg::Ptr(out),
            Arg::I32(accumulate as i32),
        ],
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

/// `Σ_rows` partials of `[blocks, cols]` reduced into a new `[cols]` buffer of `kd`, rounded to
/// `out_dt`.
pub(crate) fn reduce_partials(
    ctx: &Arc<DeviceContext>,
    t: &str,
    partial: &CudaStorage,
    blocks: usize,
    cols: usize,
    kd: DType,
    out_dt: DType,
    what: &dyn Fn() -> String,
) -> Result<CudaStorage> {
    let out = output(ctx, kd, cols)?;
    partials_reduce_launch(
        t,
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

/// See `BackendStorage::layer_norm`: `(y, mean, rstd)`, `y` in `x`'s dtype, `mean` and `rstd`
/// f32 `[rows]`. `Ok(None)` for f64 operands.
pub(in crate::cuda_backend) fn layer_norm(
    x: In<'_, CudaStorage>,
    w: Option<In<'_, CudaStorage>>,
    b: Option<In<'_, CudaStorage>>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Fused<(CudaStorage, CudaStorage, CudaStorage)> {
    let dt = x.0.dtype();
    let pdts: Vec<DType> = [w, b].iter().flatten().map(|p| p.0.dtype()).collect();
    let Some(kd) = kernel_dtype(dt, &pdts) else {
        return Ok(None);
    };
    let t = sfx(kd).unwrap_or("f32");
    let op = "layer_norm";
    check_len(op, "x", x.1, rows * cols)?;
    for (name, p) in [("weight", w), ("bias", b)] {
        if let Some(p) = p {
            check_len(op, name, p.1, cols)?;
        }
    }
    let ctx = x.0.ctx();
    if cols == 0 {
        let (mean, rstd) = empty_row_stats(ctx, rows, eps)?;
        return Ok(Some((output(ctx, dt, 0)?, mean, rstd)));
    }
    let (xo, wo, bo) = (as_dtype(x, kd)?, param(w, kd)?, param(b, kd)?);
    let y = output(ctx, kd, rows * cols)?;
    let (mean, rstd) = (
        output(ctx, DType::F32, rows)?,
        output(ctx, DType::F32, rows)?,
    );
    let p = [
        xo.ptr(),
        ptr_or_null(&wo),
        ptr_or_null(&bo),
        y.device_ptr(),
        mean.device_ptr(),
        rstd.device_ptr(),
    ];
    layer_norm_fwd_launch(t, p, rows, cols, eps).run(ctx, || {
        format!("{op} of [{rows}, {cols}] {dt:?} (weight/bias dtypes {pdts:?}, eps {eps})")
    })?;
    Ok(Some((rounded(y, dt)?, mean, rstd)))
}

/// See `BackendStorage::layer_norm_backward`: `(dx, dweight, dbias)`, `dx` in `x`'s dtype, the
/// parameter gradients (when `param_grads`) in the weight's dtype (`x`'s without a weight).
/// `Ok(None)` for f64 operands.
pub(in crate::cuda_backend) fn layer_norm_backward(
    x: In<'_, CudaStorage>,
    w: Option<In<'_, CudaStorage>>,
    mean: In<'_, CudaStorage>,
    rstd: In<'_, CudaStorage>,
    dy: In<'_, CudaStorage>,
    rows: usize,
    cols: usize,
    param_grads: bool,
) -> Fused<(CudaStorage, Option<CudaStorage>, Option<CudaStorage>)> {
    let dt = x.0.dtype();
    let wdt = w.map_or(dt, |w| w.0.dtype());
    let Some(kd) = kernel_dtype(dt, &[wdt]) else {
        return Ok(None);
    };
    let t = sfx(kd).unwrap_or("f32");
    let op = "layer_norm_backward";
    check_len(op, "x", x.1, rows * cols)?;
    check_len(op, "dy", dy.1, rows * cols)?;
    check_len(op, "mean", mean.1, rows)?;
    check_len(op, "rstd", rstd.1, rows)?;
    if let Some(w) = w {
        check_len(op, "weight", w.1, cols)?;
    }
    let (xo, go, wo) = (as_dtype(x, kd)?, as_dtype(dy, kd)?, param(w, kd)?);
    let (mo, ro) = (as_dtype(mean, DType::F32)?, as_dtype(rstd, DType::F32)?);
    let ctx = x.0.ctx();
    let dx = output(ctx, kd, rows * cols)?;
    let blocks = norm_bwd_blocks(rows);
    let partials = if param_grads {
        Some((
            output(ctx, DType::F32, blocks * cols)?,
            output(ctx, DType::F32, blocks * cols)?,
        ))
    } else {
        None
    };
    let (dwp, dbp) = partials
        .as_ref()
        .map_or((0, 0), |(a, b)| (a.device_ptr(), b.device_ptr()));
    let p = [
        xo.ptr(),
        ptr_or_null(&wo),
        mo.ptr(),
        ro.ptr(),
        go.ptr(),
        dx.device_ptr(),
        dwp,
        dbp,
    ];
    let what =
        || format!("{op} of [{rows}, {cols}] {dt:?} (weight {wdt:?}, param grads {param_grads})");
    layer_norm_bwd_launch(t, p, rows, cols, blocks).run(ctx, what)?;
    let (dw, db) = match &partials {
        None => (None, None),
        Some((pw, pb)) => (
            Some(reduce_partials(ctx, t, pw, blocks, cols, kd, wdt, &what)?),
            Some(reduce_partials(ctx, t, pb, blocks, cols, kd, wdt, &what)?),
        ),
    };
    Ok(Some((rounded(dx, dt)?, dw, db)))
}

/// A row kernel of norms.cu: the pointers `p` in order, then `rows`, `cols` (i64) and, for the
/// forward kernels, `eps` (f32), on `grid` blocks of [`BLOCK_1D`] threads.
pub(crate) fn norm_launch(
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
        file: "norms.cu",
        entry,
        grid,
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

#[cfg(test)]
mod tests {
    use super::super::args::assert_known;
    use super::super::args::Kind::*;
    use super::*;

    #[test]
    fn forward_launches_match_the_kernel_signatures() {
        // layer_norm_fwd_<t>(const T *x, const T *w, const T *b, T *y, float *mean,
        //                    float *rstd, i64 rows, i64 cols, float eps)
        let l = layer_norm_fwd_launch("bf16", [1, 0, 0, 4, 5, 6], 10, 768, 1e-5);
        assert_eq!(l.entry, "layer_norm_fwd_bf16");
        assert_eq!(l.kinds(), vec![P, P, P, P, P, P, I64, I64, F32]);
        assert_eq!(l.args[1], Arg::Ptr(0));
        assert_eq!(l.args[6..], [Arg::I64(10), Arg::I64(768), Arg::F32(1e-5)]);
        assert_eq!(l.grid, (10, 1, 1));
        assert_known(&l);
    }

    #[test]
    fn backward_launches_match_the_kernel_signatures() {
        // layer_norm_bwd_<t>(x, w, const float *mean, const float *rstd, dy, dx,
        //                    float *dw_partial, float *db_partial, i64 rows, i64 cols)
        let blocks = norm_bwd_blocks(5000);
        assert_eq!(blocks, NORM_BWD_BLOCKS);
        let l = layer_norm_bwd_launch("f16", [1, 2, 3, 4, 5, 6, 7, 8], 5000, 128, blocks);
        assert_eq!(l.entry, "layer_norm_bwd_f16");
        assert_eq!(l.kinds(), vec![P, P, P, P, P, P, P, P, I64, I64]);
        assert_eq!(l.args[6], Arg::Ptr(7));
        assert_eq!(l.args[7], Arg::Ptr(8));
        // The partials have one row per block: the grid is exactly `blocks`.
        assert_eq!(l.grid, (NORM_BWD_BLOCKS as u32, 1, 1));
        assert_known(&l);
        assert_eq!(norm_bwd_blocks(0), 1);
        // norm_partials_reduce_<t>(const float *partial, i64 nparts, i64 cols, T *out,
        //                          int accumulate)
        let l = partials_reduce_launch("bf16", 1, 7, 300, 2, false);
        assert_eq!(l.entry, "norm_partials_reduce_bf16");
        assert_eq!(l.kinds(), vec![P, I64, I64, P, I32]);
        assert_eq!(
            l.args,
            vec![
                Arg::Ptr(1),
                Arg::I64(7),
                Arg::I64(300),
                Arg::Ptr(2),
                Arg::I32(0)
            ]
        );
        assert_eq!(l.grid, (2, 1, 1));
        assert_known(&l);
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
