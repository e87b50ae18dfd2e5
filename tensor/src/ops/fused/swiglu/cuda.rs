//! SwiGLU forward and backward on CUDA (activations.cu: `swiglu_fwd`, `swiglu_bwd`). f32, bf16
//! and f16 (computed in f32); f64 is not provided on CUDA (`Ok(None)`: the composed fallback
//! runs).

use super::{Swiglu, SwigluBackward};
use crate::cuda_backend::fused::activations::act_launch;
use crate::cuda_backend::fused::args::{args, sfx, Launch};
use crate::cuda_backend::fused::operand::{as_dtype, check_len, contiguous, output};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `swiglu_fwd_<t>(gate, up, out, n)`.
pub(crate) fn swiglu_fwd_launch(t: &str, gate: u64, up: u64, out: u64, n: usize) -> Launch {
    act_launch(
        format!("swiglu_fwd_{t}"),
        n,
        args![ptr gate, ptr up, ptr out, size n].to_vec(),
    )
}

/// `swiglu_bwd_<t>(gate, up, dy, dgate, dup, n)`.
pub(crate) fn swiglu_bwd_launch(t: &str, [gate, up, dy, dgate, dup]: [u64; 5], n: usize) -> Launch {
    act_launch(
        format!("swiglu_bwd_{t}"),
        n,
        args![ptr gate, ptr up, ptr dy, ptr dgate, ptr dup, size n].to_vec(),
    )
}

/// See [`Swiglu`]: `up` converted to `gate`'s dtype if it differs; `Ok(None)` for f64.
pub(super) fn forward(&Swiglu { gate, up }: &Swiglu<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
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

/// See [`SwigluBackward`]: `(dgate, dup)` in `gate`'s dtype; `Ok(None)` for f64.
pub(super) fn backward(
    &SwigluBackward { gate, up, dy }: &SwigluBackward<CudaIn<'_>>,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::args;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    #[test]
    fn swiglu_launches_match_the_kernel_signatures() {
        // swiglu_fwd_<t>(const T *gate, const T *up, T *out, i64 n)
        let l = swiglu_fwd_launch("f16", 1, 2, 3, 9);
        assert_launch(&l, "swiglu_fwd_f16", &[P, P, P, I64]);
        // swiglu_bwd_<t>(gate, up, dy, dgate, dup, i64 n)
        let l = swiglu_bwd_launch("f32", [1, 2, 3, 4, 5], 9);
        assert_launch(&l, "swiglu_bwd_f32", &[P, P, P, P, P, I64]);
        assert_eq!(l.args, args![ptr 1, ptr 2, ptr 3, ptr 4, ptr 5, i64 9]);
    }
}
