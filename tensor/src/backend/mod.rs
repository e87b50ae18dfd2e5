//! Backend dispatch: the one place that knows which backends exist. Every primitive the tensor
//! ops need is a function here that checks its operands share one device (else
//! [`Error::DeviceMismatch`] naming the op), picks the backend of that device and calls its
//! [`BackendStorage`] method. A new backend implements [`BackendStorage`] on its storage type,
//! adds a [`Storage`] variant, a [`Variant`] impl, one arm of `with_backend!` and one arm in each
//! of the four matches on [`Storage`] below (device, dtype, len, release); the op call sites do
//! not change.
//!
//! The fused ops (`ops/fused/`, one folder each) do not pass here: `ops::fused::run` checks
//! their device itself (with [`device_of`]) and calls their paths.

pub(crate) mod api;

use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use api::In;
pub(crate) use api::{BackendStorage, Distribution, Product};

#[cfg(feature = "cuda")]
use crate::cuda_backend::CudaStorage;
use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Error, Layout, Result};

/// A storage with the layout of the view being read.
pub(crate) type Src<'a> = (&'a Storage, &'a Layout);

/// A backend storage type held by one [`Storage`] variant.
pub(crate) trait Variant: BackendStorage {
    /// The backend storage inside `s` (which the dispatch has checked is on this backend).
    fn of(s: &Storage) -> &Self;
    /// The backend storage inside `s`, mutably.
    fn of_mut(s: &mut Storage) -> &mut Self;
    /// Wraps a backend storage into its variant.
    fn wrap(self) -> Storage;
}

/// Implements [`Variant`] for the backend storage `$S` held by `Storage::$V`.
macro_rules! variant {
    ($S:ty, $V:ident) => {
        impl Variant for $S {
            fn of(s: &Storage) -> &Self {
                #[allow(unreachable_patterns)]
                match s {
                    Storage::$V(c) => c,
                    // The dispatch picks the backend from the operands' common device.
                    _ => unreachable!("dispatch checked the device"),
                }
            }
            fn of_mut(s: &mut Storage) -> &mut Self {
                #[allow(unreachable_patterns)]
                match s {
                    Storage::$V(c) => c,
                    _ => unreachable!("dispatch checked the device"),
                }
            }
            fn wrap(self) -> Storage {
                Storage::$V(self)
            }
        }
    };
}

variant!(CpuStorage, Cpu);
#[cfg(feature = "cuda")]
variant!(CudaStorage, Cuda);

/// Runs `$body` with `$S` the backend storage type of `$device`. The one list of backends.
macro_rules! with_backend {
    ($op:expr, $device:expr, $S:ident => $body:expr) => {
        match $device {
            Device::Cpu => {
                type $S = CpuStorage;
                $body
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                type $S = CudaStorage;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            device @ Device::Cuda(_) => {
                let _ = $op;
                Err(Error::CudaNotBuilt(device))
            }
        }
    };
}

/// The one same-device check: the device every operand is on, or [`Error::DeviceMismatch`]
/// naming `op` and the first two devices that differ.
pub(crate) fn device_of(op: &'static str, operands: &[&Storage]) -> Result<Device> {
    let first = operands.first().map_or(Device::Cpu, |s| s.device());
    for s in operands.iter().skip(1) {
        let d = s.device();
        if d != first {
            return Err(Error::DeviceMismatch {
                op,
                lhs: first,
                rhs: d,
            });
        }
    }
    Ok(first)
}

/// Checks the operands' device (bound to `$d`), then runs `$body` with `$S` that device's backend
/// storage type.
macro_rules! dispatch {
    ($op:expr, [$($x:expr),* $(,)?], $S:ident, $d:ident => $body:expr) => {{
        let $d = device_of($op, &[$($x),*])?;
        with_backend!($op, $d, $S => $body)
    }};
    ($op:expr, slice $ops:expr, $S:ident, $d:ident => $body:expr) => {{
        let $d = device_of($op, $ops)?;
        with_backend!($op, $d, $S => $body)
    }};
}

fn inp<'a, S: Variant>(s: Src<'a>) -> In<'a, S> {
    (S::of(s.0), s.1)
}

#[cfg(test)]
thread_local! {
    static DECLINE_FUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every backend's fused kernels declined on this thread (as a backend without
/// them would), so the tensor ops take their composed fallbacks. Test-only: it is how the
/// fallbacks are checked against the CPU's fused kernels.
#[cfg(test)]
pub(crate) fn with_fused_declined<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            DECLINE_FUSED.with(|d| d.set(self.0));
        }
    }
    let _reset = Reset(DECLINE_FUSED.with(|d| d.replace(true)));
    f()
}

/// Whether fused kernels are declined on this thread (only ever in tests).
pub(crate) fn declined() -> bool {
    #[cfg(test)]
    {
        DECLINE_FUSED.with(|d| d.get())
    }
    #[cfg(not(test))]
    {
        false
    }
}

// ----- identity and memory -----

impl Storage {
    /// The device the buffer lives on.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(s) => s.device(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.device(),
        }
    }

    /// The dtype of the buffer.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => BackendStorage::dtype(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => BackendStorage::dtype(s),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => BackendStorage::len(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => BackendStorage::len(s),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub(crate) fn zeros(device: Device, dtype: DType, len: usize) -> Result<Storage> {
    with_backend!("zeros", device, S => <S as BackendStorage>::zeros(device, dtype, len).map(S::wrap))
}

/// See `BackendStorage::output`.
pub(crate) fn output(device: Device, dtype: DType, len: usize) -> Result<Storage> {
    with_backend!("output", device, S => <S as BackendStorage>::output(device, dtype, len).map(S::wrap))
}

