//! The backend trait: the checklist a new backend fills in.
//!
//! A backend is a storage type (one buffer of one dtype on one device) implementing
//! [`BackendStorage`], plus one variant of [`crate::storage::Storage`] holding it and one arm in
//! the `with_backend!` macro of the dispatch place (`backend/mod.rs`). Nothing at the op call
//! sites changes. The CPU backend is [`crate::storage::CpuStorage`] (its implementation lives in
//! `cpu_backend/`).
//!
//! The methods, besides identity (`device`, `dtype`, `len`) and `release` (the hook of a caching
//! allocator), are listed once, in [`backend_ops`], which writes the trait's methods, the
//! dispatch's and each backend's forwarders from that one list. They come in two groups:
//! - memory: allocation, host transfers, random fills and `arange` (generated on the device from
//!   the counter-based stream of [`meshgrad_kernels::rng`], so every backend draws the same values
//!   for the same seed and indices);
//! - basic ops, which every backend must provide (casts, copies, elementwise, reductions,
//!   matmul, indexing, ...).
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

/// The shape of an `index_select` (and of its backward): the input viewed as
/// `[outer, x_n, inner]`, its middle dim (dim `dim` of the tensor, named in errors) picked by
/// the ids.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Select {
    /// Product of the dims before `dim`.
    pub outer: usize,
    /// The size of `dim`.
    pub x_n: usize,
    /// Product of the dims after `dim`.
    pub inner: usize,
    /// The dim the ids pick along.
    pub dim: usize,
}

/// The shape of a reduction: a contiguous buffer viewed as `[outer, red, inner]`, reduced over
/// its middle dim `red`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ReduceDims {
    /// Product of the dims before the reduced one.
    pub outer: usize,
    /// The size of the reduced dim.
    pub red: usize,
    /// Product of the dims after the reduced one.
    pub inner: usize,
}

/// The primitives a backend provides, on its own storage type. See the module documentation.
pub(crate) trait BackendStorage: Sized + std::fmt::Debug + Send + Sync + 'static {
    /// The device the buffer lives on.
    fn device(&self) -> Device;
    /// The dtype of the elements.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Called when the tensor storage holding this buffer is freed: a caching allocator takes the
    /// memory back here (the CPU one recycles large f32 buffers). The byte accounting of
    /// [`crate::alloc`] is done by the caller, the same for every backend.
    fn release(&mut self) {}

    backend_ops!(declare);
}

