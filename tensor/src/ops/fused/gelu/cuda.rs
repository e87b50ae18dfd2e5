//! GELU's backward on CUDA: the kernel `gelu_bwd_<t>` of `kernels/cuda/activations.cu`. f32,
//! bf16 and f16 (computed in f32); f64 is not provided (`Ok(None)`: the composed fallback runs).

use super::GeluBackward;
use crate::cuda_backend::fused::activations::act_launch;
use crate::cuda_backend::fused::args::{args, sfx, Launch};
use crate::cuda_backend::fused::operand::{as_dtype, check_len, contiguous, output};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `gelu_bwd_<t>(x, dy, dx, n, tanh_form)`.
pub(crate) fn gelu_bwd_launch(t: &str, [x, dy, dx]: [u64; 3], n: usize, tanh: bool) -> Launch {
    act_launch(
        format!("gelu_bwd_{t}"),
        n,
        args![ptr x, ptr dy, ptr dx, size n, i32 tanh as i32].to_vec(),
    )
}

/// See [`GeluBackward`]: `dy` converted to `x`'s dtype if it differs; `Ok(None)` for f64.
pub(super) fn backward(
    &GeluBackward { x, dy, tanh_form }: &GeluBackward<CudaIn<'_>>,
) -> Result<Option<CudaStorage>> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let n = x.1.shape().elem_count();
    check_len("gelu_backward", "dy", dy.1, n)?;
    let (xo, go) = (contiguous(x)?, as_dtype(dy, dt)?);
    let ctx = x.0.ctx();
    let dx = output(ctx, dt, n)?;
    if n > 0 {
        gelu_bwd_launch(t, [xo.ptr(), go.ptr(), dx.device_ptr()], n, tanh_form)
            .run(ctx, || format!("gelu_backward of {} {dt:?}", x.1.shape()))?;
    }
    Ok(Some(dx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::args;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    #[test]
    fn launch_matches_the_kernel_signature() {
        // gelu_bwd_<t>(const T *x, const T *dy, T *dx, i64 n, int tanh_form)
        let l = gelu_bwd_launch("f32", [1, 2, 3], 1000, true);
        assert_launch(&l, "gelu_bwd_f32", &[P, P, P, I64, I32]);
        assert_eq!(l.args[3..], args![i64 1000, i32 1]);
        assert_eq!(l.grid, (4, 1, 1));
    }
}
