//! CPU side of the fused unary backward passes (SiLU, clamp) and of log-sum-exp.

use meshgrad_kernels::cpu;
use meshgrad_kernels::ops::UnaryGrad;

use super::{floats, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Layout, Result};

/// `dx = dy * f'(x)` for contiguous `x` and `dy` of one dtype; `dx` in that dtype.
pub(crate) fn unary_backward(
    x: &CpuStorage,
    xl: &Layout,
    dy: &CpuStorage,
    dyl: &Layout,
    op: UnaryGrad,
) -> Result<CpuStorage> {
    let dt = x.dtype();
    let n = xl.shape().elem_count();
    Ok(
        with_floats!("unary_backward", (x, range(xl)) => a, (dy, range(dyl)) => g; {
            let mut out = crate::pool::output(n);
            cpu::unary_backward::unary_backward(op, a, g, &mut out);
            out.into_storage(dt)
        }),
    )
}

/// Log-sum-exp over the middle dim of a contiguous buffer viewed as `[outer, red, inner]`, in
/// the input's dtype (half types computed in f32).
pub(crate) fn logsumexp(
    s: &CpuStorage,
    l: &Layout,
    outer: usize,
    red: usize,
    inner: usize,
) -> Result<CpuStorage> {
    let dt = s.dtype();
    Ok(with_floats!("logsumexp", (s, range(l)) => x; {
        let mut out = crate::pool::output(outer * inner);
        cpu::logsumexp::logsumexp(x, outer, red, inner, &mut out);
        out.into_storage(dt)
    }))
}
