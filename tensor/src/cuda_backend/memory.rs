//! The caching allocator: device memory is obtained from the driver in size classes and freed
//! blocks are kept per class for the next request of that class, so a training step that
//! repeats the shapes of the step before allocates nothing from the driver after warm-up.
//!
//! Size classes: requests up to 1 MiB round up to a multiple of 512 bytes; larger ones to a
//! multiple of an eighth of the next power of two (at most 12.5% above the request). A request
//! is served only by a free block of exactly its class. When the driver reports out-of-memory,
//! every cached block is given back (after the stream drains) and the request retried once.
//!
//! Blocks are freed into the cache in stream order: the compute stream runs everything in
//! issue order, so a block handed out again is written only after the work that read it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use super::context::{CudaMemoryStats, DeviceContext};
use crate::{Error, Result};

/// Requests up to this size use the fine 512-byte granularity.
const SMALL_LIMIT: usize = 1 << 20;
/// Granularity of small requests.
const SMALL_ROUND: usize = 512;

/// The size class (bytes actually reserved) of a request of `bytes` (0 for 0).
pub(crate) fn size_class(bytes: usize) -> usize {
    if bytes == 0 {
        return 0;
    }
    if bytes <= SMALL_LIMIT {
        return bytes.div_ceil(SMALL_ROUND) * SMALL_ROUND;
    }
    let step = bytes.next_power_of_two() / 8;
    bytes.div_ceil(step) * step
}

#[derive(Debug, Default)]
struct CacheState {
    free: BTreeMap<usize, Vec<u64>>,
    stats: CudaMemoryStats,
}

/// Free blocks by size class, and the counters. Pure bookkeeping over device addresses: the
/// driver calls are made by [`allocate`] and [`release_cached`].
#[derive(Debug, Default)]
pub(crate) struct BlockCache {
    state: Mutex<CacheState>,
}

impl BlockCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cached block of exactly `class` bytes, now in use.
    pub fn take(&self, class: usize) -> Option<u64> {
        let mut s = self.lock();
        let ptr = s.free.get_mut(&class)?.pop()?;
        if s.free.get(&class).is_some_and(Vec::is_empty) {
            s.free.remove(&class);
        }
        s.stats.in_use += class;
        Some(ptr)
    }

    /// Records a block of `class` bytes fresh from the driver, now in use.
    pub fn record_driver_allocation(&self, class: usize) {
        let mut s = self.lock();
        s.stats.reserved += class;
        s.stats.peak_reserved = s.stats.peak_reserved.max(s.stats.reserved);
        s.stats.in_use += class;
        s.stats.driver_allocations += 1;
    }

    /// Takes back a block that is no longer used.
    pub fn put(&self, class: usize, ptr: u64) {
        let mut s = self.lock();
        s.stats.in_use -= class;
        s.free.entry(class).or_default().push(ptr);
    }

    /// Removes every cached block (to be given back to the driver) and returns them with their
    /// sizes.
    pub fn drain(&self) -> Vec<(u64, usize)> {
        let mut s = self.lock();
        let free = std::mem::take(&mut s.free);
        let mut out = Vec::new();
        for (class, ptrs) in free {
            s.stats.reserved -= class * ptrs.len();
            out.extend(ptrs.into_iter().map(|p| (p, class)));
        }
        out
    }

    /// The counters.
    pub fn stats(&self) -> CudaMemoryStats {
        self.lock().stats
    }
}

/// A block of device memory in use: `bytes` (its size class) at `ptr`. Dropping it returns it
/// to its device's cache.
pub(crate) struct Block {
    ptr: u64,
    bytes: usize,
    ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Block {{ cuda:{}, {:#x}, {} bytes }}",
            self.ctx.ordinal, self.ptr, self.bytes
        )
    }
}

impl Block {
    /// The device address (0 for an empty block).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The device context the block belongs to.
    pub fn ctx(&self) -> &Arc<DeviceContext> {
        &self.ctx
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.ctx.cache.put(self.bytes, self.ptr);
        }
    }
}

fn driver_alloc(
    ctx: &DeviceContext,
    class: usize,
) -> std::result::Result<u64, result::DriverError> {
    // SAFETY: the context is bound to this thread by the caller; the pointer returned is owned
    // by the cache from here on and freed only through `release_cached`.
    unsafe {
        if ctx.ctx.has_async_alloc() {
            result::malloc_async(ctx.stream.cu_stream(), class)
        } else {
            result::malloc_sync(class)
        }
    }
}

/// A block of at least `bytes` bytes (uninitialised) on `ctx`'s device.
pub(crate) fn allocate(ctx: &Arc<DeviceContext>, bytes: usize) -> Result<Block> {
    let class = size_class(bytes);
    let block = |ptr| Block {
        ptr,
        bytes: class,
        ctx: ctx.clone(),
    };
    if class == 0 {
        return Ok(block(0));
    }
    if let Some(ptr) = ctx.cache.take(class) {
        return Ok(block(ptr));
    }
    ctx.bind()?;
    let ptr = match driver_alloc(ctx, class) {
        Ok(p) => p,
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
            release_cached(ctx)?;
            driver_alloc(ctx, class).map_err(|e| {
                let s = ctx.cache.stats();
                Error::Cuda {
                    device: ctx.device(),
                    message: format!(
                        "out of memory allocating {bytes} bytes ({class} reserved for it) with \
                         {} bytes in use by tensors and {} reserved: {e}",
                        s.in_use, s.reserved
                    ),
                }
            })?
        }
        Err(e) => return Err(ctx.err(&format!("allocating {class} bytes"), e)),
    };
    ctx.cache.record_driver_allocation(class);
    Ok(block(ptr))
}

/// Gives every cached block back to the driver (after the compute stream drains).
pub(crate) fn release_cached(ctx: &DeviceContext) -> Result<()> {
    ctx.synchronize()?;
    ctx.bind()?;
    for (ptr, _) in ctx.cache.drain() {
        // SAFETY: `ptr` came from `driver_alloc` on this context and is in no block in use (it
        // was in the free lists); the stream has drained, so no queued work reads it.
        unsafe {
            if ctx.ctx.has_async_alloc() {
                result::free_async(ptr, ctx.stream.cu_stream())
            } else {
                result::free_sync(ptr)
            }
        }
        .map_err(|e| ctx.err("freeing a cached block", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        // 1 MiB + 1: next power of two 2 MiB, step 256 KiB.
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (256 << 10));
        for bytes in [3usize << 20, 5_000_000, 123_456_789, 1 << 30] {
            let c = size_class(bytes);
            assert!(c >= bytes && c - bytes <= bytes / 8, "{bytes} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }

    #[test]
    fn blocks_are_reused_by_exact_class_and_counted() {
        let cache = BlockCache::default();
        assert_eq!(cache.take(512), None);
        cache.record_driver_allocation(512);
        cache.record_driver_allocation(4096);
        assert_eq!(cache.stats().in_use, 4608);
        cache.put(512, 0x1000);
        cache.put(4096, 0x2000);
        assert_eq!(cache.stats().in_use, 0);
        assert_eq!(cache.stats().reserved, 4608);
        assert_eq!(
            cache.take(1024),
            None,
            "no block of another class is handed out"
        );
        assert_eq!(cache.take(4096), Some(0x2000));
        assert_eq!(cache.stats().in_use, 4096);
        assert_eq!(cache.stats().driver_allocations, 2);
        let drained = cache.drain();
        assert_eq!(drained, vec![(0x1000, 512)]);
        let s = cache.stats();
        assert_eq!((s.reserved, s.in_use, s.peak_reserved), (4096, 4096, 4608));
    }
}
