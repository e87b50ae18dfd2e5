//! Cross-entropy on CUDA, forward and backward: the kernels `cross_entropy_fused_<t>` and
//! `cross_entropy_bwd_<t>` of `kernels/cuda/cross_entropy.cu`, with `ignore_index`.
//!
//! Logits f32, bf16 or f16 (computed in f32); f64 is not provided (`Ok(None)`: the composed
//! fallback runs). The
//! per-row `loss` and `lse` are f32, as the CPU backend returns them (compute precision).
//! Targets are read as i64 (u8 / u32 targets are widened on the host: a round trip that waits
//! for the stream).
//!
//! Target validation as the CPU: a target outside `0..cols` that is not `ignore_index` is an
//! error naming the row and the value. The kernel records the smallest such row in a device
//! word; the forward reads it back after the launch, so it waits for the stream (one 8-byte
//! copy per call).

use cudarc::driver::result;

use super::{CrossEntropy, CrossEntropyBackward};
use crate::cuda_backend::fused::args::{args, flat_grid, row_grid, sfx, Arg, Launch, BLOCK_1D};
use crate::cuda_backend::fused::operand::{
    as_dtype, check_len, contiguous, ids_i64, output, Operand,
};
use crate::cuda_backend::{CudaStorage, DeviceContext};
use crate::ops::fused::CudaIn;
use crate::{DType, Error, Result};

/// No bad row recorded: the initial value of the kernel's `bad` word.
const NO_BAD_ROW: u64 = u64::MAX;

/// `(ignore_index, has_ignore)` as the kernels take them.
fn ignore_args(ignore_index: Option<i64>) -> [Arg; 2] {
    args![i64 ignore_index.unwrap_or(0), i32 ignore_index.is_some() as i32]
}

