//! Kernel launches: [`KernelArgs`] collects a kernel's parameters by value (device pointers as
//! `u64`, sizes, op codes, the `#[repr(C)]` argument structs of `meshgrad_kernels::cuda`), and
//! [`DeviceContext::launch`] launches entry `entry` of `kernels/cuda/<file>` on the compute
//! stream. This is the backend's one raw launch.

use std::ffi::c_void;

use cudarc::driver::{result, DeviceRepr};

use super::context::DeviceContext;
use crate::{Error, Result};

/// One launch of entry `entry` of `kernels/cuda/<file>`: its grid, block, dynamic shared memory
/// and parameters `args`, in the kernel's order. The basic ops hold them as raw [`KernelArgs`]
/// (`basic::args::Launch`), the fused ops as typed lists that their tests compare with the
/// kernels' signatures (`fused::args::Launch`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct KernelLaunch<A> {
    /// The source file (a name of `meshgrad_kernels::cuda::SOURCES`).
    pub file: &'static str,
    /// The `extern "C"` entry point.
    pub entry: String,
    /// Blocks per grid dimension.
    pub grid: (u32, u32, u32),
    /// Threads per block dimension.
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory.
    pub shared: u32,
    /// The parameters, in the kernel's order.
    pub args: A,
}

impl KernelLaunch<KernelArgs> {
    /// Launches on `ctx`'s compute stream (the arguments are checked against the kernel's
    /// declaration there; see [`DeviceContext::launch`]).
    pub fn run(self, ctx: &DeviceContext) -> Result<()> {
        ctx.launch(
            self.file,
            &self.entry,
            self.grid,
            self.block,
            self.shared,
            self.args,
        )
    }
}

/// The parameters of one launch, in the kernel's order: their bytes in 8-byte-aligned slots of
/// one buffer (no allocation per parameter), with each one's slot offset and size. The
/// addresses handed to the driver are taken at launch, when the buffer no longer grows.
#[derive(Default)]
pub(crate) struct KernelArgs {
    words: Vec<u64>,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

impl KernelArgs {
    /// An empty parameter list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one parameter (`u64` for a device pointer).
    pub fn arg<T: DeviceRepr + Copy + 'static>(mut self, value: T) -> Self {
        const { assert!(std::mem::align_of::<T>() <= 8) };
        let size = std::mem::size_of::<T>();
        let at = self.words.len();
        self.words.resize(at + size.div_ceil(8), 0);
        // SAFETY: the slots from `at` hold at least `size` bytes, are 8-byte aligned (enough
        // for `T`, asserted above) and are not otherwise borrowed; `T` is `Copy`.
        unsafe { std::ptr::write_unaligned(self.words[at..].as_mut_ptr().cast::<T>(), value) };
        self.offsets.push(at);
        self.sizes.push(size);
        self
    }

    /// The address of each parameter's bytes, in order (valid while `self` is not modified).
    fn pointers(&mut self) -> Vec<*mut c_void> {
        let base = self.words.as_mut_ptr();
        self.offsets
            .iter()
            // SAFETY: every offset is inside `words` (pushed with its slots).
            .map(|&at| unsafe { base.add(at) }.cast::<c_void>())
            .collect()
    }

    /// The byte size of each parameter, in order (checked against the kernel's declaration by
    /// [`super::signature::check_args`]).
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }
}

/// A [`KernelArgs`] of the given parameters, in order: `kernel_args![x, out, n as i64]` is
/// `KernelArgs::new().arg(x).arg(out).arg(n as i64)`.
macro_rules! kernel_args {
    ($($value:expr),* $(,)?) => {
        $crate::cuda_backend::KernelArgs::new()$(.arg($value))*
    };
}
pub(crate) use kernel_args;

/// Threads per block of the 1-D elementwise launches.
pub(crate) const BLOCK: u32 = 256;

/// A 1-D grid covering `n` threads in blocks of `block` (at least one block).
pub(crate) fn grid_for(n: usize, block: u32) -> (u32, u32, u32) {
    let blocks = n.div_ceil(block as usize).max(1);
    (blocks.min(u32::MAX as usize) as u32, 1, 1)
}

impl DeviceContext {
    /// Launches `entry` of `kernels/cuda/<file>` with `grid` x `block` threads and `shared`
    /// bytes of dynamic shared memory on the compute stream.
    ///
    /// The caller promises what the kernel needs: `args` in the order and types of the
    /// kernel's parameters, every pointer a live buffer of this device large enough for the
    /// indices the kernel reads and writes. The argument sizes are checked against the kernel's
    /// declaration first (see [`super::signature`]): a mismatch is an [`Error::Cuda`] naming
    /// the entry and both size lists, and nothing is launched.
    pub fn launch(
        &self,
        file: &'static str,
        entry: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        mut args: KernelArgs,
    ) -> Result<()> {
        super::signature::check_args(file, entry, args.sizes()).map_err(|e| Error::Cuda {
            device: self.device(),
            message: e.to_string(),
        })?;
        let f = self.function(file, entry)?;
        self.bind()?;
        let mut ptrs = args.pointers();
        // SAFETY: `f` is a function of a module loaded on this context (kept alive by the
        // module cache); `ptrs` point into `args`' buffer, not modified and alive for the call
        // (the driver copies parameter values at launch); the caller guarantees the parameter
        // list matches the kernel (see above). Buffers read or written by the kernel stay
        // valid until it runs: blocks are freed into the cache in stream order.
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                grid,
                block,
                shared,
                self.stream.cu_stream(),
                &mut ptrs,
            )
        }
        .map_err(|e| self.err(&format!("launching {entry}"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_keep_their_values() {
        let mut a = KernelArgs::new().arg(7u64).arg(-3i32);
        for i in 0..100i64 {
            a = a.arg(i);
        }
        let p = a.pointers();
        // SAFETY: the pointers point at the u64, the i32 and the last i64 pushed, in `a`.
        let (x, y, z) = unsafe {
            (
                *(p[0] as *const u64),
                *(p[1] as *const i32),
                *(p[101] as *const i64),
            )
        };
        assert_eq!((x, y, z), (7, -3, 99));
        // A struct argument (136 bytes) keeps every field, and the next argument follows it.
        let g = meshgrad_kernels::cuda::GatherArgs {
            ndim: 3,
            dim: 1,
            ..Default::default()
        };
        let mut b = KernelArgs::new().arg(1u8).arg(g).arg(5i32);
        let q = b.pointers();
        // SAFETY: `q[1]` points at the GatherArgs pushed second, `q[2]` at the i32 after it.
        let (g2, five) = unsafe {
            (
                std::ptr::read_unaligned(q[1] as *const meshgrad_kernels::cuda::GatherArgs),
                *(q[2] as *const i32),
            )
        };
        assert_eq!((g2, five), (g, 5));
        assert_eq!(b.sizes(), &[1, 136, 4]);
        assert_eq!(&a.sizes()[..3], &[8, 4, 8]);
        assert_eq!(a.sizes().len(), 102);
        assert_eq!(grid_for(0, 256), (1, 1, 1));
        assert_eq!(grid_for(257, 256), (2, 1, 1));
    }
}
