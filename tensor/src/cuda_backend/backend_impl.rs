//! The CUDA backend's implementation of [`BackendStorage`]: each method delegates to `basic/`
//! or `blas/` (matmul).

use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use super::{basic, blas, CudaStorage};
use crate::backend::api::{BackendStorage, Distribution, In, Product};
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

    fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self> {
        basic::zeros(device, dtype, len)
    }

    fn output(device: Device, dtype: DType, len: usize) -> Result<Self> {
        basic::output(device, dtype, len)
    }

    fn full(device: Device, value: f64, dtype: DType, len: usize) -> Result<Self> {
        basic::full(device, value, dtype, len)
    }

    fn from_host(device: Device, host: CpuStorage) -> Result<Self> {
        basic::from_host(device, host)
    }

    fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        basic::to_host(self, l)
    }

    fn read_elements(&self, indices: &[usize]) -> Result<CpuStorage> {
        basic::read_elements(self, indices)
    }

    fn random(
        device: Device,
        dtype: DType,
        len: usize,
        seed: u64,
        offset: u64,
        dist: Distribution,
    ) -> Result<Self> {
        basic::random(device, dtype, len, seed, offset, dist)
    }

    fn arange(device: Device, start: i64, len: usize, dtype: DType) -> Result<Self> {
        basic::arange(device, start, len, dtype)
    }

    fn cast(&self, l: &Layout, dtype: DType) -> Result<Self> {
        basic::cast(self, l, dtype)
    }

    fn copy_contiguous(&self, l: &Layout) -> Result<Self> {
        basic::copy_contiguous(self, l)
    }

    fn copy_into(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<()> {
        basic::copy_into(self, dl, src)
    }

    fn add_assign_contiguous(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<bool> {
        basic::add_assign_contiguous(self, dl, src)
    }

    fn unary(x: In<'_, Self>, op: UnaryOp) -> Result<Self> {
        basic::unary(x, op)
    }

    fn binary(op: BinaryOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self> {
        basic::binary(op, a, b)
    }

    fn compare(op: CmpOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self> {
        basic::compare(op, a, b)
    }

    fn where_cond(cond: In<'_, Self>, t: In<'_, Self>, f: In<'_, Self>) -> Result<Self> {
        basic::where_cond(cond, t, f)
    }

    fn reduce(
        op: ReduceOp,
        x: In<'_, Self>,
        outer: usize,
        red: usize,
        inner: usize,
    ) -> Result<Self> {
        basic::reduce(op, x, outer, red, inner)
    }

    fn matmul(a: &Self, b: &Self, p: &Product) -> Result<Self> {
        blas::matmul(a, b, p)
    }

    fn embedding(w: In<'_, Self>, ids: In<'_, Self>, vocab: usize, dim: usize) -> Result<Self> {
        basic::embedding(w, ids, vocab, dim)
    }

    fn embedding_backward(
        dout: In<'_, Self>,
        ids: In<'_, Self>,
        vocab: usize,
        dim: usize,
    ) -> Result<Self> {
        basic::embedding_backward(dout, ids, vocab, dim)
    }

    fn gather(x: In<'_, Self>, index: In<'_, Self>, dim: usize) -> Result<Self> {
        basic::gather(x, index, dim)
    }

    fn gather_backward(
        dout: In<'_, Self>,
        index: In<'_, Self>,
        x_dims: &[usize],
        dim: usize,
    ) -> Result<Self> {
        basic::gather_backward(dout, index, x_dims, dim)
    }

    fn index_select(
        x: In<'_, Self>,
        ids: In<'_, Self>,
        outer: usize,
        x_n: usize,
        inner: usize,
        dim: usize,
    ) -> Result<Self> {
        basic::index_select(x, ids, outer, x_n, inner, dim)
    }

    fn index_select_backward(
        dout: In<'_, Self>,
        ids: In<'_, Self>,
        outer: usize,
        x_n: usize,
        inner: usize,
        dim: usize,
    ) -> Result<Self> {
        basic::index_select_backward(dout, ids, outer, x_n, inner, dim)
    }
}
