//! One [`DeviceContext`] per CUDA device, created at first use and kept for the life of the
//! process: the CUDA context, the compute stream, the kernel modules loaded so far and the
//! caching allocator.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;

use super::memory::BlockCache;
use crate::{Device, Error, Result};

/// A kernel source loaded on a device, and the functions looked up in it so far (so a launch
/// costs one map lookup, not a driver call, after the first).
#[derive(Debug)]
struct LoadedSource {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// Everything the backend keeps per device.
#[derive(Debug)]
pub(crate) struct DeviceContext {
    /// The device ordinal.
    pub ordinal: usize,
    /// The CUDA (primary) context.
    pub ctx: Arc<CudaContext>,
    /// The compute stream: every kernel, copy and free of this device is issued here.
    pub stream: Arc<CudaStream>,
    /// `major * 10 + minor` of the device's compute capability (90 on an H100): the NVRTC
    /// target.
    pub arch: u32,
    /// Free blocks kept for reuse, and the allocator's counters.
    pub cache: BlockCache,
    /// The cuBLASLt state (handle, workspace, cached plans), created at the first matmul.
    pub(crate) blaslt: Mutex<Option<super::blas::BlasLt>>,
    modules: Mutex<HashMap<&'static str, LoadedSource>>,
}

impl DeviceContext {
    /// The device as a [`Device`].
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// Turns a driver error of `what` into an [`Error::Cuda`] naming this device.
    pub fn err(&self, what: &str, e: DriverError) -> Error {
        Error::Cuda {
            device: self.device(),
            message: format!("{what}: {e}"),
        }
    }

    /// Binds the context to the calling thread (needed before raw driver calls; launches through
    /// cudarc's builder do it themselves).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err("binding the context", e))
    }

    /// Kernel `entry` of source `file` (a name in `meshgrad_kernels::cuda::SOURCES`), compiling
    /// and loading the source at its first use; the function is cached after its first lookup.
    pub fn function(&self, file: &'static str, entry: &str) -> Result<CudaFunction> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = match modules.entry(file) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let ptx =
                    meshgrad_kernels::cuda::ptx(file, self.arch).map_err(|e| Error::Cuda {
                        device: self.device(),
                        message: e.to_string(),
                    })?;
                let module = self
                    .ctx
                    .load_module(Ptx::from_src(ptx.as_str()))
                    .map_err(|e| self.err(&format!("loading kernels/cuda/{file}"), e))?;
                v.insert(LoadedSource {
                    module,
                    functions: HashMap::new(),
                })
            }
        };
        if let Some(f) = loaded.functions.get(entry) {
            return Ok(f.clone());
        }
        let f = loaded
            .module
            .load_function(entry)
            .map_err(|e| self.err(&format!("kernel {entry} of kernels/cuda/{file}"), e))?;
        loaded.functions.insert(entry.to_owned(), f.clone());
        Ok(f)
    }

    /// Waits for everything queued on the compute stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| self.err("synchronizing the compute stream", e))
    }
}

/// Whether the CUDA driver library can be loaded; `Err` says why not. cudarc panics on first
/// use when it cannot, so this is checked before anything else.
fn driver_present() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names (and drops
    // the handles); it calls no function from them.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Msg(
            "the CUDA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver on this \
             machine"
                .to_owned(),
        ))
    }
}

/// The number of CUDA devices visible to this process (0 when there is no driver).
pub fn cuda_device_count() -> usize {
    if driver_present().is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// The context of device `ordinal`, created at the first call.
pub(crate) fn context(ordinal: usize) -> Result<Arc<DeviceContext>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<DeviceContext>>>> = OnceLock::new();
    let mut map = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(c) = map.get(&ordinal) {
        return Ok(c.clone());
    }
    let device = Device::Cuda(ordinal);
    driver_present().map_err(|e| Error::Cuda {
        device,
        message: e.to_string(),
    })?;
    let count = cuda_device_count();
    if ordinal >= count {
        return Err(Error::Cuda {
            device,
            message: format!("no such device: {count} CUDA device(s) visible"),
        });
    }
    let cerr = |what: &str, e: DriverError| Error::Cuda {
        device,
        message: format!("{what}: {e}"),
    };
    let ctx = CudaContext::new(ordinal).map_err(|e| cerr("creating the context", e))?;
    // Buffers are raw device pointers ordered by the one compute stream; cudarc's per-slice
    // event tracking is not used.
    // SAFETY: no cudarc `CudaSlice` of this context is shared between streams: the backend
    // issues all work on one stream per device (see the module documentation).
    unsafe { ctx.disable_event_tracking() };
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| cerr("reading the compute capability", e))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| cerr("creating the compute stream", e))?;
    let c = Arc::new(DeviceContext {
        ordinal,
        arch: (major * 10 + minor) as u32,
        cache: BlockCache::default(),
        blaslt: Mutex::new(None),
        modules: Mutex::new(HashMap::new()),
        ctx,
        stream,
    });
    map.insert(ordinal, c.clone());
    Ok(c)
}

/// The caching allocator's counters of one device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaMemoryStats {
    /// Bytes obtained from the driver and not given back (in use plus cached).
    pub reserved: usize,
    /// The most ever reserved.
    pub peak_reserved: usize,
    /// Bytes in blocks handed out and not yet freed.
    pub in_use: usize,
    /// Driver allocations made (a step that allocates nothing after warm-up keeps this fixed).
    pub driver_allocations: u64,
}

/// Waits until everything queued on `device`'s compute stream has run (nothing to wait for on
/// the CPU).
pub fn cuda_synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cuda(n) => context(n)?.synchronize(),
        Device::Cpu => Ok(()),
    }
}

/// The caching allocator's counters of `device`, or an error when it is not a usable CUDA
/// device.
pub fn cuda_memory_stats(device: Device) -> Result<CudaMemoryStats> {
    match device {
        Device::Cuda(n) => Ok(context(n)?.cache.stats()),
        Device::Cpu => Err(Error::Msg(
            "cuda_memory_stats: the CPU has no caching device allocator".to_owned(),
        )),
    }
}
