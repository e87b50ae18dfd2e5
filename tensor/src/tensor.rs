//! The tensor handle: a cheap `Arc` over a storage cell plus a strided layout.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::storage::{CpuStorage, Storage, StorageCell};
use crate::{DType, Device, Error, Layout, Result, Shape, WithDType};

/// A process-unique tensor identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

struct TensorInner {
    id: TensorId,
    storage: Arc<StorageCell>,
    layout: Layout,
}

/// An n-dimensional array on a device. Cloning is cheap (an `Arc`); views (reshape of contiguous
/// data, permute, narrow, expand) share storage. Ops return `Result` with errors naming the
/// shapes, dtypes and devices involved. `Display` and `Debug` print the values (see
/// [`Tensor::fmt_named`] for the format).
#[derive(Clone)]
pub struct Tensor(Arc<TensorInner>);

impl Tensor {
    /// A tensor of `shape` whose storage is not allocated (it starts released, see
    /// [`Tensor::release_storage`]): shape, dtype and device queries work, reading or writing
    /// it is an error until [`Tensor::materialize_from`] (or a materialiser) gives it data.
    /// Models are built this way to learn their parameters' names and shapes without
    /// allocating them (a "meta" build).
    ///
    /// ```
    /// use meshgrad_tensor::{DType, Device, Tensor};
    /// let t = Tensor::unallocated((1 << 20, 1 << 20), DType::F32, Device::Cpu);
    /// assert_eq!(t.dims(), &[1 << 20, 1 << 20]);
    /// assert!(!t.is_materialized());
    /// assert!(t.to_vec::<f32>().is_err());
    /// ```
    pub fn unallocated(shape: impl Into<Shape>, dtype: DType, device: crate::Device) -> Tensor {
        Tensor(Arc::new(TensorInner {
            id: TensorId::next(),
            storage: StorageCell::unallocated(dtype, device),
            layout: Layout::contiguous(shape),
        }))
    }

    pub(crate) fn from_storage(storage: Storage, shape: impl Into<Shape>) -> Tensor {
        let layout = Layout::contiguous(shape);
        debug_assert_eq!(layout.shape().elem_count(), storage.len());
        Tensor(Arc::new(TensorInner {
            id: TensorId::next(),
            storage: StorageCell::new(storage),
            layout,
        }))
    }

    pub(crate) fn view_with(&self, layout: Layout) -> Tensor {
        Tensor(Arc::new(TensorInner {
            id: TensorId::next(),
            storage: self.0.storage.clone(),
            layout,
        }))
    }

    /// This tensor's identity (views get their own).
    pub fn id(&self) -> TensorId {
        self.0.id
    }

