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

use api::{backend_ops, In, ReduceDims, Select};
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
    same_device(op, operands.iter().map(|s| s.device()))
}

/// The device all of `devices` name (the CPU when there are none), or [`Error::DeviceMismatch`]
/// naming `op` and the first two that differ.
fn same_device(op: &'static str, devices: impl IntoIterator<Item = Device>) -> Result<Device> {
    let mut devices = devices.into_iter();
    let first = devices.next().unwrap_or(Device::Cpu);
    for d in devices {
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

/// Writes the list of [`backend_ops`] as `Storage` methods with the backend trait's signatures
/// (`Self` is now [`Storage`]): each checks that its operands share one device, then calls that
/// device's backend with the operands unwrapped ([`Arg`]) and wraps its result ([`Lift`]).
macro_rules! dispatch {
    (; $($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $op:literal;)*) => {
        impl Storage {
            $(
                $(#[$doc])*
                #[allow(clippy::needless_arbitrary_self_type)]
                pub(crate) fn $name($($arg: $ty),*) -> $ret {
                    let device = same_device($op, [$(Arg::fixed_device(&$arg)),*].into_iter().flatten())?;
                    with_backend!($op, device, S => {
                        <S as BackendStorage>::$name($(Arg::on::<S>($arg)),*).map(Lift::lift)
                    })
                }
            )*
        }
    };
}

/// An argument of a dispatched method, as the backend `S` takes it: a storage (alone or with its
/// layout) becomes `S`'s storage inside it; anything else passes unchanged.
trait Arg: Sized {
    /// The argument as backend `S` takes it.
    type On<S: Variant>;
    /// The device this argument fixes: a storage's, or a [`Device`] argument itself.
    fn fixed_device(&self) -> Option<Device> {
        None
    }
    /// The argument for backend `S` (which the dispatch picked from [`Arg::fixed_device`]).
    fn on<S: Variant>(self) -> Self::On<S>;
}

impl<'a> Arg for &'a Storage {
    type On<S: Variant> = &'a S;
    fn fixed_device(&self) -> Option<Device> {
        Some(Storage::device(self))
    }
    fn on<S: Variant>(self) -> &'a S {
        S::of(self)
    }
}

impl<'a> Arg for &'a mut Storage {
    type On<S: Variant> = &'a mut S;
    fn fixed_device(&self) -> Option<Device> {
        Some(Storage::device(self))
    }
    fn on<S: Variant>(self) -> &'a mut S {
        S::of_mut(self)
    }
}

impl<'a> Arg for Src<'a> {
    type On<S: Variant> = In<'a, S>;
    fn fixed_device(&self) -> Option<Device> {
        Some(self.0.device())
    }
    fn on<S: Variant>(self) -> In<'a, S> {
        (S::of(self.0), self.1)
    }
}

impl Arg for Device {
    type On<S: Variant> = Device;
    fn fixed_device(&self) -> Option<Device> {
        Some(*self)
    }
    fn on<S: Variant>(self) -> Device {
        self
    }
}

/// [`Arg`] for arguments that pass unchanged.
macro_rules! unchanged {
    ($($t:ty),*) => {
        $(impl<'a> Arg for $t {
            type On<S: Variant> = Self;
            fn on<S: Variant>(self) -> Self {
                self
            }
        })*
    };
}
unchanged!(
    DType,
    usize,
    u64,
    i64,
    f64,
    CpuStorage,
    Distribution,
    UnaryOp,
    BinaryOp,
    CmpOp,
    ReduceOp,
    ReduceDims,
    Select
);
unchanged!(&'a Layout, &'a [usize], &'a Product);

/// A backend method's result as the dispatch returns it: a backend storage wrapped into its
/// [`Storage`] variant; anything else unchanged.
trait Lift<T> {
    /// `self` as the dispatch returns it.
    fn lift(self) -> T;
}

impl<S: Variant> Lift<Storage> for S {
    fn lift(self) -> Storage {
        self.wrap()
    }
}

/// [`Lift`] for results that pass unchanged.
macro_rules! same {
    ($($t:ty),*) => {
        $(impl Lift<$t> for $t {
            fn lift(self) -> $t {
                self
            }
        })*
    };
}
same!((), bool, CpuStorage);

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

/// Hands a freed buffer to its backend's allocator.
pub(crate) fn release(s: &mut Storage) {
    match s {
        Storage::Cpu(c) => c.release(),
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => c.release(),
    }
}

backend_ops!(dispatch);
