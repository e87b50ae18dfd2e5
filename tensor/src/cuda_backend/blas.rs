//! Matmul and linear on the CUDA backend, through cuBLASLt.
#![allow(clippy::too_many_arguments, clippy::type_complexity)]
use super::CudaStorage;
use crate::backend::api::{Fused, In};
use crate::{Device, Error, Result};
use meshgrad_kernels::ops::MatrixLayout;

/// See `BackendStorage::matmul`.
pub(super) fn matmul(
    _a: &CudaStorage,
    _al: MatrixLayout,
    _b: &CudaStorage,
    _bl: MatrixLayout,
    _batch: usize,
    _m: usize,
    _n: usize,
    _k: usize,
) -> Result<CudaStorage> {
    Err(Error::NotImplemented {
        op: "matmul",
        device: Device::Cuda(0),
    })
}

/// See `BackendStorage::linear`.
pub(super) fn linear(
    _x: &CudaStorage,
    _xl: MatrixLayout,
    _w: &CudaStorage,
    _wl: MatrixLayout,
    _bias: Option<In<'_, CudaStorage>>,
    _m: usize,
    _n: usize,
    _k: usize,
) -> Fused<CudaStorage> {
    Err(Error::NotImplemented {
        op: "linear",
        device: Device::Cuda(0),
    })
}
