//! GELU's backward on the CPU: resolve dtypes, then call
//! `meshgrad_kernels::cpu::elementwise::gelu_backward`.

use meshgrad_kernels::cpu;

use super::GeluBackward;
use crate::cpu_backend::{floats, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`GeluBackward`].
pub(super) fn backward(a: &GeluBackward<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((x, xl), (dy, dyl), tanh_form) = (a.x, a.dy, a.tanh_form);
    let dt = x.dtype();
    let n = xl.shape().elem_count();
    Ok(
        with_floats!("gelu_backward", (x, range(xl)) => a, (dy, range(dyl)) => g; {
            let mut out = crate::pool::output(n);
            cpu::elementwise::gelu_backward(tanh_form, a, g, &mut out);
            out.into_storage(dt)
        }),
    )
}
