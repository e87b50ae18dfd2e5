//! The SiLU / clamp backward on CUDA: the kernel `unary_bwd_<t>` of
//! `kernels/cuda/unary_backward.cu`. f32, bf16 and f16 (computed in f32); f64 is not provided
//! (`Ok(None)`: the composed fallback runs).

use meshgrad_kernels::cuda::unary_grad;
use meshgrad_kernels::ops::UnaryGrad;

use super::UnaryBackward;
use crate::cuda_backend::fused::args::{args, Launch};
use crate::cuda_backend::fused::elementwise::{elementwise_launch, run_backward};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `unary_bwd_<t>(x, dy, dx, n, op, lo, hi)`: op 0 SiLU, 1 clamp to `[lo, hi]`; `[x, dy, dx]`.
pub(crate) fn unary_bwd_launch(t: &str, p: &[u64], n: usize, op: UnaryGrad) -> Launch {
    let (code, lo, hi) = match op {
        UnaryGrad::Silu => (unary_grad::SILU, 0.0, 0.0),
        UnaryGrad::Clamp(lo, hi) => (unary_grad::CLAMP, lo, hi),
    };
    let scalars = args![i32 code, f64 lo, f64 hi];
    elementwise_launch(
        "unary_backward.cu",
        format!("unary_bwd_{t}"),
        p,
        n,
        &scalars,
    )
}

/// See [`UnaryBackward`]; `Ok(None)` for f64.
pub(super) fn backward(a: &UnaryBackward<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    let op = a.op;
    run_backward("unary_backward", a.x, a.dy, |t, p, n| {
        unary_bwd_launch(t, p, n, op)
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
        // unary_bwd_<t>(const T *x, const T *dy, T *dx, i64 n, int op, double lo, double hi)
        let l = unary_bwd_launch("bf16", &[1, 2, 3], 5, UnaryGrad::Clamp(-1.5, f64::INFINITY));
        assert_launch(&l, "unary_bwd_bf16", &[P, P, P, I64, I32, F64, F64]);
        assert_eq!(
            l.args[3..],
            args![i64 5, i32 1, f64 -1.5, f64 f64::INFINITY]
        );
        let l = unary_bwd_launch("f16", &[1, 2, 3], 5, UnaryGrad::Silu);
        assert_eq!(l.args[4], args![i32 0][0]);
    }
}