    /// The layout (shape, strides, offset).
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        self.0.layout.shape()
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.0.layout.dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims().len()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape().elem_count()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }

    /// Whether the layout is row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// Resolves a possibly negative dim against this tensor's rank.
    pub fn dim(&self, op: &'static str, dim: isize) -> Result<usize> {
        self.shape().dim(op, dim)
    }

    /// Size of dimension `dim` (negative counts from the end).
    pub fn size(&self, dim: isize) -> Result<usize> {
        Ok(self.dims()[self.dim("size", dim)?])
    }

    /// Whether this handle is the only one to its storage: no clone of it and no view of the same
    /// storage exists, so an in-place update cannot be observed by anyone else.
    pub fn is_exclusive(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && Arc::strong_count(&self.0.storage) == 1
    }

    /// Whether both tensors share one storage cell.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    // ----- constructors -----

    /// A tensor holding `data` with `shape` on `device`.
    pub fn from_vec<T: WithDType>(
        data: Vec<T>,
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<Tensor> {
        Tensor::from_cpu(T::into_cpu_storage(data), shape, device)
    }

    /// A tensor copied from a slice.
    pub fn from_slice<T: WithDType>(
        data: &[T],
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A tensor from a CPU buffer, moved to `device`; the buffer must fill `shape` exactly.
    pub fn from_cpu(
        storage: CpuStorage,
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        if storage.len() != shape.elem_count() {
            crate::bail!(
                "from_vec/from_cpu: {} elements do not fill shape {shape} ({} elements)",
                storage.len(),
                shape.elem_count()
            );
        }
        device.check_available()?;
        Ok(Tensor::from_storage(
            Storage::from_host(device, storage)?,
            shape,
        ))
    }

    /// A 0-dimensional tensor holding `value` converted to `dtype`.
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(value, (), dtype, device)
    }

    /// A tensor filled with `value`.
    pub fn full(
        value: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        device.check_available()?;
        let n = shape.elem_count();
        let _prof = crate::profile::scope("full");
        Ok(Tensor::from_storage(
            Storage::full(device, value, dtype, n)?,
            shape,
        ))
    }

    /// Zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        let _prof = crate::profile::scope("zeros");
        let shape = shape.into();
        device.check_available()?;
        Ok(Tensor::from_storage(
            Storage::zeros(device, dtype, shape.elem_count())?,
            shape,
        ))
    }

    /// Ones.
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(1.0, shape, dtype, device)
    }

    /// Zeros of this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self.dtype(), self.device())
    }

    /// Ones of this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), self.dtype(), self.device())
    }

    /// `[start, start+1, ..., end-1]`.
    pub fn arange(start: i64, end: i64, dtype: DType, device: Device) -> Result<Tensor> {
        device.check_available()?;
        let n = (end.max(start) - start) as usize;
        Ok(Tensor::from_storage(
            Storage::arange(device, start, n, dtype)?,
            n,
        ))
    }

    // ----- reading back -----

    /// The elements in row-major order as `T` (which must be this tensor's dtype). Waits for
    /// queued device work.
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        self.dtype().matching("to_vec", T::DTYPE)?;
        let c = self.contiguous()?;
        let g = c.0.storage.read("to_vec")?;
        let host = Storage::to_host(&g, c.layout())?;
        Ok(T::from_cpu_storage(host).expect("dtype checked"))
    }

    /// The elements converted to f64.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        self.to_dtype(DType::F64)?.to_vec::<f64>()
    }

    /// The elements converted to f32.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        self.to_dtype(DType::F32)?.to_vec::<f32>()
    }

    /// The value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            crate::bail!(
                "item: tensor of shape {} has {} elements, not 1",
                self.shape(),
                self.elem_count()
            );
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// A contiguous CPU copy of the elements (for serialisation).
    pub fn to_cpu_storage(&self) -> Result<CpuStorage> {
        let c = self.contiguous()?;
        let g = c.0.storage.read("to_cpu_storage")?;
        Storage::to_host(&g, c.layout())
    }

    // ----- conversions -----

    /// A copy converted to `dtype` (or `self` if already of it).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let _prof = crate::profile::scope("to_dtype");
        let g = self.0.storage.read("to_dtype")?;
        let s = Storage::cast(&g, self.layout(), dtype)?;
        Ok(Tensor::from_storage(s, self.shape()))
    }

    /// A copy on `device` (or `self` if already there), staged through host memory (backends
    /// have no direct device-to-device copy yet).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        device.check_available()?;
        let _prof = crate::profile::scope("to_device");
        let host = {
            let g = self.0.storage.read("to_device")?;
            Storage::to_host(&g, self.layout())?
        };
        Ok(Tensor::from_storage(
            Storage::from_host(device, host)?,
            self.shape(),
        ))
    }

    /// A contiguous tensor with the same values: `self` if already contiguous (at any offset),
    /// else a copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let _prof = crate::profile::scope("contiguous");
        let g = self.0.storage.read("contiguous")?;
        let s = Storage::copy_contiguous(&g, self.layout())?;
        Ok(Tensor::from_storage(s, self.shape()))
    }

    /// A contiguous copy that never shares storage with `self`.
    pub fn deep_clone(&self) -> Result<Tensor> {
        let _prof = crate::profile::scope("deep_clone");
        let g = self.0.storage.read("deep_clone")?;
        let s = Storage::copy_contiguous(&g, self.layout())?;
        Ok(Tensor::from_storage(s, self.shape()))
    }

    // ----- views -----

    /// The same elements with a new shape of equal element count: a view when the layout
    /// allows it, else a copy. The target is any [`IntoShapeSpec`](crate::IntoShapeSpec): a
    /// shape (`(2, 3)`, `[4, 6]`, `&dims`, `n`) or a signed spec with one inferred `-1`
    /// (`(b, t, -1)`, `&[b as isize, -1]`, `-1` to flatten); see [`ShapeSpec`](crate::ShapeSpec).
    ///
    /// ```
    /// use meshgrad_tensor::{DType, Device, Tensor};
    /// let x = Tensor::zeros((2, 3, 4), DType::F32, Device::Cpu)?;
    /// assert_eq!(x.reshape((6, -1))?.dims(), &[6, 4]);
    /// let e = x.reshape((5, -1)).unwrap_err().to_string();
    /// assert!(e.contains("[2, 3, 4] (24 elements) into [5, -1]"), "{e}");
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn reshape(&self, spec: impl crate::IntoShapeSpec) -> Result<Tensor> {
        let shape = spec.into_shape_spec().resolve("reshape", self.shape())?;
        match self.layout().reshape_view(&shape) {
            Some(l) => Ok(self.view_with(l)),
            None => self.deep_clone()?.reshape(shape),
        }
    }

    /// Reorders dimensions: result dim `i` is `self` dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        Ok(self.view_with(self.layout().permute(perm)?))
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (self.dim("transpose", d0)?, self.dim("transpose", d1)?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Swaps the last two dimensions.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            crate::bail!("t: needs at least 2 dims, got shape {}", self.shape());
        }
        self.transpose(-2, -1)
    }

    /// Elements `start..start+len` along `dim` (a view).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = self.dim("narrow", dim)?;
        Ok(self.view_with(self.layout().narrow(d, start, len)?))
    }

    /// Broadcasts to `shape` without copying (stride 0 on stretched dims).
    pub fn expand(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        Ok(self.view_with(self.layout().broadcast_as(&shape.into())?))
    }

    /// Inserts a dimension of size 1 at `dim` (`0..=rank`; negative counts from the end).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let rank = self.rank() as isize;
        let d = if dim < 0 { dim + rank + 1 } else { dim };
        if d < 0 || d > rank {
            return Err(Error::DimOutOfRange {
                op: "unsqueeze",
                dim,
                shape: self.shape().clone(),
            });
        }
        let d = d as usize;
        let mut dims = self.dims().to_vec();
        let mut strides = self.layout().strides().to_vec();
        let stride = if d < strides.len() {
            strides[d] * dims[d]
        } else {
            1
        };
        dims.insert(d, 1);
        strides.insert(d, stride);
        Ok(self.view_with(Layout::new(
            Shape::new(dims),
            strides,
            self.layout().offset(),
        )))
    }

    /// Removes dimension `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = self.dim("squeeze", dim)?;
        if self.dims()[d] != 1 {
            crate::bail!(
                "squeeze: dim {d} of shape {} has size {}, not 1",
                self.shape(),
                self.dims()[d]
            );
        }
        let mut dims = self.dims().to_vec();
        let mut strides = self.layout().strides().to_vec();
        dims.remove(d);
        strides.remove(d);
        Ok(self.view_with(Layout::new(
            Shape::new(dims),
            strides,
            self.layout().offset(),
        )))
    }

    /// Splits `dim` into consecutive pieces of the given sizes (views).
    pub fn split(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = self.dim("split", dim)?;
        let total: usize = sizes.iter().sum();
        if total != self.dims()[d] {
            crate::bail!(
                "split: sizes {sizes:?} sum to {total}, but dim {d} of shape {} has size {}",
                self.shape(),
                self.dims()[d]
            );
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let t = self.narrow(d as isize, start, len);
                start += len;
                t
            })
            .collect()
    }

    /// Splits `dim` into `n` equal pieces (views); the size must divide evenly.
    pub fn chunk(&self, n: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = self.dim("chunk", dim)?;
        let size = self.dims()[d];
        if n == 0 || !size.is_multiple_of(n) {
            crate::bail!(
                "chunk: dim {d} of shape {} (size {size}) does not split into {n} equal chunks",
                self.shape()
            );
        }
        self.split(&vec![size / n; n], dim)
    }

    // ----- releasable storage -----

    /// Frees this tensor's storage while keeping every handle valid; until
    /// [`Tensor::materialize_from`] puts data back, an op that reads or writes it runs the
    /// storage's materialiser ([`Tensor::set_materializer`]) or, without one, fails with a
    /// "released" error. Views share the state. Waits for ops using the storage to finish.
    pub fn release_storage(&self) {
        self.0.storage.release()
    }

    /// Like [`Tensor::release_storage`], but leaves the storage alone if an op is using it right
    /// now (possibly on this thread). Returns whether the storage is released afterwards.
    pub fn try_release_storage(&self) -> bool {
        self.0.storage.try_release()
    }

    /// Counts this tensor's storage (shared with its views) under `tag` in the memory tracker
    /// from now on, e.g. a gradient the backward computed as
    /// [`MemoryTag::Grads`](crate::alloc::MemoryTag::Grads). Accounting only; the data is
    /// untouched.
    pub fn retag_memory(&self, tag: crate::alloc::MemoryTag) {
        self.0.storage.retag(tag)
    }

    /// Whether the storage is present (never blocks; storage in use counts as present).
    pub fn is_materialized(&self) -> bool {
        self.0.storage.is_materialized()
    }

    /// Installs a materialiser on this tensor's storage (shared by its views), or removes it with
    /// `None`; returns the previous one. When an op reads or writes the storage while it is
    /// released, the materialiser runs first (on the op's thread, no lock of the storage held)
    /// and must materialise it ([`Tensor::materialize_from`]); then the op proceeds. Shape,
    /// dtype and device queries never run it. Sharded data parallelism (ZeRO-3 / FSDP) uses it
    /// to gather a parameter's unit when the parameter is first read. It replaces a delayed
    /// initialisation ([`Tensor::set_lazy_values`]) not yet run.
    pub fn set_materializer(
        &self,
        m: Option<crate::storage::Materializer>,
    ) -> Option<crate::storage::Materializer> {
        self.0.storage.set_lazy(false);
        self.0.storage.set_materializer(m)
    }

    /// Makes the storage present now, on this thread: runs its materialiser if it is released
    /// (an error if it is released with none). Ops that read tensors inside rayon tasks call it
    /// on them first, since a materialiser must not run on a pool thread.
    pub fn ensure_materialized(&self) -> Result<()> {
        if self.is_materialized() {
            return Ok(());
        }
        self.0.storage.read("ensure_materialized").map(drop)
    }

    /// Whether this tensor's storage has a materialiser.
    pub fn has_materializer(&self) -> bool {
        self.0.storage.has_materializer()
    }

    /// Re-materialises a (released or live) storage with the values of `src`, which must be
    /// contiguous-compatible: same dtype, device and element count as the whole storage this
    /// tensor views. `self` must be a full contiguous view of its storage.
    pub fn materialize_from(&self, src: &Tensor) -> Result<()> {
        self.dtype().matching("materialize_from", src.dtype())?;
        if src.elem_count() != self.elem_count()
            || !self.is_contiguous()
            || self.layout().offset() != 0
        {
            crate::bail!(
                "materialize_from: source of shape {} does not fill the contiguous tensor of shape {}",
                src.shape(),
                self.shape()
            );
        }
        let g = src.0.storage.read("materialize_from")?;
        let s = Storage::copy_contiguous(&g, src.layout())?;
        drop(g);
        self.0.storage.materialize(s)
    }

    /// Delayed initialisation: gives this unallocated tensor (see [`Tensor::unallocated`]) its
    /// values on first use. The first op that reads or writes it runs `values` (which must return
    /// a tensor of this shape, dtype and device), keeps the result as the storage and forgets
    /// `values`; until then nothing is allocated. The storage is charged to the memory tag that
    /// was active when `set_lazy_values` was called. [`Tensor::is_lazy`] tells such a tensor apart
    /// from one released by a sharding wrapper. The closure holds no handle on this tensor, so a
    /// tensor dropped before its first use frees everything.
    ///
    /// ```
    /// use meshgrad_tensor::{DType, Device, Tensor};
    /// let t = Tensor::unallocated(3, DType::F32, Device::Cpu);
    /// t.set_lazy_values(|| Tensor::from_vec(vec![1f32, 2., 3.], 3, Device::Cpu))?;
    /// assert!(t.is_lazy() && !t.is_materialized());
    /// assert_eq!(t.to_vec::<f32>()?, vec![1., 2., 3.]);
    /// assert!(!t.is_lazy() && t.is_materialized());
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn set_lazy_values(
        &self,
        values: impl Fn() -> Result<Tensor> + Send + Sync + 'static,
    ) -> Result<()> {
        if self.is_materialized() || !self.is_contiguous() || self.layout().offset() != 0 {
            crate::bail!(
                "set_lazy_values: the tensor of shape {} must be a whole unallocated tensor",
                self.shape()
            );
        }
        let cell = Arc::downgrade(&self.0.storage);
        let (shape, dtype, device) = (self.shape().clone(), self.dtype(), self.device());
        let tag = crate::alloc::current_tag();
        self.0.storage.set_lazy(true);
        self.0.storage.set_materializer(Some(Arc::new(move || {
            crate::alloc::with_tag(tag, || -> Result<()> {
                let Some(cell) = cell.upgrade() else {
                    return Ok(());
                };
                let v = values()?;
                if v.shape() != &shape || v.dtype() != dtype || v.device() != device {
                    crate::bail!(
                    "delayed initialisation: the values are {} {} on {:?}, the tensor is {shape} \
                     {dtype} on {device:?}",
                    v.shape(),
                    v.dtype(),
                    v.device()
                );
                }
                let g = v.0.storage.read("set_lazy_values")?;
                let s = Storage::copy_contiguous(&g, v.layout())?;
                drop(g);
                cell.materialize(s)?;
                cell.set_lazy(false);
                cell.set_materializer(None);
                Ok(())
            })
        })));
        Ok(())
    }

    /// Whether this tensor still waits for its delayed initialisation ([`Tensor::set_lazy_values`]).
    pub fn is_lazy(&self) -> bool {
        self.0.storage.is_lazy()
    }

    pub(crate) fn read_storage(&self, op: &'static str) -> Result<crate::storage::StorageRead<'_>> {
        self.0.storage.read(op)
    }

    pub(crate) fn write_storage(
        &self,
        op: &'static str,
    ) -> Result<crate::storage::StorageWrite<'_>> {
        self.0.storage.write(op)
    }
}
