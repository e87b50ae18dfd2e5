//! CPU side of the fused unary backward passes (SiLU, clamp): resolve dtypes, then call
//! `meshgrad_kernels::cpu::unary_backward`.

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
