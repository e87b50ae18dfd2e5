//! The CUDA backend (`--features cuda`): device buffers from a caching allocator, one compute
//! stream per device, the CUDA C kernels of `kernels/cuda/*.cu` (compiled by NVRTC at first use,
//! see `meshgrad_kernels::cuda`) and matmuls through cuBLASLt.
//!
//! Files: `context.rs` (one [`DeviceContext`] per device: CUDA context, compute stream, loaded
//! kernel modules, library handles), `memory.rs` (the caching allocator), `storage.rs`
//! ([`CudaStorage`]), `backend_impl.rs` (the [`crate::backend::api::BackendStorage`] implementation,
//! which delegates to `basic/` for the required ops, `fused/` for the fused ones and
//! `blas/` for matmul and linear), `raw.rs` (device
//! addresses, uninitialised outputs and the compute stream for NCCL), `signature.rs` (every launch's argument sizes checked
//! against the kernel's declaration, read from the kernel source).
//!
//! Ordering: every kernel, copy and free of a device is issued on its one compute stream, so
//! work runs in issue order and a freed block handed to the next allocation is only touched
//! after everything queued before it. Only reads to the host wait (`to_host`,
//! `read_elements`).
//!
//! The kernels are compile-checked by NVRTC and emulated on the host in CI; what has run on a
//! GPU is in README's Status.

mod backend_impl;
pub(crate) mod basic;
pub(crate) mod blas;
mod context;
pub(crate) mod fused;
mod launch;
mod memory;
mod raw;
mod signature;
mod storage;

pub(crate) use context::{context, DeviceContext};
pub use context::{cuda_device_count, cuda_memory_stats, cuda_synchronize, CudaMemoryStats};
pub(crate) use launch::{grid_for, kernel_args, KernelArgs, KernelLaunch, BLOCK};
pub use raw::{cuda_compute_stream, CudaBuffer};
pub use storage::CudaStorage;
