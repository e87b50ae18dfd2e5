//! Row softmax / log-softmax forward and backward (softmax.cu) and log-sum-exp over one
//! dimension (reduce.cu's `logsumexp_*` kernels). Softmax: f32, bf16 and f16 (computed in f32);
//! for f64 `Ok(None)` (the tensor op falls back to its composition of basic ops, which take
//! f64). Log-sum-exp: those and f64 (computed in f64).

use super::args::{i64_of, row_grid, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{as_dtype, check_len, contiguous, output};
use crate::backend::api::{Fused, In};
use crate::cuda_backend::CudaStorage;

/// `softmax_fwd_<t>` / `log_softmax_fwd_<t>(x, y, rows, cols)`: one block per row.
pub(crate) fn softmax_fwd_launch(
    t: &str,
    log: bool,
    x: u64,
    y: u64,
    rows: usize,
    cols: usize,
) -> Launch {
    let name = if log { "log_softmax" } else { "softmax" };
    Launch {
        file: "softmax.cu",
        entry: format!("{name}_fwd_{t}"),
        grid: row_grid(rows),
        block: BLOCK_1D,
        shared: 0,
        args: vec![Arg::Ptr(x), Arg::Ptr(y), i64_of(rows), i64_of(cols)],
    }
}

/// `softmax_bwd_<t>` / `log_softmax_bwd_<t>(y, dy, dx, rows, cols)`: one block per row.
pub(crate) fn softmax_bwd_launch(
    t: &str,
    log: bool,
    y: u64,
    dy: u64,
    dx: u64,
    rows: usize,
    cols: usize,
) -> Launch {
    let name = if log { "log_softmax" } else { "softmax" };
    Launch {
        file: "softmax.cu",
        entry: format!("{name}_bwd_{t}"),
        grid: row_grid(rows),
        block: BLOCK_1D,
        shared: 0,
        args: vec![
            Arg::Ptr(y),
            Arg::Ptr(dy),
            Arg::Ptr(dx),
            i64_of(rows),
            i64_of(cols),
        ],
    }
}

/// `logsumexp_lastdim_<t>(x, out, rows, red)` (one block per row) when `inner == 1`, else
/// `logsumexp_strided_<t>(x, out, outer, red, inner)` (one thread per output).
pub(crate) fn logsumexp_launch(
    t: &str,
    x: u64,
    out: u64,
    outer: usize,
    red: usize,
    inner: usize,
) -> Launch {
    if inner == 1 {
        Launch {
            file: "reduce.cu",
            entry: format!("logsumexp_lastdim_{t}"),
            grid: row_grid(outer),
            block: BLOCK_1D,
            shared: 0,
            args: vec![Arg::Ptr(x), Arg::Ptr(out), i64_of(outer), i64_of(red)],
        }
    } else {
        Launch {
            file: "reduce.cu",
            entry: format!("logsumexp_strided_{t}"),
            grid: super::args::flat_grid(outer * inner),
            block: BLOCK_1D,
            shared: 0,
            args: vec![
                Arg::Ptr(x),
                Arg::Ptr(out),
                i64_of(outer),
                i64_of(red),
                i64_of(inner),
            ],
        }
    }
}

/// See `BackendStorage::softmax`: f32 / bf16 / f16, `Ok(None)` for f64.
pub(in crate::cuda_backend) fn softmax(
    x: In<'_, CudaStorage>,
    rows: usize,
    cols: usize,
    log: bool,
) -> Fused<CudaStorage> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = if log { "log_softmax" } else { "softmax" };
    check_len(op, "x", x.1, rows * cols)?;
    let xo = contiguous(x)?;
    let ctx = x.0.ctx();
    let y = output(ctx, dt, rows * cols)?;
    softmax_fwd_launch(t, log, xo.ptr(), y.device_ptr(), rows, cols)
        .run(ctx, || format!("{op} of [{rows}, {cols}] {dt:?}"))?;
    Ok(Some(y))
}

