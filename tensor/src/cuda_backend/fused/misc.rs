//! Elementwise fused ops (activations.cu: GELU backward, the SiLU / clamp backward, SwiGLU
//! forward and backward) and rotary position embedding (rotary.cu). f32, bf16 and f16 (computed
//! in f32); f64 is not provided on CUDA (`Ok(None)`).

use meshgrad_kernels::cuda::unary_grad;
use meshgrad_kernels::ops::UnaryGrad;

use super::args::{flat_grid, i64_of, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{as_dtype, check_len, contiguous, ids_i64, output};
use crate::backend::api::{Fused, In};
use crate::cuda_backend::CudaStorage;

/// A grid-stride launch of `entry` of activations.cu over `n` elements.
fn act_launch(entry: String, n: usize, args: Vec<Arg>) -> Launch {
    Launch {
        file: "activations.cu",
        entry,
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// `gelu_bwd_<t>(x, dy, dx, n, tanh_form)`.
pub(crate) fn gelu_bwd_launch(t: &str, x: u64, dy: u64, dx: u64, n: usize, tanh: bool) -> Launch {
    act_launch(
        format!("gelu_bwd_{t}"),
        n,
        vec![
            Arg::Ptr(x),
            Arg::Ptr(dy),
            Arg::Ptr(dx),
            i64_of(n),
            Arg::I32(tanh as i32),
        ],
    )
}

/// `unary_bwd_<t>(x, dy, dx, n, op, lo, hi)`: op 0 SiLU, 1 clamp to `[lo, hi]`.
pub(crate) fn unary_bwd_launch(
    t: &str,
    x: u64,
    dy: u64,
    dx: u64,
    n: usize,
    op: UnaryGrad,
) -> Launch {
    let (code, lo, hi) = match op {
        UnaryGrad::Silu => (unary_grad::SILU, 0.0, 0.0),
        UnaryGrad::Clamp(lo, hi) => (unary_grad::CLAMP, lo, hi),
    };
    act_launch(
        format!("unary_bwd_{t}"),
        n,
        vec![
            Arg::Ptr(x),
            Arg::Ptr(dy),
            Arg::Ptr(dx),
            i64_of(n),
            Arg::I32(code),
            Arg::F64(lo),
            Arg::F64(hi),
        ],
    )
}

/// `swiglu_fwd_<t>(gate, up, out, n)`.
pub(crate) fn swiglu_fwd_launch(t: &str, gate: u64, up: u64, out: u64, n: usize) -> Launch {
    act_launch(
        format!("swiglu_fwd_{t}"),
        n,
        vec![Arg::Ptr(gate), Arg::Ptr(up), Arg::Ptr(out), i64_of(n)],
    )
}

/// `swiglu_bwd_<t>(gate, up, dy, dgate, dup, n)`.
pub(crate) fn swiglu_bwd_launch(t: &str, [gate, up, dy, dgate, dup]: [u64; 5], n: usize) -> Launch {
    act_launch(
        format!("swiglu_bwd_{t}"),
        n,
        vec![
            Arg::Ptr(gate),
            Arg::Ptr(up),
            Arg::Ptr(dy),
            Arg::Ptr(dgate),
            Arg::Ptr(dup),
            i64_of(n),
        ],
    )
}

/// `rotary_<t>(x, positions, out, batch, seq, heads, head_dim, theta, inverse)` over
/// `[batch, seq, heads, head_dim]`, one thread per pair.
pub(crate) fn rotary_launch(
    t: &str,
    x: u64,
    positions: u64,
    out: u64,
    [b, s, h, d]: [usize; 4],
    theta: f64,
    inverse: bool,
) -> Launch {
    Launch {
        file: "rotary.cu",
        entry: format!("rotary_{t}"),
        grid: flat_grid(b * s * h * (d / 2)),
        block: BLOCK_1D,
        shared: 0,
        args: vec![
            Arg::Ptr(x),
            Arg::Ptr(positions),
            Arg::Ptr(out),
            i64_of(b),
            i64_of(s),
            i64_of(h),
            i64_of(d),
            Arg::F64(theta),
            Arg::I32(inverse as i32),
        ],
    }
}

/// See `BackendStorage::gelu_backward`: `dy` converted to `x`'s dtype if it differs; `Ok(None)`
/// for f64.
pub(in crate::cuda_backend) fn gelu_backward(
    x: In<'_, CudaStorage>,
    dy: In<'_, CudaStorage>,
    tanh_form: bool,
) -> Fused<CudaStorage> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let n = x.1.shape().elem_count();
    check_len("gelu_backward", "dy", dy.1, n)?;
    let (xo, go) = (contiguous(x)?, as_dtype(dy, dt)?);
    let ctx = x.0.ctx();
    let dx = output(ctx, dt, n)?;
    if n > 0 {
        gelu_bwd_launch(t, xo.ptr(), go.ptr(), dx.device_ptr(), n, tanh_form)
            .run(ctx, || format!("gelu_backward of {} {dt:?}", x.1.shape()))?;
    }
    Ok(Some(dx))
}

/// See `BackendStorage::unary_backward`: SiLU and clamp; `Ok(None)` for f64.
pub(in crate::cuda_backend) fn unary_backward(
    x: In<'_, CudaStorage>,
    dy: In<'_, CudaStorage>,
    op: UnaryGrad,
) -> Fused<CudaStorage> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let n = x.1.shape().elem_count();
    check_len("unary_backward", "dy", dy.1, n)?;
    let (xo, go) = (contiguous(x)?, as_dtype(dy, dt)?);
    let ctx = x.0.ctx();
    let dx = output(ctx, dt, n)?;
    if n > 0 {
        unary_bwd_launch(t, xo.ptr(), go.ptr(), dx.device_ptr(), n, op).run(ctx, || {
            format!("unary_backward {op:?} of {} {dt:?}", x.1.shape())
        })?;
    }
    Ok(Some(dx))
}

/// See `BackendStorage::swiglu`: `up` converted to `gate`'s dtype if it differs; `Ok(None)` for
/// f64.
pub(in crate::cuda_backend) fn swiglu(
    gate: In<'_, CudaStorage>,
    up: In<'_, CudaStorage>,
) -> Fused<CudaStorage> {
    let dt = gate.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let n = gate.1.shape().elem_count();
    check_len("swiglu", "up", up.1, n)?;
    let (g, u) = (contiguous(gate)?, as_dtype(up, dt)?);
    let ctx = gate.0.ctx();
    let out = output(ctx, dt, n)?;
    if n > 0 {
        swiglu_fwd_launch(t, g.ptr(), u.ptr(), out.device_ptr(), n)
            .run(ctx, || format!("swiglu of {} {dt:?}", gate.1.shape()))?;
    }
    Ok(Some(out))
}

/// See `BackendStorage::swiglu_backward`: `(dgate, dup)` in `gate`'s dtype; `Ok(None)` for f64.
pub(in crate::cuda_backend) fn swiglu_backward(
    gate: In<'_, CudaStorage>,
    up: In<'_, CudaStorage>,
    dy: In<'_, CudaStorage>,
) -> Fused<(CudaStorage, CudaStorage)> {
    let dt = gate.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let n = gate.1.shape().elem_count();
    check_len("swiglu_backward", "up", up.1, n)?;
    check_len("swiglu_backward", "dy", dy.1, n)?;
    let (g, u, d) = (contiguous(gate)?, as_dtype(up, dt)?, as_dtype(dy, dt)?);
    let ctx = gate.0.ctx();
    let (dg, du) = (output(ctx, dt, n)?, output(ctx, dt, n)?);
    if n > 0 {
        let ptrs = [g.ptr(), u.ptr(), d.ptr(), dg.device_ptr(), du.device_ptr()];
        swiglu_bwd_launch(t, ptrs, n).run(ctx, || {
            format!("swiglu_backward of {} {dt:?}", gate.1.shape())
        })?;
    }
    Ok(Some((dg, du)))
}

/// See `BackendStorage::rotary_embedding` (`x` is `[B, T, H, D]`, `dims` those four sizes, `D`
/// even; integer positions `[T]` are widened to i64); `Ok(None)` for f64.
pub(in crate::cuda_backend) fn rotary_embedding(
    x: In<'_, CudaStorage>,
    positions: In<'_, CudaStorage>,
    dims: [usize; 4],
    theta: f64,
    inverse: bool,
) -> Fused<CudaStorage> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = "rotary_embedding";
    let n: usize = dims.iter().product();
    check_len(op, "x", x.1, n)?;
    check_len(op, "positions", positions.1, dims[1])?;
    if !dims[3].is_multiple_of(2) {
        return Err(crate::Error::Msg(format!(
            "{op} (CUDA): head dim {} of x {dims:?} must be even",
            dims[3]
        )));
    }
    let (xo, po) = (
        contiguous(x)?,
        ids_i64(positions, "rotary_embedding (positions)")?,
    );
    let ctx = x.0.ctx();
    let out = output(ctx, dt, n)?;
    if n > 0 {
        rotary_launch(
            t,
            xo.ptr(),
            po.ptr(),
            out.device_ptr(),
            dims,
            theta,
            inverse,
        )
        .run(ctx, || {
            format!("{op} (inverse {inverse}) of [B, T, H, D] = {dims:?} {dt:?}")
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
    fn activation_launches_match_the_kernel_signatures() {
        // gelu_bwd_<t>(const T *x, const T *dy, T *dx, i64 n, int tanh_form)
        let l = gelu_bwd_launch("f32", 1, 2, 3, 1000, true);
        assert_eq!(l.entry, "gelu_bwd_f32");
        assert_eq!(l.kinds(), vec![P, P, P, I64, I32]);
        assert_eq!(l.args[3..], [Arg::I64(1000), Arg::I32(1)]);
        assert_eq!(l.grid, (4, 1, 1));
        assert_known(&l);
        // unary_bwd_<t>(const T *x, const T *dy, T *dx, i64 n, int op, double lo, double hi)
        let l = unary_bwd_launch("bf16", 1, 2, 3, 5, UnaryGrad::Clamp(-1.5, f64::INFINITY));
        assert_eq!(l.entry, "unary_bwd_bf16");
        assert_eq!(l.kinds(), vec![P, P, P, I64, I32, F64, F64]);
        assert_eq!(
            l.args[3..],
            [
                Arg::I64(5),
                Arg::I32(1),
                Arg::F64(-1.5),
                Arg::F64(f64::INFINITY)
            ]
        );
        assert_known(&l);
        let l = unary_bwd_launch("f16", 1, 2, 3, 5, UnaryGrad::Silu);
        assert_eq!(l.args[4], Arg::I32(0));
        // swiglu_fwd_<t>(const T *gate, const T *up, T *out, i64 n)
        let l = swiglu_fwd_launch("f16", 1, 2, 3, 9);
        assert_eq!(l.entry, "swiglu_fwd_f16");
        assert_eq!(l.kinds(), vec![P, P, P, I64]);
        assert_known(&l);
        // swiglu_bwd_<t>(gate, up, dy, dgate, dup, i64 n)
        let l = swiglu_bwd_launch("f32", [1, 2, 3, 4, 5], 9);
        assert_eq!(l.entry, "swiglu_bwd_f32");
        assert_eq!(l.kinds(), vec![P, P, P, P, P, I64]);
        assert_eq!(
            l.args,
            vec![
                Arg::Ptr(1),
                Arg::Ptr(2),
                Arg::Ptr(3),
                Arg::Ptr(4),
                Arg::Ptr(5),
                Arg::I64(9)
            ]
        );
        assert_known(&l);
    }

    #[test]
    fn rotary_launch_matches_the_kernel_signature() {
        // rotary_<t>(const T *x, const i64 *positions, T *out, i64 batch, i64 seq, i64 heads,
        //            i64 head_dim, double theta, int inverse)
        let l = rotary_launch("bf16", 1, 2, 3, [2, 8, 4, 64], 10000.0, true);
        assert_eq!(l.entry, "rotary_bf16");
        assert_eq!(l.kinds(), vec![P, P, P, I64, I64, I64, I64, F64, I32]);
        assert_eq!(
            l.args[3..],
            [
                Arg::I64(2),
                Arg::I64(8),
                Arg::I64(4),
                Arg::I64(64),
                Arg::F64(10000.0),
                Arg::I32(1)
            ]
        );
        // One thread per pair: 2 * 8 * 4 * 32 pairs.
        assert_eq!(l.grid, ((2 * 8 * 4 * 32usize).div_ceil(256) as u32, 1, 1));
        assert_known(&l);
    }
}
