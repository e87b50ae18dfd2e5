//! The backend trait: the checklist a new backend fills in.
//!
//! A backend is a storage type (one buffer of one dtype on one device) implementing
//! [`BackendStorage`], plus one variant of [`crate::storage::Storage`] holding it and one arm in
//! the `with_backend!` macro of the dispatch place (`backend/mod.rs`). Nothing at the op call
//! sites changes. The CPU backend is [`crate::storage::CpuStorage`] (its implementation lives in
//! `cpu_backend/`).
//!
//! The methods come in two groups:
//! - memory: allocation, host transfers, random fills and `arange` (generated on the device from
//!   the counter-based stream of [`meshgrad_kernels::rng`], so every backend draws the same values
//!   for the same seed and indices), and `release` (the hook of a caching allocator);
//! - basic ops, which every backend must provide (casts, copies, elementwise, reductions,
//!   matmul, indexing, ...);
//!
//! The fused ops (norms, attention, linear epilogues, optimizer steps, ...) are not methods here:
//! each keeps its CPU, CUDA and composed paths in its own folder of `ops/fused/`, run by
//! `ops::fused::run` (a path answering `Ok(None)` leaves the op to its composition), so a
//! backend can arrive one fused kernel at a time.
//!
//! Conventions shared by all methods: every operand is a storage with the [`Layout`] of the view
//! being read (`In`); operands have been checked to be on the same device by the dispatch place;
//! the tensor ops have checked shapes and dtypes and pass contiguous layouts wherever the
//! primitive's documentation in `backend/mod.rs` says so. Float inputs of half dtypes are
//! computed in the precision [`crate::compute_dtype`] names.

use meshgrad_kernels::ops::{BinaryOp, CmpOp, MatrixLayout, ReduceOp, UnaryOp};

use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

/// One operand: a backend storage with the layout of the view being read.
pub(crate) type In<'a, S> = (&'a S, &'a Layout);

/// What a random fill draws, element `i` from counter `offset + i` of stream `seed` (see
/// [`meshgrad_kernels::rng`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Distribution {
    /// `mean + std * n(seed, offset + i)` computed in f64, rounded to the dtype.
    Normal { mean: f64, std: f64 },
    /// `low + (high - low) * u(seed, offset + i)` computed in f64, rounded to the dtype.
    Uniform { low: f64, high: f64 },
    /// Integers uniform in `[low, high)` (exact in the dtype; checked by the caller).
    RandInt { low: i64, high: i64 },
}

/// One batched matrix product as a backend takes it: `batch` products `[m, k] x [k, n]`, the
/// left operand read through `al` and the right through `bl` (offsets and strides in elements
/// of each operand's whole buffer); the output is contiguous `[batch, m, n]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Product {
    /// The left operand's matrices.
    pub al: MatrixLayout,
    /// The right operand's matrices.
    pub bl: MatrixLayout,
    /// Products in the batch.
    pub batch: usize,
    /// Rows of the left operand and of the output.
    pub m: usize,
    /// Columns of the right operand and of the output.
    pub n: usize,
    /// The contracted dim.
    pub k: usize,
}

/// The primitives a backend provides, on its own storage type. See the module documentation.
pub(crate) trait BackendStorage: Sized + std::fmt::Debug + Send + Sync + 'static {
    // ----- identity and memory -----

    /// The device the buffer lives on.
    fn device(&self) -> Device;
    /// The dtype of the elements.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    /// A zero-filled buffer on `device`.
    fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self>;
    /// A buffer on `device` for an output the caller overwrites completely: its contents are
    /// unspecified (stale values of a recycled buffer, or whatever the device memory held), so
    /// never use it for an output that is accumulated into or only partly written.
    fn output(device: Device, dtype: DType, len: usize) -> Result<Self>;
    /// A buffer of `len` copies of `value` converted to `dtype` (as `as` converts for integers).
    fn full(device: Device, value: f64, dtype: DType, len: usize) -> Result<Self>;
    /// A copy of a host buffer on `device`.
    fn from_host(device: Device, host: CpuStorage) -> Result<Self>;
    /// The elements of the contiguous view `l`, copied to the host (waits for queued work).
    fn to_host(&self, l: &Layout) -> Result<CpuStorage>;
    /// The elements at the given flat indices, copied to the host (for display).
    fn read_elements(&self, indices: &[usize]) -> Result<CpuStorage>;
    /// `len` values of `dist` from stream `seed` starting at counter `offset`, in `dtype`.
    fn random(
        device: Device,
        dtype: DType,
        len: usize,
        seed: u64,
        offset: u64,
        dist: Distribution,
    ) -> Result<Self>;
    /// `[start, start + 1, ..., start + len - 1]` in `dtype`.
    fn arange(device: Device, start: i64, len: usize, dtype: DType) -> Result<Self>;
    /// Called when the tensor storage holding this buffer is freed: a caching allocator takes the
    /// memory back here (the CPU one recycles large f32 buffers). The byte accounting of
    /// [`crate::alloc`] is done by the caller, the same for every backend.
    fn release(&mut self) {}

    // ----- basic ops (required) -----

    /// A copy of the view converted to `dtype`, contiguous.
    fn cast(&self, l: &Layout, dtype: DType) -> Result<Self>;
    /// A contiguous copy of the view.
    fn copy_contiguous(&self, l: &Layout) -> Result<Self>;
    /// Writes `src` into the view `dl` of `self` (same dtype and shape).
    fn copy_into(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<()>;
    /// `self[dl] += src` when both are contiguous; `Ok(false)` (nothing done) otherwise.
    fn add_assign_contiguous(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<bool>;
    /// Elementwise `op` of the view, contiguous out.
    fn unary(x: In<'_, Self>, op: UnaryOp) -> Result<Self>;
    /// Broadcasting binary op (the layouts broadcast to the output shape).
    fn binary(op: BinaryOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self>;
    /// Broadcasting comparison, u8 out.
    fn compare(op: CmpOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self>;
    /// `cond ? t : f`, broadcasting.
    fn where_cond(cond: In<'_, Self>, t: In<'_, Self>, f: In<'_, Self>) -> Result<Self>;
    /// Reduction of a contiguous buffer viewed as `[outer, red, inner]` over `red`.
    fn reduce(
        op: ReduceOp,
        x: In<'_, Self>,
        outer: usize,
        red: usize,
        inner: usize,
    ) -> Result<Self>;
    /// The batched product `p` of `a` and `b` with arbitrary strides.
    fn matmul(a: &Self, b: &Self, p: &Product) -> Result<Self>;
    /// `torch.gather` along `dim`.
    fn gather(x: In<'_, Self>, index: In<'_, Self>, dim: usize) -> Result<Self>;
    /// The scatter-add backward of [`BackendStorage::gather`].
    fn gather_backward(
        dout: In<'_, Self>,
        index: In<'_, Self>,
        x_dims: &[usize],
        dim: usize,
    ) -> Result<Self>;
    /// Selection of `ids` along the middle of `[outer, x_n, inner]`.
    fn index_select(
        x: In<'_, Self>,
        ids: In<'_, Self>,
        outer: usize,
        x_n: usize,
        inner: usize,
        dim: usize,
    ) -> Result<Self>;
    /// The scatter-add backward of [`BackendStorage::index_select`].
    fn index_select_backward(
        dout: In<'_, Self>,
        ids: In<'_, Self>,
        outer: usize,
        x_n: usize,
        inner: usize,
        dim: usize,
    ) -> Result<Self>;
}
