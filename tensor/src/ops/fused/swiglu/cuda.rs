//! SwiGLU forward and backward on CUDA (`kernels/cuda/swiglu.cu`: `swiglu_fwd`, `swiglu_bwd`).
//! f32, bf16 and f16 (computed in f32); f64 is not provided on CUDA (`Ok(None)`: the composed
//! fallback runs).

use super::{Swiglu, SwigluBackward};
use crate::cuda_backend::fused::args::Launch;
use crate::cuda_backend::fused::elementwise::{elementwise_launch, run_elementwise};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `swiglu_fwd_<t>(gate, up, out, n)`; `[gate, up, out]`.
pub(crate) fn swiglu_fwd_launch(t: &str, p: &[u64], n: usize) -> Launch {
    elementwise_launch("swiglu.cu", format!("swiglu_fwd_{t}"), p, n, &[])
}

/// `swiglu_bwd_<t>(gate, up, dy, dgate, dup, n)`; `[gate, up, dy, dgate, dup]`.
pub(crate) fn swiglu_bwd_launch(t: &str, p: &[u64], n: usize) -> Launch {
    elementwise_launch("swiglu.cu", format!("swiglu_bwd_{t}"), p, n, &[])
}

/// See [`Swiglu`]: `up` converted to `gate`'s dtype if it differs; `Ok(None)` for f64.
pub(super) fn forward(a: &Swiglu<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    let out = run_elementwise("swiglu", a.gate, &[("up", a.up)], swiglu_fwd_launch)?;
    Ok(out.map(|[out]| out))
}

/// See [`SwigluBackward`]: `(dgate, dup)` in `gate`'s dtype; `Ok(None)` for f64.
pub(super) fn backward(
    a: &SwigluBackward<CudaIn<'_>>,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let others = [("up", a.up), ("dy", a.dy)];
    let grads = run_elementwise("swiglu_backward", a.gate, &others, swiglu_bwd_launch)?;
    Ok(grads.map(|[dg, du]| (dg, du)))
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
        let l = swiglu_fwd_launch("f16", &[1, 2, 3], 9);
        assert_launch(&l, "swiglu_fwd_f16", &[P, P, P, I64]);
        // swiglu_bwd_<t>(gate, up, dy, dgate, dup, i64 n)
        let l = swiglu_bwd_launch("f32", &[1, 2, 3, 4, 5], 9);
        assert_launch(&l, "swiglu_bwd_f32", &[P, P, P, P, P, I64]);
        assert_eq!(l.args, args![ptr 1, ptr 2, ptr 3, ptr 4, ptr 5, i64 9]);
    }
}
