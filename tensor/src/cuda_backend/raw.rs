//! Raw access to device buffers for communication libraries (NCCL in `meshgrad-parallel`):
//! a contiguous tensor's device address ([`Tensor::cuda_buffer`]), an uninitialised output
//! tensor ([`Tensor::cuda_uninit`]) and the device's compute stream ([`cuda_compute_stream`]).
//!
//! Ordering rule for users of these: every kernel, copy and free of a device is issued on its
//! one compute stream. Work on another stream that reads or writes a buffer must start after an
//! event recorded on the compute stream (after the work that produced the buffer), and the
//! compute stream must wait on an event recorded after that work before the buffer is used or
//! dropped: a dropped buffer goes back to the caching allocator, which hands it to the next
//! allocation on the compute stream at once.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// A contiguous tensor's device memory, as [`Tensor::cuda_buffer`] returns it. The address is
/// valid while the tensor (or a clone of it) is alive and its storage is not released
/// ([`Tensor::release_storage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaBuffer {
    /// The device address of the tensor's first element (0 for an empty tensor).
    pub ptr: u64,
    /// Number of elements (the tensor's element count).
    pub len: usize,
    /// The element type.
    pub dtype: DType,
    /// The device ordinal.
    pub ordinal: usize,
    /// The raw handle of the device's compute stream, where all of the backend's work on the
    /// buffer is issued.
    pub stream: cudarc::driver::sys::CUstream,
}

// SAFETY: a CudaBuffer is plain data (an address, sizes and an opaque stream handle); it gives
// no access to the memory by itself, and CUDA stream handles may be used from any thread.
unsafe impl Send for CudaBuffer {}
// SAFETY: as above; nothing in it is mutated through a shared reference.
unsafe impl Sync for CudaBuffer {}

impl Tensor {
    /// The device buffer of this tensor, for libraries that take raw device pointers (NCCL).
    /// The tensor must live on a CUDA device and be contiguous (call [`Tensor::contiguous`]
    /// first); a released tensor is materialised first. Ordering rule for work on other streams:
    /// start it after an event recorded on the compute stream ([`CudaBuffer::stream`]), and make
    /// the compute stream wait on an event recorded after it before the tensor is used again or
    /// dropped (a dropped buffer goes back to the caching allocator at once).
    pub fn cuda_buffer(&self) -> Result<CudaBuffer> {
        let Device::Cuda(ordinal) = self.device() else {
            return Err(Error::Msg(format!(
                "cuda_buffer: the tensor is on {}, not on a CUDA device",
                self.device()
            )));
        };
        let Some(range) = self.layout().contiguous_range() else {
            return Err(Error::Msg(format!(
                "cuda_buffer: the tensor of shape {:?} is not contiguous (call contiguous() first)",
                self.dims()
            )));
        };
        let storage = self.read_storage("cuda_buffer")?;
        match &*storage {
            Storage::Cuda(s) => Ok(CudaBuffer {
                ptr: if range.is_empty() {
                    0
                } else {
                    s.ptr_at(range.start)
                },
                len: range.len(),
                dtype: s.dtype(),
                ordinal,
                stream: s.cu_stream(),
            }),
            Storage::Cpu(_) => Err(Error::Msg(
                "cuda_buffer: the tensor's storage is on the host".to_owned(),
            )),
        }
    }

    /// A contiguous tensor of `shape` and `dtype` on CUDA device `ordinal` whose contents are
    /// uninitialised (from the caching allocator, ordered on the compute stream): for outputs a
    /// library fills in completely before anything reads them.
    pub fn cuda_uninit(shape: impl Into<Shape>, dtype: DType, ordinal: usize) -> Result<Tensor> {
        let shape = shape.into();
        let ctx = super::context(ordinal)?;
        let storage = super::CudaStorage::uninit(&ctx, dtype, shape.elem_count())?;
        Ok(Tensor::from_storage(Storage::Cuda(storage), shape))
    }
}

/// The compute stream of CUDA device `ordinal` (creating the device's context at the first
/// call): the stream every kernel, copy and free of that device is issued on. Other streams of
/// the same CUDA context come from `cuda_compute_stream(n)?.context().new_stream()`.
pub fn cuda_compute_stream(ordinal: usize) -> Result<Arc<CudaStream>> {
    Ok(super::context(ordinal)?.stream.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host-side: a CPU tensor has no device buffer, and without a GPU nothing panics.
    #[test]
    fn cuda_buffer_refuses_host_tensors_and_no_gpu_is_an_error() {
        let t = Tensor::from_vec(vec![1f32, 2.0], 2, Device::Cpu).unwrap();
        let e = t.cuda_buffer().unwrap_err().to_string();
        assert_eq!(e, "cuda_buffer: the tensor is on cpu, not on a CUDA device");
        if crate::cuda_device_count() == 0 {
            assert!(Tensor::cuda_uninit(4, DType::F32, 0).is_err());
            assert!(cuda_compute_stream(0).is_err());
        }
    }
}
