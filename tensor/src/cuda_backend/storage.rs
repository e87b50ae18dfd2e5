//! [`CudaStorage`]: one buffer of one dtype on one CUDA device.

use std::sync::Arc;

use super::context::DeviceContext;
use super::memory::{allocate, Block};
use crate::{DType, Device, Result};

/// A buffer of `len` elements of one dtype in device memory, from the device's caching
/// allocator (dropping it returns the memory to the cache).
#[derive(Debug)]
pub struct CudaStorage {
    block: Block,
    dtype: DType,
    len: usize,
}

impl CudaStorage {
    /// An uninitialised buffer of `len` elements of `dtype` on `ctx`'s device.
    pub(crate) fn uninit(ctx: &Arc<DeviceContext>, dtype: DType, len: usize) -> Result<Self> {
        let block = allocate(ctx, len * dtype.size_in_bytes())?;
        Ok(Self { block, dtype, len })
    }

    /// The device context the buffer belongs to.
    pub(crate) fn ctx(&self) -> &Arc<DeviceContext> {
        self.block.ctx()
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.block.ctx().ordinal)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of element 0 (0 for an empty buffer). For communication libraries
    /// (NCCL) that take raw device pointers: work on the buffer must be ordered after the
    /// device's compute stream (see [`CudaStorage::cu_stream`]).
    pub fn device_ptr(&self) -> u64 {
        self.block.ptr()
    }

    /// The device address of element `index`.
    pub(crate) fn ptr_at(&self, index: usize) -> u64 {
        self.block.ptr() + (index * self.dtype.size_in_bytes()) as u64
    }

    /// The raw handle of the compute stream all work on this buffer is issued on.
    pub fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.block.ctx().stream.cu_stream()
    }
}
