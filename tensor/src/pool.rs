//! Recycling of large f32 CPU buffers, so the training step does not pay for fresh, zeroed
//! memory (a `calloc`'s memset or the kernel's page faults) on every op.
//!
//! When a storage allocation of a large f32 buffer is freed, its `Vec` goes back to this pool
//! (bounded in total bytes and per length) instead of to the system allocator. Ops whose kernels
//! overwrite every element of their output ask for `output` buffers, which come from the pool
//! when one of exactly that length is free (holding stale values that the kernel overwrites), else
//! fresh zeros. Memory accounting is unaffected: the tracker charges live storages only.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Mutex;

use meshgrad_kernels::Float;

/// Buffers shorter than this (elements) are left to the system allocator.
const MIN_LEN: usize = 1 << 14;
/// Most bytes the pool keeps.
const MAX_BYTES: usize = 512 << 20;
/// Most free buffers kept per length.
const MAX_PER_LEN: usize = 16;

#[derive(Default)]
struct Pool {
    free: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// Takes back a freed f32 buffer (dropped instead when it is small or the pool is full).
pub(crate) fn give(v: Vec<f32>) {
    let n = v.len();
    if n < MIN_LEN || v.capacity() != n {
        return;
    }
    let bytes = n * std::mem::size_of::<f32>();
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let p = g.get_or_insert_with(Pool::default);
    if p.bytes + bytes > MAX_BYTES {
        return;
    }
    let list = p.free.entry(n).or_default();
    if list.len() >= MAX_PER_LEN {
        return;
    }
    list.push(v);
    p.bytes += bytes;
}

fn take_f32(n: usize) -> Option<Vec<f32>> {
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let p = g.as_mut()?;
    let v = p.free.get_mut(&n)?.pop()?;
    p.bytes -= n * std::mem::size_of::<f32>();
    Some(v)
}

/// A buffer of `n` elements for an output that the caller overwrites completely: a recycled f32
/// buffer (with stale values) when one of that length is free, else zeros. Never use it for an
/// output that is accumulated into or only partly written.
pub(crate) fn output<T: Float>(n: usize) -> Vec<T> {
    if n >= MIN_LEN {
        let mut slot: Option<Vec<T>> = None;
        if let Some(s) = (&mut slot as &mut dyn Any).downcast_mut::<Option<Vec<f32>>>() {
            *s = take_f32(n);
        }
        if let Some(v) = slot {
            return v;
        }
    }
    vec![T::ZERO; n]
}

/// Empties the pool (returns its memory to the system allocator).
pub fn clear() {
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycles_exact_lengths_only() {
        let n = MIN_LEN + 7;
        let mut v = vec![0f32; n];
        v[3] = 42.0;
        let ptr = v.as_ptr();
        give(v);
        // Another length never gets it; f64 never touches the pool.
        assert_eq!(output::<f32>(n + 1), vec![0f32; n + 1]);
        assert_eq!(output::<f64>(n), vec![0f64; n]);
        let w = output::<f32>(n);
        assert_eq!(w.len(), n);
        // Usually the same buffer comes back (another test thread may have taken it).
        if w.as_ptr() == ptr {
            assert_eq!(w[3], 42.0);
        }
        give(vec![1f32; 10]); // too small: dropped
        assert_eq!(output::<f32>(10), vec![0f32; 10]);
    }
}
