//! The CUDA backend's implementation of [`BackendStorage`]: each listed method hands its
//! arguments to the function of the same name in `basic/` (which re-exports `blas/`'s matmul);
//! the identity methods are [`CudaStorage`]'s own.

use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use super::{basic, CudaStorage};
use crate::backend::api::{
    backend_ops, forward, BackendStorage, Distribution, In, Product, ReduceDims, Select,
};
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

impl BackendStorage for CudaStorage {
    fn device(&self) -> Device {
        CudaStorage::device(self)
    }

    fn dtype(&self) -> DType {
        CudaStorage::dtype(self)
    }

    fn len(&self) -> usize {
        CudaStorage::len(self)
    }

    backend_ops!(forward, basic);
}
