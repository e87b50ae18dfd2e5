//! The error type of tensor operations. Messages name the op, shapes, dtypes and devices involved.

use crate::{DType, Device, Shape};

/// Errors from tensor operations.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Two shapes that must agree (or broadcast) do not.
    #[error("{op}: shape mismatch: {lhs} vs {rhs}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// Left operand's shape.
        lhs: Shape,
        /// Right operand's shape.
        rhs: Shape,
    },
    /// An operand has a dtype the op does not accept, or two dtypes disagree.
    #[error("{op}: dtype mismatch: {lhs:?} vs {rhs:?}")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// Left operand's dtype.
        lhs: DType,
        /// Right operand's dtype.
        rhs: DType,
    },
    /// The op does not support this dtype.
    #[error("{op}: unsupported dtype {dtype:?}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: device mismatch: {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// Left operand's device.
        lhs: Device,
        /// Right operand's device.
        rhs: Device,
    },
    /// A dimension index is out of range for the rank.
    #[error("{op}: dimension {dim} out of range for a tensor of shape {shape}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The requested dimension.
        dim: isize,
        /// The tensor's shape.
        shape: Shape,
    },
    /// The storage was released (see [`crate::Tensor::release_storage`]), not re-materialised,
    /// and has no materialiser.
    #[error(
        "{op}: the tensor's storage is released (freed by release_storage, as ZeRO-3 / FSDP does \
         with parameters between uses) and nothing materialises it: put data back with \
         materialize_from, or run the model while the ShardedDataParallel wrapper that sharded it \
         is alive (or call its summon_full_params() before dropping it)"
    )]
    Released {
        /// The operation.
        op: &'static str,
    },
    /// The CUDA backend was requested in a build without the `cuda` feature.
    #[error(
        "device {0} requested but meshgrad was built without CUDA (rebuild with `--features cuda`)"
    )]
    CudaNotBuilt(Device),
    /// The backend exists but this op is not implemented on it.
    #[error("{op} is not implemented on {device}")]
    NotImplemented {
        /// The operation.
        op: &'static str,
        /// The device.
        device: Device,
    },
    /// Any other invalid argument, described in full.
    #[error("{0}")]
    Msg(String),
}

impl Error {
    /// An error with a free-form message.
    pub fn msg(s: impl Into<String>) -> Self {
        Error::Msg(s.into())
    }
}

impl From<meshgrad_kernels::KernelError> for Error {
    fn from(e: meshgrad_kernels::KernelError) -> Self {
        Error::Msg(e.0)
    }
}

/// Result with the tensor [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with an [`Error::Msg`] built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::Error::Msg(format!($($arg)*)))
    };
}
