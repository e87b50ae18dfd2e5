//! Compute kernels for meshgrad.
//!
//! Kernels work on plain slices and know nothing of tensors: the tensor crate resolves layouts,
//! dtypes and devices and calls in here. Every CPU kernel is generic over [`Float`] (f32 and f64;
//! f64 doubles as the reference precision in tests). Half-precision tensors are computed in f32 by
//! the tensor crate.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod float;
pub mod rng;

pub use float::Float;

/// Error returned by kernels whose inputs can be invalid in ways the caller cannot cheaply check
/// up front (for example an embedding id out of range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError(pub String);

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}
