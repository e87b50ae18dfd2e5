//! The SiLU / clamp backward on the CPU: resolve dtypes, then call
//! `meshgrad_kernels::cpu::unary_backward`.

use meshgrad_kernels::cpu;

use super::UnaryBackward;
use crate::cpu_backend::{floats, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`UnaryBackward`].
pub(super) fn backward(args: &UnaryBackward<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((x, xl), (dy, dyl), op) = (args.x, args.dy, args.op);
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
