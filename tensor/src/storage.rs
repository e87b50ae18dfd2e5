//! Storage: the flat buffer behind tensors, per backend, and the releasable cell that holds it.
//!
//! Dispatch is by storage variant, in one place (`crate::backend`): a tensor op asks the dispatch
//! to do the work, which checks the operands share a device and picks that device's
//! `BackendStorage` implementation. Adding a backend adds a variant here and its arm there,
//! never a change at op call sites. GPU backends may queue work; only reads back to the host
//! wait.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::{bf16, f16};

use crate::alloc::Charge;
use crate::{DType, Device, Error, Result};

/// A CPU buffer of one dtype.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// f64 elements.
    F64(Vec<f64>),
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
    /// u8 elements.
    U8(Vec<u8>),
    /// u32 elements.
    U32(Vec<u32>),
    /// i64 elements.
    I64(Vec<i64>),
}

/// Applies `$body` with `$v` bound to the inner Vec of any CpuStorage variant.
#[macro_export]
#[doc(hidden)]
macro_rules! cpu_map {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::storage::CpuStorage::F64($v) => $body,
            $crate::storage::CpuStorage::F32($v) => $body,
            $crate::storage::CpuStorage::BF16($v) => $body,
            $crate::storage::CpuStorage::F16($v) => $body,
            $crate::storage::CpuStorage::U8($v) => $body,
            $crate::storage::CpuStorage::U32($v) => $body,
            $crate::storage::CpuStorage::I64($v) => $body,
        }
    };
}

impl CpuStorage {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::U32(_) => DType::U32,
            CpuStorage::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        cpu_map!(self, v => v.len())
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A zero-filled buffer.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F64 => CpuStorage::F64(vec![0.0; len]),
            DType::F32 => CpuStorage::F32(vec![0.0; len]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; len]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; len]),
            DType::U8 => CpuStorage::U8(vec![0; len]),
            DType::U32 => CpuStorage::U32(vec![0; len]),
            DType::I64 => CpuStorage::I64(vec![0; len]),
        }
    }

    /// The raw little-endian bytes of the buffer.
    pub fn as_bytes(&self) -> &[u8] {
        cpu_map!(self, v => bytemuck::cast_slice(v.as_slice()))
    }
}

/// A buffer on some backend. Only the dispatch place (`backend/mod.rs`) looks inside; its
/// methods (device, dtype, length) are defined there.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuStorage),
    /// Memory of a CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda_backend::CudaStorage),
}

/// A live allocation: the storage and its accounting charge.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub(crate) storage: Storage,
    charge: Charge,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // The backend's allocator takes the buffer back (the CPU recycles large f32 buffers).
        crate::backend::release(&mut self.storage);
    }
}

impl Allocation {
    pub(crate) fn new(storage: Storage) -> Self {
        let bytes = storage.len() * storage.dtype().size_in_bytes();
        let charge = Charge::new(storage.device(), bytes);
        Allocation { storage, charge }
    }
}

/// A callback that materialises a released [`StorageCell`] when an op reads or writes it (see
/// [`crate::Tensor::set_materializer`]). It runs on the thread of the op, with no lock of the
/// cell held, and must put a buffer back (e.g. with [`crate::Tensor::materialize_from`]) or
/// return an error that says why it cannot.
pub type Materializer = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// The shared, releasable home of a storage. Tensors (and views) hold an `Arc` of it. Releasing
/// frees the buffer while every handle (and any autograd graph that references it) stays valid;
/// materialising puts a buffer back.
///
/// Reading or writing a released cell runs its [`Materializer`] first, if it has one (outside the
/// cell's lock, so the materialiser may take the lock itself), then proceeds; without one it is
/// a [`Error::Released`] error, not a crash. Shape, dtype and device queries never need the
/// buffer and never run the materialiser. A materialiser never runs on a rayon pool thread
/// (that is an error): an op that reads tensors inside rayon tasks first calls
/// [`crate::Tensor::ensure_materialized`] on them.
pub struct StorageCell {
    inner: RwLock<Option<Allocation>>,
    materializer: RwLock<Option<Materializer>>,
    lazy: std::sync::atomic::AtomicBool,
    dtype: DType,
    device: Device,
}

impl std::fmt::Debug for StorageCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageCell")
            .field("dtype", &self.dtype)
            .field("device", &self.device)
            .field("materialized", &self.is_materialized())
            .field("has_materializer", &self.has_materializer())
            .finish()
    }
}

impl StorageCell {
    pub(crate) fn new(storage: Storage) -> Arc<Self> {
        let (dtype, device) = (storage.dtype(), storage.device());
        Arc::new(StorageCell {
            inner: RwLock::new(Some(Allocation::new(storage))),
            materializer: RwLock::new(None),
            lazy: std::sync::atomic::AtomicBool::new(false),
            dtype,
            device,
        })
    }

    /// A cell with no buffer yet (released from the start): nothing is allocated until a
    /// materialiser or [`crate::Tensor::materialize_from`] puts one there.
    pub(crate) fn unallocated(dtype: DType, device: Device) -> Arc<Self> {
        Arc::new(StorageCell {
            inner: RwLock::new(None),
            materializer: RwLock::new(None),
            lazy: std::sync::atomic::AtomicBool::new(false),
            dtype,
            device,
        })
    }

