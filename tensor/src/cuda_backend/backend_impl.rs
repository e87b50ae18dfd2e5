//! The CUDA backend's implementation of [`BackendStorage`]: each method hands its arguments to
//! the function of the same name in `basic/` (or `blas/` for matmul; the identity methods to
//! [`CudaStorage`]'s own).

use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use super::{basic, blas, CudaStorage};
use crate::backend::api::{BackendStorage, Distribution, In, Product};
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

/// Trait methods that hand their arguments, in order, to the function of the same name in
/// `$m`: `forward! { m; fn f(&self, x: X) -> R; ... }` writes `fn f(&self, x: X) -> R { m::f(self,
/// x) }` for each signature.
macro_rules! forward {
    ($m:ident;) => {};
    ($m:ident; fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty; $($rest:tt)*) => {
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            $m::$name(self $(, $arg)*)
        }
        forward!($m; $($rest)*);
    };
    ($m:ident; fn $name:ident(&mut self $(, $arg:ident: $ty:ty)*) -> $ret:ty; $($rest:tt)*) => {
        fn $name(&mut self $(, $arg: $ty)*) -> $ret {
            $m::$name(self $(, $arg)*)
        }
        forward!($m; $($rest)*);
    };
    ($m:ident; fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty; $($rest:tt)*) => {
        fn $name($($arg: $ty),*) -> $ret {
            $m::$name($($arg),*)
        }
        forward!($m; $($rest)*);
    };
}

impl BackendStorage for CudaStorage {
    forward! { CudaStorage;
        fn device(&self) -> Device;
        fn dtype(&self) -> DType;
        fn len(&self) -> usize;
    }

    forward! { basic;
        fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self>;
        fn output(device: Device, dtype: DType, len: usize) -> Result<Self>;
        fn full(device: Device, value: f64, dtype: DType, len: usize) -> Result<Self>;
        fn from_host(device: Device, host: CpuStorage) -> Result<Self>;
        fn to_host(&self, l: &Layout) -> Result<CpuStorage>;
        fn read_elements(&self, indices: &[usize]) -> Result<CpuStorage>;
        fn random(device: Device, dtype: DType, len: usize, seed: u64, offset: u64, dist: Distribution) -> Result<Self>;
        fn arange(device: Device, start: i64, len: usize, dtype: DType) -> Result<Self>;
        fn cast(&self, l: &Layout, dtype: DType) -> Result<Self>;
        fn copy_contiguous(&self, l: &Layout) -> Result<Self>;
        fn copy_into(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<()>;
        fn add_assign_contiguous(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<bool>;
        fn unary(x: In<'_, Self>, op: UnaryOp) -> Result<Self>;
        fn binary(op: BinaryOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self>;
        fn compare(op: CmpOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self>;
        fn where_cond(cond: In<'_, Self>, t: In<'_, Self>, f: In<'_, Self>) -> Result<Self>;
        fn reduce(op: ReduceOp, x: In<'_, Self>, outer: usize, red: usize, inner: usize) -> Result<Self>;
        fn gather(x: In<'_, Self>, index: In<'_, Self>, dim: usize) -> Result<Self>;
        fn gather_backward(dout: In<'_, Self>, index: In<'_, Self>, x_dims: &[usize], dim: usize) -> Result<Self>;
        fn index_select(x: In<'_, Self>, ids: In<'_, Self>, outer: usize, x_n: usize, inner: usize, dim: usize) -> Result<Self>;
        fn index_select_backward(dout: In<'_, Self>, ids: In<'_, Self>, outer: usize, x_n: usize, inner: usize, dim: usize) -> Result<Self>;
    }

    forward! { blas;
        fn matmul(a: &Self, b: &Self, p: &Product) -> Result<Self>;
    }
}
