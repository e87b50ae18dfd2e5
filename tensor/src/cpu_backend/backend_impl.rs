//! The CPU backend's implementation of [`BackendStorage`]: every listed method hands its
//! arguments to the function of the same name in this module's parent (`cpu_backend/`: the
//! adapters that resolve dtypes and layouts and call `meshgrad_kernels::cpu`).

use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use crate::backend::api::{
    backend_ops, forward, BackendStorage, Distribution, In, Product, ReduceDims, Select,
};
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

impl BackendStorage for CpuStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn dtype(&self) -> DType {
        CpuStorage::dtype(self)
    }

    fn len(&self) -> usize {
        CpuStorage::len(self)
    }

    fn release(&mut self) {
        // Large f32 buffers go back to the recycling pool (see `crate::pool`).
        if let CpuStorage::F32(v) = self {
            crate::pool::give(std::mem::take(v));
        }
    }

    backend_ops!(forward, super);
}
