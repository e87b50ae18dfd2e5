//! GELU's backward on CUDA: the kernel `gelu_bwd_<t>` of `kernels/cuda/gelu.cu`. f32, bf16 and
//! f16 (computed in f32); f64 is not provided (`Ok(None)`: the composed fallback runs).

use super::GeluBackward;
use crate::cuda_backend::fused::args::{args, Launch};
use crate::cuda_backend::fused::elementwise::{elementwise_launch, run_backward};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `gelu_bwd_<t>(x, dy, dx, n, tanh_form)`; `[x, dy, dx]`.
pub(crate) fn gelu_bwd_launch(t: &str, p: &[u64], n: usize, tanh: bool) -> Launch {
    let scalars = args![i32 tanh as i32];
    elementwise_launch("gelu.cu", format!("gelu_bwd_{t}"), p, n, &scalars)
}

/// See [`GeluBackward`]; `Ok(None)` for f64.
pub(super) fn backward(a: &GeluBackward<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    let tanh = a.tanh_form;
    run_backward("gelu_backward", a.x, a.dy, |t, p, n| {
        gelu_bwd_launch(t, p, n, tanh)
    })
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
        let l = gelu_bwd_launch("f32", &[1, 2, 3], 1000, true);
        assert_launch(&l, "gelu_bwd_f32", &[P, P, P, I64, I32]);
        assert_eq!(l.args[3..], args![i64 1000, i32 1]);
        assert_eq!(l.grid, (4, 1, 1));
    }
}