/// See `BackendStorage::softmax_backward`: f32 / bf16 / f16 (`dy` converted to `y`'s dtype if
/// it differs), `Ok(None)` for f64.
pub(in crate::cuda_backend) fn softmax_backward(
    y: In<'_, CudaStorage>,
    dy: In<'_, CudaStorage>,
    rows: usize,
    cols: usize,
    log: bool,
) -> Fused<CudaStorage> {
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
    softmax_bwd_launch(t, log, yo.ptr(), go.ptr(), dx.device_ptr(), rows, cols)
        .run(ctx, || format!("{op} of [{rows}, {cols}] {dt:?}"))?;
    Ok(Some(dx))
}

/// See `BackendStorage::logsumexp`: the result in the input's dtype (f32 / bf16 / f16, computed
/// in f32; f64 in f64).
pub(in crate::cuda_backend) fn logsumexp(
    x: In<'_, CudaStorage>,
    outer: usize,
    red: usize,
    inner: usize,
) -> Fused<CudaStorage> {
    let dt = x.0.dtype();
    // reduce.cu instantiates log-sum-exp with the basic kernels' dtypes.
    let Ok(t) = crate::cuda_backend::basic::basic_sfx("logsumexp", dt) else {
        return Ok(None);
    };
    check_len("logsumexp", "x", x.1, outer * red * inner)?;
    let xo = contiguous(x)?;
    let ctx = x.0.ctx();
    let out = output(ctx, dt, outer * inner)?;
    if outer * inner > 0 {
        logsumexp_launch(t, xo.ptr(), out.device_ptr(), outer, red, inner).run(ctx, || {
            format!("logsumexp over [{outer}, {red}, {inner}] {dt:?}")
        })?;
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::super::args::assert_known;
    use super::super::args::Kind::*;
    use super::*;

    #[test]
    fn softmax_launches_match_the_kernel_signatures() {
        // softmax_fwd_<t>(const T *x, T *y, i64 rows, i64 cols)
        let l = softmax_fwd_launch("bf16", false, 10, 20, 3, 5);
        assert_eq!(l.entry, "softmax_fwd_bf16");
        assert_eq!(l.kinds(), vec![P, P, I64, I64]);
        assert_eq!(l.args[0], Arg::Ptr(10));
        assert_eq!(l.args[1], Arg::Ptr(20));
        assert_eq!(l.args[2], Arg::I64(3));
        assert_eq!(l.args[3], Arg::I64(5));
        assert_eq!(l.grid, (3, 1, 1));
        assert_eq!(
            softmax_fwd_launch("f32", true, 1, 2, 0, 5).entry,
            "log_softmax_fwd_f32"
        );
        // softmax_bwd_<t>(const T *y, const T *dy, T *dx, i64 rows, i64 cols)
        let l = softmax_bwd_launch("f16", true, 1, 2, 3, 4, 6);
        assert_eq!(l.entry, "log_softmax_bwd_f16");
        assert_eq!(l.kinds(), vec![P, P, P, I64, I64]);
        assert_eq!(
            l.args,
            vec![
                Arg::Ptr(1),
                Arg::Ptr(2),
                Arg::Ptr(3),
                Arg::I64(4),
                Arg::I64(6)
            ]
        );
        for l in [
            softmax_fwd_launch("f32", false, 1, 2, 3, 4),
            softmax_bwd_launch("bf16", false, 1, 2, 3, 4, 5),
        ] {
            assert_known(&l);
        }
    }

    #[test]
    fn logsumexp_picks_the_lastdim_or_strided_kernel() {
        // logsumexp_lastdim_<t>(const T *x, T *out, i64 rows, i64 red)
        let l = logsumexp_launch("f32", 1, 2, 7, 9, 1);
        assert_eq!(l.entry, "logsumexp_lastdim_f32");
        assert_eq!(l.kinds(), vec![P, P, I64, I64]);
        assert_eq!(l.args[2..], [Arg::I64(7), Arg::I64(9)]);
        assert_eq!(l.grid, (7, 1, 1));
        // logsumexp_strided_<t>(const T *x, T *out, i64 outer, i64 red, i64 inner)
        let l = logsumexp_launch("bf16", 1, 2, 7, 9, 300);
        assert_eq!(l.entry, "logsumexp_strided_bf16");
        assert_eq!(l.kinds(), vec![P, P, I64, I64, I64]);
        assert_eq!(l.args[2..], [Arg::I64(7), Arg::I64(9), Arg::I64(300)]);
        assert_eq!(l.grid, (2100usize.div_ceil(256) as u32, 1, 1));
        assert_known(&l);
    }
}