pub(crate) fn full(device: Device, value: f64, dtype: DType, len: usize) -> Result<Storage> {
    with_backend!("full", device, S => S::full(device, value, dtype, len).map(S::wrap))
}

pub(crate) fn from_host(device: Device, host: CpuStorage) -> Result<Storage> {
    with_backend!("from_host", device, S => S::from_host(device, host).map(S::wrap))
}

pub(crate) fn to_host(s: &Storage, l: &Layout) -> Result<CpuStorage> {
    dispatch!("to_host", [s], S, device => S::of(s).to_host(l))
}

pub(crate) fn read_elements(s: &Storage, indices: &[usize]) -> Result<CpuStorage> {
    dispatch!("read_elements", [s], S, device => S::of(s).read_elements(indices))
}

pub(crate) fn random(
    device: Device,
    dtype: DType,
    len: usize,
    seed: u64,
    offset: u64,
    dist: Distribution,
) -> Result<Storage> {
    with_backend!("random", device, S => S::random(device, dtype, len, seed, offset, dist).map(S::wrap))
}

pub(crate) fn arange(device: Device, start: i64, len: usize, dtype: DType) -> Result<Storage> {
    with_backend!("arange", device, S => S::arange(device, start, len, dtype).map(S::wrap))
}

/// Hands a freed buffer to its backend's allocator.
pub(crate) fn release(s: &mut Storage) {
    match s {
        Storage::Cpu(c) => c.release(),
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => c.release(),
    }
}

// ----- basic ops -----

pub(crate) fn cast(s: &Storage, l: &Layout, dtype: DType) -> Result<Storage> {
    dispatch!("to_dtype", [s], S, device => S::of(s).cast(l, dtype).map(S::wrap))
}

pub(crate) fn copy_contiguous(s: &Storage, l: &Layout) -> Result<Storage> {
    dispatch!("contiguous", [s], S, device => S::of(s).copy_contiguous(l).map(S::wrap))
}

pub(crate) fn copy_into(dst: &mut Storage, dl: &Layout, src: Src<'_>) -> Result<()> {
    dispatch!("copy_into", [dst, src.0], S, device => S::of_mut(dst).copy_into(dl, inp::<S>(src)))
}

pub(crate) fn add_assign_contiguous(dst: &mut Storage, dl: &Layout, src: Src<'_>) -> Result<bool> {
    dispatch!("add_assign", [dst, src.0], S, device => S::of_mut(dst).add_assign_contiguous(dl, inp::<S>(src)))
}

pub(crate) fn unary(s: Src<'_>, op: UnaryOp) -> Result<Storage> {
    dispatch!("unary", [s.0], S, device => S::unary(inp::<S>(s), op).map(S::wrap))
}

pub(crate) fn binary(op: BinaryOp, a: Src<'_>, b: Src<'_>) -> Result<Storage> {
    dispatch!("binary", [a.0, b.0], S, device => S::binary(op, inp::<S>(a), inp::<S>(b)).map(S::wrap))
}

pub(crate) fn compare(op: CmpOp, a: Src<'_>, b: Src<'_>) -> Result<Storage> {
    dispatch!("compare", [a.0, b.0], S, device => S::compare(op, inp::<S>(a), inp::<S>(b)).map(S::wrap))
}

pub(crate) fn where_cond(cond: Src<'_>, t: Src<'_>, f: Src<'_>) -> Result<Storage> {
    dispatch!("where_cond", [cond.0, t.0, f.0], S, device => {
        S::where_cond(inp::<S>(cond), inp::<S>(t), inp::<S>(f)).map(S::wrap)
    })
}

pub(crate) fn reduce(
    op: ReduceOp,
    s: Src<'_>,
    outer: usize,
    red: usize,
    inner: usize,
) -> Result<Storage> {
    dispatch!("reduce", [s.0], S, device => S::reduce(op, inp::<S>(s), outer, red, inner).map(S::wrap))
}

pub(crate) fn matmul(a: &Storage, b: &Storage, p: &Product) -> Result<Storage> {
    dispatch!("matmul", [a, b], S, device => S::matmul(S::of(a), S::of(b), p).map(S::wrap))
}

pub(crate) fn gather(x: Src<'_>, index: Src<'_>, dim: usize) -> Result<Storage> {
    dispatch!("gather", [x.0, index.0], S, device => {
        S::gather(inp::<S>(x), inp::<S>(index), dim).map(S::wrap)
    })
}

pub(crate) fn gather_backward(
    dout: Src<'_>,
    index: Src<'_>,
    x_dims: &[usize],
    dim: usize,
) -> Result<Storage> {
    dispatch!("gather_backward", [dout.0, index.0], S, device => {
        S::gather_backward(inp::<S>(dout), inp::<S>(index), x_dims, dim).map(S::wrap)
    })
}

pub(crate) fn index_select(
    x: Src<'_>,
    ids: Src<'_>,
    outer: usize,
    x_n: usize,
    inner: usize,
    dim: usize,
) -> Result<Storage> {
    dispatch!("index_select", [x.0, ids.0], S, device => {
        S::index_select(inp::<S>(x), inp::<S>(ids), outer, x_n, inner, dim).map(S::wrap)
    })
}

pub(crate) fn index_select_backward(
    dout: Src<'_>,
    ids: Src<'_>,
    outer: usize,
    x_n: usize,
    inner: usize,
    dim: usize,
) -> Result<Storage> {
    dispatch!("index_select_backward", [dout.0, ids.0], S, device => {
        S::index_select_backward(inp::<S>(dout), inp::<S>(ids), outer, x_n, inner, dim)
            .map(S::wrap)
    })
}