/// `cross_entropy_fused_<t>(logits, targets, loss, lse, dlogits, dloss, dloss_scale, rows, cols,
/// ignore_index, has_ignore, bad)` for the forward only (`dlogits`, `dloss` null): one block per
/// row. `[logits, targets, loss, lse, bad]`.
pub(crate) fn ce_fwd_launch(
    t: &str,
    [logits, targets, loss, lse, bad]: [u64; 5],
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Launch {
    let mut args = args![ptr logits, ptr targets, ptr loss, ptr lse, ptr 0, ptr 0, f32 0.0, size rows, size cols].to_vec();
    args.extend(ignore_args(ignore_index));
    args.push(Arg::Ptr(bad));
    Launch {
        file: "cross_entropy.cu",
        entry: format!("cross_entropy_fused_{t}"),
        grid: row_grid(rows),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// `cross_entropy_bwd_<t>(logits, lse, targets, dloss, dloss_scale, dlogits, rows, cols,
/// ignore_index, has_ignore)`: one thread per logit. `[logits, lse, targets, dloss, dlogits]`.
pub(crate) fn ce_bwd_launch(
    t: &str,
    [logits, lse, targets, dloss, dlogits]: [u64; 5],
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Launch {
    let mut args = args![ptr logits, ptr lse, ptr targets, ptr dloss, f32 0.0, ptr dlogits, size rows, size cols].to_vec();
    args.extend(ignore_args(ignore_index));
    Launch {
        file: "cross_entropy.cu",
        entry: format!("cross_entropy_bwd_{t}"),
        grid: flat_grid(rows * cols),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// A device word set to [`NO_BAD_ROW`] (queued on the compute stream).
fn bad_word(ctx: &std::sync::Arc<DeviceContext>) -> Result<CudaStorage> {
    let w = output(ctx, DType::I64, 1)?;
    ctx.bind()?;
    // SAFETY: `w` owns 8 bytes at its address on this context; the memset is queued on the
    // compute stream before the kernel that reads the word.
    unsafe { result::memset_d8_async(w.device_ptr(), 0xff, 8, ctx.stream.cu_stream()) }
        .map_err(|e| ctx.err("cross_entropy: initialising the bad-target word", e))?;
    Ok(w)
}

/// Copies one 8-byte word at device address `src` to the host (waits for the stream).
fn read_word(ctx: &DeviceContext, src: u64, what: &str) -> Result<u64> {
    let mut v = [0u64; 1];
    ctx.bind()?;
    // SAFETY: `src` is the address of a live 8-byte element of a buffer of this context (the
    // caller's guarantee); `v` is 8 bytes and is read only after the stream is synchronised.
    unsafe { result::memcpy_dtoh_async(&mut v[..], src, ctx.stream.cu_stream()) }
        .map_err(|e| ctx.err(what, e))?;
    ctx.synchronize()?;
    Ok(v[0])
}

/// See [`CrossEntropy`]: `(loss, lse)`, f32 `[rows]`. `Ok(None)` for f64 logits.
pub(super) fn forward(a: &CrossEntropy<CudaIn<'_>>) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let (logits, targets, rows, cols, ignore_index) =
        (a.logits, a.targets, a.rows, a.cols, a.ignore_index);
    let dt = logits.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = "cross_entropy";
    check_len(op, "logits", logits.1, rows * cols)?;
    check_len(op, "targets", targets.1, rows)?;
    let (x, tg) = (
        contiguous(logits)?,
        ids_i64(targets, "cross_entropy (targets)")?,
    );
    let ctx = logits.0.ctx();
    let (loss, lse) = (
        output(ctx, DType::F32, rows)?,
        output(ctx, DType::F32, rows)?,
    );
    if rows == 0 {
        return Ok(Some((loss, lse)));
    }
    let bad = bad_word(ctx)?;
    let p = [
        x.ptr(),
        tg.ptr(),
        loss.device_ptr(),
        lse.device_ptr(),
        bad.device_ptr(),
    ];
    ce_fwd_launch(t, p, rows, cols, ignore_index).run(ctx, || {
        format!("{op} of [{rows}, {cols}] {dt:?} logits (ignore_index {ignore_index:?})")
    })?;
    check_targets(ctx, &bad, &tg, cols)?;
    Ok(Some((loss, lse)))
}

/// The CPU's error for the first out-of-range target, if the kernel recorded one.
fn check_targets(
    ctx: &DeviceContext,
    bad: &CudaStorage,
    targets: &Operand<'_>,
    cols: usize,
) -> Result<()> {
    let row = read_word(
        ctx,
        bad.device_ptr(),
        "cross_entropy: reading the bad-target word",
    )?;
    if row == NO_BAD_ROW {
        return Ok(());
    }
    let value = read_word(
        ctx,
        targets.ptr() + row * 8,
        "cross_entropy: reading a bad target",
    )? as i64;
    Err(Error::Msg(format!(
        "cross_entropy: target {value} at row {row} is outside 0..{cols}"
    )))
}

/// See [`CrossEntropyBackward`]: `dlogits` in the logits' dtype (`lse` and `dloss` read as f32,
/// converted when they are not). `Ok(None)` for f64 logits.
pub(super) fn backward(a: &CrossEntropyBackward<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    let (logits, lse, targets, dloss) = (a.logits, a.lse, a.targets, a.dloss);
    let (rows, cols, ignore_index) = (a.rows, a.cols, a.ignore_index);
    let dt = logits.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = "cross_entropy_backward";
    check_len(op, "logits", logits.1, rows * cols)?;
    check_len(op, "lse", lse.1, rows)?;
    check_len(op, "targets", targets.1, rows)?;
    check_len(op, "dloss", dloss.1, rows)?;
    let x = contiguous(logits)?;
    let l = as_dtype(lse, DType::F32)?;
    let tg = ids_i64(targets, "cross_entropy_backward (targets)")?;
    let g = as_dtype(dloss, DType::F32)?;
    let ctx = logits.0.ctx();
    let dx = output(ctx, dt, rows * cols)?;
    if rows * cols > 0 {
        let p = [x.ptr(), l.ptr(), tg.ptr(), g.ptr(), dx.device_ptr()];
        ce_bwd_launch(t, p, rows, cols, ignore_index).run(ctx, || {
            format!("{op} of [{rows}, {cols}] {dt:?} logits (ignore_index {ignore_index:?})")
        })?;
    }
    Ok(Some(dx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    #[test]
    fn forward_launch_matches_the_kernel_signature() {
        // cross_entropy_fused_<t>(const T *logits, const i64 *targets, float *loss, float *lse,
        //     T *dlogits, const float *dloss, float dloss_scale, i64 rows, i64 cols,
        //     i64 ignore_index, int has_ignore, u64 *bad)
        let l = ce_fwd_launch("bf16", [1, 2, 3, 4, 5], 8, 50257, Some(-100));
        assert_launch(
            &l,
            "cross_entropy_fused_bf16",
            &[P, P, P, P, P, P, F32, I64, I64, I64, I32, P],
        );
        assert_eq!(l.args[..4], args![ptr 1, ptr 2, ptr 3, ptr 4]);
        // Forward only: no dlogits, no dloss.
        assert_eq!(l.args[4..6], args![ptr 0, ptr 0]);
        assert_eq!(l.args[7..], args![i64 8, i64 50257, i64 -100, i32 1, ptr 5]);
        assert_eq!(l.grid, (8, 1, 1));
        let l = ce_fwd_launch("f32", [1, 2, 3, 4, 5], 8, 10, None);
        assert_eq!(l.args[9..11], args![i64 0, i32 0]);
    }

    #[test]
    fn backward_launch_matches_the_kernel_signature() {
        // cross_entropy_bwd_<t>(const T *logits, const float *lse, const i64 *targets,
        //     const float *dloss, float dloss_scale, T *dlogits, i64 rows, i64 cols,
        //     i64 ignore_index, int has_ignore)
        let l = ce_bwd_launch("f16", [1, 2, 3, 4, 5], 4, 100, Some(7));
        assert_launch(
            &l,
            "cross_entropy_bwd_f16",
            &[P, P, P, P, F32, P, I64, I64, I64, I32],
        );
        assert_eq!(
            l.args,
            args![ptr 1, ptr 2, ptr 3, ptr 4, f32 0.0, ptr 5, i64 4, i64 100, i64 7, i32 1]
        );
        assert_eq!(l.grid, (2, 1, 1));
    }
}
