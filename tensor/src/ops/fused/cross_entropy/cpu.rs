//! Cross-entropy on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::cross_entropy`.

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{CrossEntropy, CrossEntropyBackward};
use crate::cpu_backend::{floats, ids, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`CrossEntropy`]: `(per-row loss, lse)`, both in compute precision.
pub(super) fn forward(a: &CrossEntropy<CpuIn<'_>>) -> Result<(CpuStorage, CpuStorage)> {
    let (logits, targets, rows, cols, ignore_index) =
        (a.logits, a.targets, a.rows, a.cols, a.ignore_index);
    let t = ids(targets.0, targets.1, "cross_entropy (targets)")?;
    let err;
    let r = with_floats!("cross_entropy", (logits.0, range(logits.1)) => x; {
        let mut loss = vec![Float::ZERO; rows];
        let mut lse = vec![Float::ZERO; rows];
        err = cpu::cross_entropy::cross_entropy_forward(x, &t, rows, cols, ignore_index, &mut loss, &mut lse);
        (loss.into_storage(crate::DType::F32), lse.into_storage(crate::DType::F32))
    });
    err?;
    Ok(r)
}

/// See [`CrossEntropyBackward`]: `dlogits` in the logits' dtype.
pub(super) fn backward(a: &CrossEntropyBackward<CpuIn<'_>>) -> Result<CpuStorage> {
    let (logits, lse, targets, dloss) = (a.logits, a.lse, a.targets, a.dloss);
    let (rows, cols, ignore_index) = (a.rows, a.cols, a.ignore_index);
    let dt = logits.0.dtype();
    let t = ids(targets.0, targets.1, "cross_entropy_backward (targets)")?;
    Ok(
        with_floats!("cross_entropy_backward", (logits.0, range(logits.1)) => x, (lse.0, range(lse.1)) => l, (dloss.0, range(dloss.1)) => g; {
            let mut dx = crate::pool::output(rows * cols);
            cpu::cross_entropy::cross_entropy_backward(x, l, &t, rows, cols, ignore_index, g, &mut dx);
            dx.into_storage(dt)
        }),
    )
}
