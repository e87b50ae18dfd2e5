//! The table of kernel sources and their entry points, generated at build time by
//! `kernels/build.rs` from `kernels/cuda/*.cu` (with [`parse`](super::parse)), so that an entry
//! point is written once: in its `.cu` file. `kernels/tests/nvrtc_compile.rs` checks the table
//! against the PTX NVRTC produces.

use super::KernelSource;

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
