//! Tensor operations, grouped by kind. Each checks its operands (shapes, dtypes, devices) and
//! hands the work to [`crate::backend`].

mod attention;
mod elementwise;
mod indexing;
mod inplace;
mod math;
mod matmul;
mod nn;
mod overload;
mod reduce;
mod rms_norm;
mod rotary;
mod shape_ops;
mod swiglu;

pub use attention::{AttentionGrads, AttentionMask, AttentionOutput};
pub use elementwise::GeluKind;
pub use matmul::LinearGrads;
pub use meshgrad_kernels::ops::AdamWStep;
pub use nn::LayerNormOutput;
pub use rms_norm::RmsNormOutput;

use crate::{Error, Tensor};

/// Checks that two tensors share a device and dtype.
pub(crate) fn same_kind(op: &'static str, a: &Tensor, b: &Tensor) -> crate::Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// Checks that two tensors share a device.
pub(crate) fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> crate::Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}
