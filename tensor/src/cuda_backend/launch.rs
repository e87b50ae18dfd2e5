//! Kernel launches: [`KernelArgs`] collects a kernel's parameters by value (device pointers as
//! `u64`, sizes, op codes, the `#[repr(C)]` argument structs of `meshgrad_kernels::cuda`), and
//! [`DeviceContext::launch`] launches entry `entry` of `kernels/cuda/<file>` on the compute
//! stream. This is the backend's one raw launch.

use std::any::Any;
use std::ffi::c_void;

use cudarc::driver::{result, DeviceRepr};

use super::context::DeviceContext;
use crate::{Error, Result};

/// The parameters of one launch, in the kernel's order. Each value is boxed so the addresses
/// handed to the driver stay fixed while the list grows.
#[derive(Default)]
pub(crate) struct KernelArgs {
    owned: Vec<Box<dyn Any>>,
    ptrs: Vec<*mut c_void>,
    sizes: Vec<usize>,
}

impl KernelArgs {
    /// An empty parameter list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one parameter (`u64` for a device pointer).
    pub fn arg<T: DeviceRepr + Copy + 'static>(mut self, value: T) -> Self {
        let b = Box::new(value);
        self.ptrs.push(&*b as *const T as *mut c_void);
        self.owned.push(b);
        self.sizes.push(std::mem::size_of::<T>());
        self
    }

    /// The byte size of each parameter, in order (checked against the kernel's declaration by
    /// [`super::signature::check_args`]).
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }
}

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
        // SAFETY: `f` is a function of a module loaded on this context (kept alive by the
        // module cache); `args.ptrs` point at boxed values owned by `args`, alive for the call
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
                &mut args.ptrs,
            )
        }
        .map_err(|e| self.err(&format!("launching {entry}"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_keep_their_values_at_fixed_addresses() {
        let mut a = KernelArgs::new().arg(7u64).arg(-3i32);
        let first = a.ptrs[0];
        for i in 0..100i64 {
            a = a.arg(i);
        }
        assert_eq!(a.ptrs[0], first);
        // SAFETY: the pointers point at the boxed u64 and i32 pushed first.
        let (x, y) = unsafe { (*(a.ptrs[0] as *const u64), *(a.ptrs[1] as *const i32)) };
        assert_eq!((x, y), (7, -3));
        assert_eq!(&a.sizes()[..3], &[8, 4, 8]);
        assert_eq!(a.sizes().len(), 102);
        assert_eq!(grid_for(0, 256), (1, 1, 1));
        assert_eq!(grid_for(257, 256), (2, 1, 1));
    }
}
