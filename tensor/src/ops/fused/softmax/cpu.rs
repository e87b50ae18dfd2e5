//! Softmax and log-softmax on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::softmax`.

use meshgrad_kernels::cpu;

use super::{Softmax, SoftmaxBackward};
use crate::cpu_backend::{floats, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`Softmax`].
pub(super) fn forward(a: &Softmax<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((s, l), rows, cols, log) = (a.x, a.rows, a.cols, a.log);
    let dt = s.dtype();
    Ok(with_floats!("softmax", (s, range(l)) => x; {
        let mut out = crate::pool::output(rows * cols);
        if log {
            cpu::softmax::log_softmax_forward(x, rows, cols, &mut out);
        } else {
            cpu::softmax::softmax_forward(x, rows, cols, &mut out);
        }
        out.into_storage(dt)
    }))
}

/// See [`SoftmaxBackward`].
pub(super) fn backward(args: &SoftmaxBackward<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((y, yl), (dy, dyl)) = (args.y, args.dy);
    let (rows, cols, log) = (args.rows, args.cols, args.log);
    let dt = y.dtype();
    Ok(
        with_floats!("softmax_backward", (y, range(yl)) => a, (dy, range(dyl)) => g; {
            let mut out = crate::pool::output(rows * cols);
            if log {
                cpu::softmax::log_softmax_backward(a, g, rows, cols, &mut out);
            } else {
                cpu::softmax::softmax_backward(a, g, rows, cols, &mut out);
            }
            out.into_storage(dt)
        }),
    )
}
