//! Softmax and log-softmax on CUDA, forward and backward: the kernels
//! `{softmax,log_softmax}_{fwd,bwd}_<t>` of `kernels/cuda/softmax.cu`, one block per row. f32,
//! bf16 and f16 (computed in f32); f64 is not provided (`Ok(None)`: the composed fallback runs).

use super::{Softmax, SoftmaxBackward};
use crate::cuda_backend::fused::args::{i64_of, row_grid, sfx, Arg, Launch, BLOCK_1D};
use crate::cuda_backend::fused::operand::{as_dtype, check_len, contiguous, output};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// A row kernel of softmax.cu: `<name>_<dir>_<t>(ptrs..., rows, cols)`, `name` `softmax` or
/// `log_softmax` as `log` says, one block per row.
fn row_launch(t: &str, log: bool, dir: &str, ptrs: &[u64], rows: usize, cols: usize) -> Launch {
    let name = if log { "log_softmax" } else { "softmax" };
    let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::Ptr(p)).collect();
    args.extend([i64_of(rows), i64_of(cols)]);
    Launch {
        file: "softmax.cu",
        entry: format!("{name}_{dir}_{t}"),
        grid: row_grid(rows),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// `softmax_fwd_<t>` / `log_softmax_fwd_<t>(x, y, rows, cols)`.
pub(crate) fn softmax_fwd_launch(
    t: &str,
    log: bool,
    [x, y]: [u64; 2],
    rows: usize,
    cols: usize,
) -> Launch {
    row_launch(t, log, "fwd", &[x, y], rows, cols)
}

/// `softmax_bwd_<t>` / `log_softmax_bwd_<t>(y, dy, dx, rows, cols)`.
pub(crate) fn softmax_bwd_launch(
    t: &str,
    log: bool,
    [y, dy, dx]: [u64; 3],
    rows: usize,
    cols: usize,
) -> Launch {
    row_launch(t, log, "bwd", &[y, dy, dx], rows, cols)
}

/// See [`Softmax`]: f32 / bf16 / f16, `Ok(None)` for f64.
pub(super) fn forward(
    &Softmax { x, rows, cols, log }: &Softmax<CudaIn<'_>>,
) -> Result<Option<CudaStorage>> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = if log { "log_softmax" } else { "softmax" };
    check_len(op, "x", x.1, rows * cols)?;
    let xo = contiguous(x)?;
    let ctx = x.0.ctx();
    let y = output(ctx, dt, rows * cols)?;
    softmax_fwd_launch(t, log, [xo.ptr(), y.device_ptr()], rows, cols)
        .run(ctx, || format!("{op} of [{rows}, {cols}] {dt:?}"))?;
    Ok(Some(y))
}

/// See [`SoftmaxBackward`]: f32 / bf16 / f16 (`dy` converted to `y`'s dtype if it differs),
/// `Ok(None)` for f64.
pub(super) fn backward(
    &SoftmaxBackward {
        y,
        dy,
        rows,
        cols,
        log,
    }: &SoftmaxBackward<CudaIn<'_>>,
) -> Result<Option<CudaStorage>> {
    let dt = y.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = if log {
        "log_softmax_backward"
    } else {
        "softmax_backward"
    };
    check_len(op, "y", y.1, rows * cols)?;
    check_len(op, "dy", dy.1, rows * cols)?;
    let (yo, go) = (contiguous(y)?, as_dtype(dy, dt)?);
    let ctx = y.0.ctx();
    let dx = output(ctx, dt, rows * cols)?;
    softmax_bwd_launch(t, log, [yo.ptr(), go.ptr(), dx.device_ptr()], rows, cols)
        .run(ctx, || format!("{op} of [{rows}, {cols}] {dt:?}"))?;
    Ok(Some(dx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::args;
    use crate::cuda_backend::fused::args::Kind::*;
    use crate::cuda_backend::fused::args::{assert_known, assert_launch};

    #[test]
    fn launches_match_the_kernel_signatures() {
        // softmax_fwd_<t>(const T *x, T *y, i64 rows, i64 cols)
        let l = softmax_fwd_launch("bf16", false, [10, 20], 3, 5);
        assert_launch(&l, "softmax_fwd_bf16", &[P, P, I64, I64]);
        assert_eq!(l.args, args![ptr 10, ptr 20, i64 3, i64 5]);
        assert_eq!(l.grid, (3, 1, 1));
        assert_eq!(
            softmax_fwd_launch("f32", true, [1, 2], 0, 5).entry,
            "log_softmax_fwd_f32"
        );
        // softmax_bwd_<t>(const T *y, const T *dy, T *dx, i64 rows, i64 cols)
        let l = softmax_bwd_launch("f16", true, [1, 2, 3], 4, 6);
        assert_launch(&l, "log_softmax_bwd_f16", &[P, P, P, I64, I64]);
        assert_eq!(l.args, args![ptr 1, ptr 2, ptr 3, i64 4, i64 6]);
        for l in [
            softmax_fwd_launch("f32", false, [1, 2], 3, 4),
            softmax_bwd_launch("bf16", false, [1, 2, 3], 4, 5),
        ] {
            assert_known(&l);
        }
    }
}
