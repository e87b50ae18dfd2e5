//! Tensor operations, grouped by kind. Each checks its operands (shapes, dtypes, devices) and
//! hands the work to [`crate::backend`].

mod dropout;
mod elementwise;
mod fallback;
pub(crate) mod fused;
mod indexing;
mod inplace;
mod math;
mod matmul;
mod overload;
mod reduce;
mod shape_ops;

pub use elementwise::GeluKind;
pub use fused::{
    AttentionGrads, AttentionMask, AttentionOutput, LayerNormOutput, LinearGrads, RmsNormOutput,
};
pub use meshgrad_kernels::ops::AdamWStep;

use crate::{DType, Error, Tensor};

/// The precision float ops compute in for tensors of `dtype`: f64 in f64; f32, bf16 and f16 in
/// f32 (half types are widened, computed, and the result narrowed back to the tensor's dtype;
/// statistics that fused ops return, such as layer norm's mean and rstd or cross-entropy's
/// losses, stay in this precision). Non-float dtypes compute in their own type.
///
/// This is the one rule for every backend: the CPU adapters widen by it and the composed
/// fallbacks of fused ops compute in it.
///
/// ```
/// use meshgrad_tensor::{compute_dtype, DType};
/// assert_eq!(compute_dtype(DType::BF16), DType::F32);
/// assert_eq!(compute_dtype(DType::F64), DType::F64);
/// ```
pub fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        DType::F32 | DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

/// Refuses a tensor whose dtype is not a float one ([`Error::UnsupportedDType`] of `op`).
pub(crate) fn float_only(op: &'static str, t: &Tensor) -> crate::Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
        });
    }
    Ok(())
}

/// Checks that two tensors share a device and dtype.
pub(crate) fn same_kind(op: &'static str, a: &Tensor, b: &Tensor) -> crate::Result<()> {
    same_device(op, a, b)?;
    a.dtype().matching(op, b.dtype())?;
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