/// The one list of the methods a backend provides besides the four above, each written once:
/// `fn name(args) -> Result<R> = "op";`, where `"op"` names the op in a device mismatch. A
/// receiver is spelt `self: &Self` (or `&mut Self`) so that every argument has a name and a type.
///
/// `backend_ops!(gen)` hands the list to the macro `gen`, `backend_ops!(gen, m)` hands it the
/// module `m` first:
/// - [`declare`] writes the methods of [`BackendStorage`];
/// - `dispatch` (in `backend/mod.rs`) writes the `Storage` methods the tensor ops call, which
///   check the operands' device and call that backend's method;
/// - [`forward`] writes a backend's implementation, each method calling the function of the
///   same name in `m` with the same arguments.
macro_rules! backend_ops {
    ($gen:ident $(, $m:ident)?) => {
        $gen! { $($m)? ;
            // ----- memory -----

            /// A zero-filled buffer on `device`.
            fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self> = "zeros";
            /// A buffer on `device` for an output the caller overwrites completely: its contents
            /// are unspecified (stale values of a recycled buffer, or whatever the device memory
            /// held), so never use it for an output that is accumulated into or only partly
            /// written.
            fn output(device: Device, dtype: DType, len: usize) -> Result<Self> = "output";
            /// A buffer of `len` copies of `value` converted to `dtype` (as `as` converts for
            /// integers).
            fn full(device: Device, value: f64, dtype: DType, len: usize) -> Result<Self> = "full";
            /// A copy of a host buffer on `device`.
            fn from_host(device: Device, host: CpuStorage) -> Result<Self> = "from_host";
            /// The elements of the contiguous view `l`, copied to the host (waits for queued
            /// work).
            fn to_host(self: &Self, l: &Layout) -> Result<CpuStorage> = "to_host";
            /// The elements at the given flat indices, copied to the host (for display).
            fn read_elements(self: &Self, indices: &[usize]) -> Result<CpuStorage> = "read_elements";
            /// `len` values of `dist` from stream `seed` starting at counter `offset`, in `dtype`.
            fn random(
                device: Device,
                dtype: DType,
                len: usize,
                seed: u64,
                offset: u64,
                dist: Distribution,
            ) -> Result<Self> = "random";
            /// `[start, start + 1, ..., start + len - 1]` in `dtype`.
            fn arange(device: Device, start: i64, len: usize, dtype: DType) -> Result<Self> = "arange";

            // ----- basic ops -----

            /// A copy of the view converted to `dtype`, contiguous.
            fn cast(self: &Self, l: &Layout, dtype: DType) -> Result<Self> = "to_dtype";
            /// A contiguous copy of the view.
            fn copy_contiguous(self: &Self, l: &Layout) -> Result<Self> = "contiguous";
            /// Writes `src` into the view `dl` of `self` (same dtype and shape).
            fn copy_into(self: &mut Self, dl: &Layout, src: In<'_, Self>) -> Result<()> = "copy_into";
            /// `self[dl] += src` when both are contiguous; `Ok(false)` (nothing done) otherwise.
            fn add_assign_contiguous(
                self: &mut Self,
                dl: &Layout,
                src: In<'_, Self>,
            ) -> Result<bool> = "add_assign";
            /// Elementwise `op` of the view, contiguous out.
            fn unary(x: In<'_, Self>, op: UnaryOp) -> Result<Self> = "unary";
            /// Broadcasting binary op (the layouts broadcast to the output shape).
            fn binary(op: BinaryOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self> = "binary";
            /// Broadcasting comparison, u8 out.
            fn compare(op: CmpOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self> = "compare";
            /// `cond ? t : f`, broadcasting.
            fn where_cond(
                cond: In<'_, Self>,
                t: In<'_, Self>,
                f: In<'_, Self>,
            ) -> Result<Self> = "where_cond";
            /// Reduction of a contiguous buffer viewed as `[outer, red, inner]` over `red`.
            fn reduce(op: ReduceOp, x: In<'_, Self>, d: ReduceDims) -> Result<Self> = "reduce";
            /// The batched product `p` of `a` and `b` with arbitrary strides.
            fn matmul(a: &Self, b: &Self, p: &Product) -> Result<Self> = "matmul";
            /// `torch.gather` along `dim`.
            fn gather(x: In<'_, Self>, index: In<'_, Self>, dim: usize) -> Result<Self> = "gather";
            /// The scatter-add backward of `gather`.
            fn gather_backward(
                dout: In<'_, Self>,
                index: In<'_, Self>,
                x_dims: &[usize],
                dim: usize,
            ) -> Result<Self> = "gather_backward";
            /// Selection of `ids` along the middle of `[outer, x_n, inner]`.
            fn index_select(
                x: In<'_, Self>,
                ids: In<'_, Self>,
                s: Select,
            ) -> Result<Self> = "index_select";
            /// The scatter-add backward of `index_select`.
            fn index_select_backward(
                dout: In<'_, Self>,
                ids: In<'_, Self>,
                s: Select,
            ) -> Result<Self> = "index_select_backward";
        }
    };
}
pub(crate) use backend_ops;

/// Writes the list of [`backend_ops`] as the methods of [`BackendStorage`].
macro_rules! declare {
    ($(;)? $($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $op:literal;)*) => {
        $(
            $(#[$doc])*
            #[allow(clippy::needless_arbitrary_self_type)]
            fn $name($($arg: $ty),*) -> $ret;
        )*
    };
}
pub(crate) use declare;

/// Writes the list of [`backend_ops`] as methods that hand their arguments, in order, to the
/// function of the same name in the module `$m`: `fn cast(self: &Self, l: &Layout, dtype: DType)
/// -> Result<Self> { m::cast(self, l, dtype) }`.
macro_rules! forward {
    ($m:ident; $($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $op:literal;)*) => {
        $(
            #[allow(clippy::needless_arbitrary_self_type)]
            fn $name($($arg: $ty),*) -> $ret {
                $m::$name($($arg),*)
            }
        )*
    };
}
pub(crate) use forward;
