//! Layer norm on CUDA, forward and backward: the kernels `layer_norm_fwd_<t>` and
//! `layer_norm_bwd_<t>` of `kernels/cuda/layer_norm.cu`, with the helpers the norms share
//! (`cuda_backend/fused/norm_partials.rs`: kernel dtype of mixed operands, statistics of empty rows, the
//! parameter-gradient partial sums).
//!
//! Dtypes: f32, bf16 and f16 data (computed in f32); f64 is not provided (`Ok(None)`: the
//! composed fallback runs). `mean` and `rstd` are f32 `[rows]` for every data dtype, as on the
//! CPU.

use super::{Grads, LayerNorm, LayerNormBackward};
use crate::cuda_backend::fused::args::{row_grid, sfx, Launch};
use crate::cuda_backend::fused::norm_partials::{
    empty_row_stats, kernel_dtype, norm_bwd_blocks, norm_launch, param, reduce_partials, rounded,
};
use crate::cuda_backend::fused::operand::{as_dtype, check_len, output, ptr_or_null};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::{DType, Result};

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
        "layer_norm.cu",
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
        "layer_norm.cu",
        format!("layer_norm_bwd_{t}"),
        &p,
        rows,
        cols,
        (blocks as u32, 1, 1),
        None,
    )
}

/// See [`LayerNorm`]: `(y, mean, rstd)`, `y` in `x`'s dtype, `mean` and `rstd` f32 `[rows]`.
/// `Ok(None)` for f64 operands.
pub(super) fn forward(
    a: &LayerNorm<CudaIn<'_>>,
) -> Result<Option<(CudaStorage, CudaStorage, CudaStorage)>> {
    let (x, w, b, rows, cols, eps) = (a.x, a.w, a.b, a.rows, a.cols, a.eps);
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

/// See [`LayerNormBackward`]: `(dx, dweight, dbias)`, `dx` in `x`'s dtype, the parameter
/// gradients (when `param_grads`) in the weight's dtype (`x`'s without a weight). `Ok(None)` for
/// f64 operands.
pub(super) fn backward(a: &LayerNormBackward<CudaIn<'_>>) -> Result<Option<Grads<CudaStorage>>> {
    let (x, w, mean, rstd, dy) = (a.x, a.w, a.mean, a.rstd, a.dy);
    let (rows, cols, param_grads) = (a.rows, a.cols, a.param_grads);
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
            Some(reduce_partials(ctx, pw, blocks, cols, kd, wdt, &what)?),
            Some(reduce_partials(ctx, pb, blocks, cols, kd, wdt, &what)?),
        ),
    };
    Ok(Some((rounded(dx, dt)?, dw, db)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::args;
    use crate::cuda_backend::fused::args::Kind::*;
    use crate::cuda_backend::fused::args::{assert_launch, Arg};
    use crate::cuda_backend::fused::norm_partials::NORM_BWD_BLOCKS;

    #[test]
    fn forward_launch_matches_the_kernel_signature() {
        // layer_norm_fwd_<t>(const T *x, const T *w, const T *b, T *y, float *mean,
        //                    float *rstd, i64 rows, i64 cols, float eps)
        let l = layer_norm_fwd_launch("bf16", [1, 0, 0, 4, 5, 6], 10, 768, 1e-5);
        assert_launch(
            &l,
            "layer_norm_fwd_bf16",
            &[P, P, P, P, P, P, I64, I64, F32],
        );
        assert_eq!(l.args[1], Arg::Ptr(0));
        assert_eq!(l.args[6..], args![i64 10, i64 768, f32 1e-5]);
        assert_eq!(l.grid, (10, 1, 1));
    }

    #[test]
    fn backward_launch_matches_the_kernel_signature() {
        // layer_norm_bwd_<t>(x, w, const float *mean, const float *rstd, dy, dx,
        //                    float *dw_partial, float *db_partial, i64 rows, i64 cols)
        let blocks = norm_bwd_blocks(5000);
        assert_eq!(blocks, NORM_BWD_BLOCKS);
        let l = layer_norm_bwd_launch("f16", [1, 2, 3, 4, 5, 6, 7, 8], 5000, 128, blocks);
        assert_launch(
            &l,
            "layer_norm_bwd_f16",
            &[P, P, P, P, P, P, P, P, I64, I64],
        );
        assert_eq!(l.args[6], Arg::Ptr(7));
        assert_eq!(l.args[7], Arg::Ptr(8));
        // The partials have one row per block: the grid is exactly `blocks`.
        assert_eq!(l.grid, (NORM_BWD_BLOCKS as u32, 1, 1));
    }
}
