//! RMSNorm on CUDA, forward and backward: the kernels `rms_norm_fwd_<t>` and `rms_norm_bwd_<t>`
//! of `kernels/cuda/rms_norm.cu`, with the helpers the norms share (`cuda_backend/fused/norm_partials.rs`:
//! kernel dtype of mixed operands, statistics of empty rows, the weight-gradient partial sums).
//!
//! Dtypes: f32, bf16 and f16 data (computed in f32); f64 is not provided (`Ok(None)`: the
//! composed fallback runs). `rstd` is f32 `[rows]` for every data dtype, as on the CPU.

use super::{RmsNorm, RmsNormBackward};
use crate::cuda_backend::fused::args::{row_grid, sfx, Launch};
use crate::cuda_backend::fused::norm_partials::{
    empty_row_stats, kernel_dtype, norm_bwd_blocks, norm_launch, param, reduce_partials, rounded,
};
use crate::cuda_backend::fused::operand::{as_dtype, check_len, output, ptr_or_null};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::{DType, Result};

/// `rms_norm_fwd_<t>(x, w, y, rstd, rows, cols, eps)`; `[x, w, y, rstd]` (w: 0 when absent).
pub(crate) fn rms_norm_fwd_launch(
    t: &str,
    p: [u64; 4],
    rows: usize,
    cols: usize,
    eps: f64,
) -> Launch {
    norm_launch(
        "rms_norm.cu",
        format!("rms_norm_fwd_{t}"),
        &p,
        rows,
        cols,
        row_grid(rows),
        Some(eps),
    )
}

/// `rms_norm_bwd_<t>(x, w, rstd, dy, dx, dw_partial, rows, cols)` on `blocks` blocks;
/// `[x, w, rstd, dy, dx, dw_partial]`.
pub(crate) fn rms_norm_bwd_launch(
    t: &str,
    p: [u64; 6],
    rows: usize,
    cols: usize,
    blocks: usize,
) -> Launch {
    norm_launch(
        "rms_norm.cu",
        format!("rms_norm_bwd_{t}"),
        &p,
        rows,
        cols,
        (blocks as u32, 1, 1),
        None,
    )
}

/// See [`RmsNorm`]: `(y, rstd)`, `y` in `x`'s dtype, `rstd` f32 `[rows]`. `Ok(None)` for f64
/// operands.
pub(super) fn forward(a: &RmsNorm<CudaIn<'_>>) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let (x, w, rows, cols, eps) = (a.x, a.w, a.rows, a.cols, a.eps);
    let dt = x.0.dtype();
    let pdts: Vec<DType> = w.iter().map(|p| p.0.dtype()).collect();
    let Some(kd) = kernel_dtype(dt, &pdts) else {
        return Ok(None);
    };
    let t = sfx(kd).unwrap_or("f32");
    let op = "rms_norm";
    check_len(op, "x", x.1, rows * cols)?;
    if let Some(w) = w {
        check_len(op, "weight", w.1, cols)?;
    }
    let ctx = x.0.ctx();
    if cols == 0 {
        let (_, rstd) = empty_row_stats(ctx, rows, eps)?;
        return Ok(Some((output(ctx, dt, 0)?, rstd)));
    }
    let (xo, wo) = (as_dtype(x, kd)?, param(w, kd)?);
    let y = output(ctx, kd, rows * cols)?;
    let rstd = output(ctx, DType::F32, rows)?;
    let p = [
        xo.ptr(),
        ptr_or_null(&wo),
        y.device_ptr(),
        rstd.device_ptr(),
    ];
    rms_norm_fwd_launch(t, p, rows, cols, eps).run(ctx, || {
        format!("{op} of [{rows}, {cols}] {dt:?} (weight dtype {pdts:?}, eps {eps})")
    })?;
    Ok(Some((rounded(y, dt)?, rstd)))
}

/// See [`RmsNormBackward`]: `(dx, dweight)`, `dx` in `x`'s dtype, `dweight` (when
/// `weight_grad`) in the weight's dtype (`x`'s without a weight). `Ok(None)` for f64 operands.
pub(super) fn backward(
    a: &RmsNormBackward<CudaIn<'_>>,
) -> Result<Option<(CudaStorage, Option<CudaStorage>)>> {
    let (x, w, rstd, dy) = (a.x, a.w, a.rstd, a.dy);
    let (rows, cols, weight_grad) = (a.rows, a.cols, a.weight_grad);
    let dt = x.0.dtype();
    let wdt = w.map_or(dt, |w| w.0.dtype());
    let Some(kd) = kernel_dtype(dt, &[wdt]) else {
        return Ok(None);
    };
    let t = sfx(kd).unwrap_or("f32");
    let op = "rms_norm_backward";
    check_len(op, "x", x.1, rows * cols)?;
    check_len(op, "dy", dy.1, rows * cols)?;
    check_len(op, "rstd", rstd.1, rows)?;
    if let Some(w) = w {
        check_len(op, "weight", w.1, cols)?;
    }
    let (xo, go, wo) = (as_dtype(x, kd)?, as_dtype(dy, kd)?, param(w, kd)?);
    let ro = as_dtype(rstd, DType::F32)?;
    let ctx = x.0.ctx();
    let dx = output(ctx, kd, rows * cols)?;
    let blocks = norm_bwd_blocks(rows);
    let partial = if weight_grad {
        Some(output(ctx, DType::F32, blocks * cols)?)
    } else {
        None
    };
    let p = [
        xo.ptr(),
        ptr_or_null(&wo),
        ro.ptr(),
        go.ptr(),
        dx.device_ptr(),
        partial.as_ref().map_or(0, CudaStorage::device_ptr),
    ];
    let what =
        || format!("{op} of [{rows}, {cols}] {dt:?} (weight {wdt:?}, weight grad {weight_grad})");
    rms_norm_bwd_launch(t, p, rows, cols, blocks).run(ctx, what)?;
    let dw = match &partial {
        None => None,
        Some(pw) => Some(reduce_partials(ctx, pw, blocks, cols, kd, wdt, &what)?),
    };
    Ok(Some((rounded(dx, dt)?, dw)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::Kind::*;
    use crate::cuda_backend::fused::args::{assert_launch, Arg};

    #[test]
    fn launches_match_the_kernel_signatures() {
        // rms_norm_fwd_<t>(const T *x, const T *w, T *y, float *rstd, i64 rows, i64 cols,
        //                  float eps)
        let l = rms_norm_fwd_launch("f32", [1, 2, 3, 4], 3, 64, 1e-6);
        assert_launch(&l, "rms_norm_fwd_f32", &[P, P, P, P, I64, I64, F32]);
        assert_eq!(l.args[3], Arg::Ptr(4));
        // rms_norm_bwd_<t>(x, w, const float *rstd, dy, dx, float *dw_partial, i64 rows,
        //                  i64 cols)
        let l = rms_norm_bwd_launch("f32", [1, 2, 3, 4, 5, 6], 3, 64, norm_bwd_blocks(3));
        assert_launch(&l, "rms_norm_bwd_f32", &[P, P, P, P, P, P, I64, I64]);
        assert_eq!(l.grid, (3, 1, 1));
    }
}
