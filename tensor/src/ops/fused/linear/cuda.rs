//! The linear layer on CUDA: one cuBLASLt call with the bias or GELU epilogue
//! (`cuda_backend/blas/ops.rs`, which also runs the plain products).

use super::{Linear, LinearGelu};
use crate::cuda_backend::blas;
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// See [`Linear`] and `blas::linear`.
pub(super) fn forward(a: &Linear<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    blas::linear(a.x.0, a.w.0, a.bias, &a.p)
}

/// See [`LinearGelu`] and `blas::linear_gelu`.
pub(super) fn gelu(a: &LinearGelu<CudaIn<'_>>) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let l = &a.lin;
    blas::linear_gelu(l.x.0, l.w.0, l.bias, &l.p, a.tanh_form)
}