    /// The dtype of the storage.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of the storage.
    pub fn device(&self) -> Device {
        self.device
    }

    fn materializer(&self) -> Option<Materializer> {
        self.materializer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Runs the materialiser of a released cell (the caller holds no lock of it); an error if
    /// there is none or it fails.
    fn run_materializer(&self, op: &'static str) -> Result<()> {
        let Some(m) = self.materializer() else {
            return Err(Error::Released { op });
        };
        if rayon::current_thread_index().is_some() {
            // A materialiser may wait for other ranks (a collective); a pool thread blocked on
            // them could starve the ops those ranks need to get there.
            return Err(Error::Msg(format!(
                "{op}: a released tensor was read inside a rayon task, where its materialiser \
                 must not run; the op should call Tensor::ensure_materialized() on its inputs \
                 before spawning tasks"
            )));
        }
        m().map_err(|e| Error::Msg(format!("{op}: materialising a released tensor: {e}")))
    }

    /// The cell through the guard `lock` takes (a read or a write lock), holding a buffer: a
    /// released one is materialised first (the lock dropped meanwhile).
    fn present<G: std::ops::Deref<Target = Option<Allocation>>>(
        &self,
        op: &'static str,
        lock: impl Fn() -> G,
    ) -> Result<G> {
        let g = lock();
        if g.is_some() {
            return Ok(g);
        }
        drop(g);
        self.run_materializer(op)?;
        let g = lock();
        if g.is_none() {
            return Err(Error::Msg(format!(
                "{op}: the tensor's storage is still released after its materialiser ran"
            )));
        }
        Ok(g)
    }

    pub(crate) fn read(&self, op: &'static str) -> Result<StorageRead<'_>> {
        self.present(op, || self.inner.read().unwrap_or_else(|e| e.into_inner()))
            .map(StorageRead)
    }

    pub(crate) fn write(&self, op: &'static str) -> Result<StorageWrite<'_>> {
        self.present(op, || self.inner.write().unwrap_or_else(|e| e.into_inner()))
            .map(StorageWrite)
    }

    /// Whether the buffer is present. Never blocks: a cell whose lock is held (by an op using
    /// it, or by a materialisation in progress) counts as present.
    pub fn is_materialized(&self) -> bool {
        match self.inner.try_read() {
            Ok(g) => g.is_some(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().is_some(),
            Err(std::sync::TryLockError::WouldBlock) => true,
        }
    }

    /// Counts the buffer (if present) under `tag` in its tracker from now on.
    pub fn retag(&self, tag: crate::alloc::MemoryTag) {
        if let Some(a) = self
            .inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            a.charge.retag(tag);
        }
    }

    /// Frees the buffer (a no-op if already released), waiting for ops using it to finish.
    pub fn release(&self) {
        let old = self.inner.write().unwrap_or_else(|e| e.into_inner()).take();
        drop(old);
    }

    /// Frees the buffer unless an op is using it right now (its lock is held, possibly by the
    /// calling thread). Returns whether the cell is released afterwards.
    pub fn try_release(&self) -> bool {
        let old = match self.inner.try_write() {
            Ok(mut g) => g.take(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().take(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        drop(old);
        true
    }

    /// Installs (or with `None` removes) the materialiser; returns the previous one.
    pub fn set_materializer(&self, m: Option<Materializer>) -> Option<Materializer> {
        let mut g = self.materializer.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *g, m)
    }

    /// Marks the cell as waiting for its delayed initialisation (or not).
    pub(crate) fn set_lazy(&self, lazy: bool) {
        self.lazy.store(lazy, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the cell waits for its delayed initialisation.
    pub fn is_lazy(&self) -> bool {
        self.lazy.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a materialiser is installed.
    pub fn has_materializer(&self) -> bool {
        self.materializer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Installs `storage` as the buffer, replacing any present one. Its dtype and device must be
    /// the cell's.
    pub(crate) fn materialize(&self, storage: Storage) -> Result<()> {
        if storage.dtype() != self.dtype || storage.device() != self.device {
            crate::bail!(
                "materialize: storage of {} on {} does not fit a cell of {} on {}",
                storage.dtype(),
                storage.device(),
                self.dtype,
                self.device
            );
        }
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) = Some(Allocation::new(storage));
        Ok(())
    }
}

/// A read guard on a materialised storage.
pub(crate) struct StorageRead<'a>(RwLockReadGuard<'a, Option<Allocation>>);

impl std::ops::Deref for StorageRead<'_> {
    type Target = Storage;
    fn deref(&self) -> &Storage {
        // The constructor checked the option is Some, and the guard keeps it so.
        &self.0.as_ref().expect("checked materialised").storage
    }
}

/// A write guard on a materialised storage.
pub(crate) struct StorageWrite<'a>(RwLockWriteGuard<'a, Option<Allocation>>);

impl std::ops::Deref for StorageWrite<'_> {
    type Target = Storage;
    fn deref(&self) -> &Storage {
        &self.0.as_ref().expect("checked materialised").storage
    }
}

impl std::ops::DerefMut for StorageWrite<'_> {
    fn deref_mut(&mut self) -> &mut Storage {
        &mut self.0.as_mut().expect("checked materialised").storage
    }
}
