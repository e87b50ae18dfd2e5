//! The launches of activations.cu ([`act_launch`]) and the SiLU / clamp backward (`unary_bwd`).
//! f32, bf16 and f16 (computed in f32); f64 is not provided on CUDA (`Ok(None)`). GELU's
//! backward and SwiGLU, also in activations.cu, are `ops/fused/gelu/cuda.rs` and
//! `ops/fused/swiglu/cuda.rs`.

use meshgrad_kernels::cuda::unary_grad;
use meshgrad_kernels::ops::UnaryGrad;

use super::args::{flat_grid, i64_of, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{as_dtype, check_len, contiguous, output};
use crate::backend::api::{Fused, In};
use crate::cuda_backend::CudaStorage;

/// A grid-stride launch of `entry` of activations.cu over `n` elements.
pub(crate) fn act_launch(entry: String, n: usize, args: Vec<Arg>) -> Launch {
    Launch {
        file: "activations.cu",
        entry,
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
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

#[cfg(test)]
mod tests {
    use super::super::args::assert_known;
    use super::super::args::Kind::*;
    use super::*;

    #[test]
    fn unary_backward_launches_match_the_kernel_signature() {
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
    }
}
