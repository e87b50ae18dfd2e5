//! Matmul and linear on the CUDA backend, through cuBLASLt.
//!
//! - `layout.rs`: the pure mapping of the row-major product onto cuBLASLt's column-major GEMM
//!   (transposes, leading dimensions, batch strides, which operand is A and which is B), the
//!   cache key, pointer alignments and the cuBLASLt types of each dtype;
//! - `lt.rs`: owners of the cuBLASLt handle and descriptors, building a plan (descriptors and
//!   the heuristic's algorithm) and running it;
//! - `state.rs`: the per-device state (handle, 32 MiB workspace, plans by key), kept in the
//!   device's [`super::DeviceContext`];
//! - `ops.rs`: matmul and the linear layer's products (checks, copies of operands cuBLASLt cannot read in place,
//!   the bias epilogue of `linear`, the GELU epilogue of `linear_gelu`);
//! - `emulate.rs` (tests only): a host emulator of cuBLASLt's strided-batched GEMM and its
//!   epilogues checking the mapping against a naive product;
//! - `gpu_tests.rs` (tests only): results and plan caching on a GPU (skipped without one unless
//!   `MESHGRAD_REQUIRE_CUDA=1`).
//!
//! Dtypes: f32 with full f32 accumulation (`CUBLAS_COMPUTE_32F`, no TF32: results stay close
//! to the CPU's f32 ones), bf16 and f16 accumulated in f32 and written in their own type, f64
//! (`CUBLAS_COMPUTE_64F`).

mod layout;
mod lt;
mod ops;
mod state;

#[cfg(test)]
mod emulate;
#[cfg(test)]
mod gpu_tests;

pub(super) use ops::matmul;
pub(crate) use ops::{linear, linear_gelu};
pub(crate) use state::BlasLt;
