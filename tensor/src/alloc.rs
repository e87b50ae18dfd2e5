//! Allocator accounting: current and peak bytes per tracker, in total and per [`MemoryTag`].
//!
//! Every storage allocation is charged to the thread's current tracker (by default the global
//! tracker of its device) under the thread's current tag, and refunded to the same tracker when
//! it is freed (dropped or released). A thread can install its own tracker with
//! [`with_tracker`], which is how the in-process parallel backend accounts each rank separately.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::Device;

/// What an allocation holds, for per-category accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryTag {
    /// Anything not tagged otherwise (activations and temporaries by default).
    Other = 0,
    /// Model parameters.
    Params = 1,
    /// Gradients.
    Grads = 2,
    /// Optimizer state (moments, momentum buffers, master weights).
    OptimizerState = 3,
    /// Activations saved for backward.
    Activations = 4,
}

const TAGS: usize = 5;

impl MemoryTag {
    /// All tags, in index order.
    pub const ALL: [MemoryTag; TAGS] = [
        MemoryTag::Other,
        MemoryTag::Params,
        MemoryTag::Grads,
        MemoryTag::OptimizerState,
        MemoryTag::Activations,
    ];

    /// Whether the tag is part of the *model states* (parameters, gradients, optimizer state),
    /// whose sum the tracker also follows (see [`MemoryStats::model_state_peak`]).
    pub fn is_model_state(self) -> bool {
        matches!(
            self,
            MemoryTag::Params | MemoryTag::Grads | MemoryTag::OptimizerState
        )
    }
}

/// A set of byte counters: current and peak, in total and per tag.
#[derive(Debug, Default)]
pub struct MemoryTracker {
    current: AtomicUsize,
    peak: AtomicUsize,
    tag_current: [AtomicUsize; TAGS],
    tag_peak: [AtomicUsize; TAGS],
    state_current: AtomicUsize,
    state_peak: AtomicUsize,
}

/// A snapshot of a tracker's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Bytes allocated now.
    pub current: usize,
    /// Highest `current` since creation or the last [`MemoryTracker::reset_peak`].
    pub peak: usize,
    /// Per-tag current bytes, indexed by `MemoryTag as usize`.
    pub tag_current: [usize; TAGS],
    /// Per-tag peak bytes.
    pub tag_peak: [usize; TAGS],
    /// Bytes of the model states (parameters + gradients + optimizer state) now.
    pub model_state_current: usize,
    /// Highest `model_state_current`: the most model-state bytes held at one time (at most,
    /// and usually less than, the sum of the three tags' separate peaks).
    pub model_state_peak: usize,
}

impl MemoryStats {
    /// Current bytes under `tag`.
    pub fn current_of(&self, tag: MemoryTag) -> usize {
        self.tag_current[tag as usize]
    }
    /// Peak bytes under `tag`.
    pub fn peak_of(&self, tag: MemoryTag) -> usize {
        self.tag_peak[tag as usize]
    }
}

impl MemoryTracker {
    /// A fresh tracker with zero counters.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The process-wide tracker of a device.
    pub fn global(device: Device) -> Arc<Self> {
        static CPU: OnceLock<Arc<MemoryTracker>> = OnceLock::new();
        static CUDA: OnceLock<std::sync::Mutex<Vec<Arc<MemoryTracker>>>> = OnceLock::new();
        match device {
            Device::Cpu => CPU.get_or_init(MemoryTracker::new).clone(),
            Device::Cuda(n) => {
                let mut v = CUDA
                    .get_or_init(Default::default)
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                while v.len() <= n {
                    v.push(MemoryTracker::new());
                }
                v[n].clone()
            }
        }
    }

    fn charge(&self, tag: MemoryTag, bytes: usize) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        let t = tag as usize;
        let now = self.tag_current[t].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.tag_peak[t].fetch_max(now, Ordering::Relaxed);
        if tag.is_model_state() {
            let now = self.state_current.fetch_add(bytes, Ordering::Relaxed) + bytes;
            self.state_peak.fetch_max(now, Ordering::Relaxed);
        }
    }

    fn refund(&self, tag: MemoryTag, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
        self.tag_current[tag as usize].fetch_sub(bytes, Ordering::Relaxed);
        if tag.is_model_state() {
            self.state_current.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Moves `bytes` from `from`'s counters to `to`'s (the total stays).
    fn move_tag(&self, from: MemoryTag, to: MemoryTag, bytes: usize) {
        self.tag_current[from as usize].fetch_sub(bytes, Ordering::Relaxed);
        let now = self.tag_current[to as usize].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.tag_peak[to as usize].fetch_max(now, Ordering::Relaxed);
        match (from.is_model_state(), to.is_model_state()) {
            (true, false) => {
                self.state_current.fetch_sub(bytes, Ordering::Relaxed);
            }
            (false, true) => {
                let now = self.state_current.fetch_add(bytes, Ordering::Relaxed) + bytes;
                self.state_peak.fetch_max(now, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// The counters now.
    pub fn stats(&self) -> MemoryStats {
        let mut s = MemoryStats {
            current: self.current.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            model_state_current: self.state_current.load(Ordering::Relaxed),
            model_state_peak: self.state_peak.load(Ordering::Relaxed),
            ..Default::default()
        };
        for t in 0..TAGS {
            s.tag_current[t] = self.tag_current[t].load(Ordering::Relaxed);
            s.tag_peak[t] = self.tag_peak[t].load(Ordering::Relaxed);
        }
        s
    }

    /// Sets every peak to the current value.
    pub fn reset_peak(&self) {
        self.peak
            .store(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
        self.state_peak.store(
            self.state_current.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        for t in 0..TAGS {
            self.tag_peak[t].store(
                self.tag_current[t].load(Ordering::Relaxed),
                Ordering::Relaxed,
            );
        }
    }
}

thread_local! {
    static THREAD_TRACKER: RefCell<Option<Arc<MemoryTracker>>> = const { RefCell::new(None) };
    static THREAD_TAG: RefCell<MemoryTag> = const { RefCell::new(MemoryTag::Other) };
}

/// Runs `f` with allocations on this thread charged to `tracker`.
pub fn with_tracker<R>(tracker: Arc<MemoryTracker>, f: impl FnOnce() -> R) -> R {
    let prev = THREAD_TRACKER.with(|t| t.replace(Some(tracker)));
    let _guard = Restore(Some(prev));
    f()
}

struct Restore(Option<Option<Arc<MemoryTracker>>>);
impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(prev) = self.0.take() {
            THREAD_TRACKER.with(|t| *t.borrow_mut() = prev);
        }
    }
}

/// Runs `f` with allocations on this thread tagged `tag`.
pub fn with_tag<R>(tag: MemoryTag, f: impl FnOnce() -> R) -> R {
    struct RestoreTag(MemoryTag);
    impl Drop for RestoreTag {
        fn drop(&mut self) {
            THREAD_TAG.with(|t| *t.borrow_mut() = self.0);
        }
    }
    let prev = THREAD_TAG.with(|t| t.replace(tag));
    let _guard = RestoreTag(prev);
    f()
}

/// Where this thread's allocations are charged: its tracker (if it installed one) and its tag.
/// Work handed to other threads (rayon tasks) runs in the captured context with
/// [`AllocContext::run`], so that what it allocates counts where its caller's allocations do
/// (a rank's own tracker, the gradients' tag).
#[derive(Clone, Debug)]
pub struct AllocContext {
    tracker: Option<Arc<MemoryTracker>>,
    tag: MemoryTag,
}

impl AllocContext {
    /// This thread's context.
    pub fn capture() -> Self {
        AllocContext {
            tracker: THREAD_TRACKER.with(|t| t.borrow().clone()),
            tag: current_tag(),
        }
    }

    /// Runs `f` on this thread with the captured tracker and tag.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        let tagged = || with_tag(self.tag, f);
        match &self.tracker {
            Some(tr) => with_tracker(tr.clone(), tagged),
            None => tagged(),
        }
    }
}

/// `rayon::join(a, b)` with both sides charging their allocations as the calling thread does
/// ([`AllocContext`]).
pub fn join<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    let ctx = AllocContext::capture();
    rayon::join(|| ctx.run(a), || ctx.run(b))
}

/// The tag allocations on this thread get now (see [`with_tag`]).
pub fn current_tag() -> MemoryTag {
    THREAD_TAG.with(|t| *t.borrow())
}

/// The tracker allocations on this thread for `device` are charged to.
pub fn current_tracker(device: Device) -> Arc<MemoryTracker> {
    THREAD_TRACKER
        .with(|t| t.borrow().clone())
        .unwrap_or_else(|| MemoryTracker::global(device))
}

/// The stats of the tracker this thread charges for `device`.
pub fn memory_stats(device: Device) -> MemoryStats {
    current_tracker(device).stats()
}

/// Resets the peaks of the tracker this thread charges for `device`.
pub fn reset_peak(device: Device) {
    current_tracker(device).reset_peak()
}

/// A charge held by a live allocation; refunds on drop.
#[derive(Debug)]
pub(crate) struct Charge {
    tracker: Arc<MemoryTracker>,
    /// The tag's index in [`MemoryTag::ALL`] (changed by [`Charge::retag`]).
    tag: std::sync::atomic::AtomicU8,
    bytes: usize,
}

impl Charge {
    pub(crate) fn new(device: Device, bytes: usize) -> Self {
        let tracker = current_tracker(device);
        let tag = THREAD_TAG.with(|t| *t.borrow());
        tracker.charge(tag, bytes);
        Charge {
            tracker,
            tag: std::sync::atomic::AtomicU8::new(tag as u8),
            bytes,
        }
    }

    fn tag(&self) -> MemoryTag {
        MemoryTag::ALL[usize::from(self.tag.load(Ordering::Relaxed))]
    }

    /// Counts the bytes under `tag` from now on (the total is unchanged; the new tag's peak may
    /// rise).
    pub(crate) fn retag(&self, tag: MemoryTag) {
        let old = MemoryTag::ALL[usize::from(self.tag.swap(tag as u8, Ordering::Relaxed))];
        if old != tag {
            self.tracker.move_tag(old, tag, self.bytes);
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.tracker.refund(self.tag(), self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rayon_tasks_charge_the_callers_tracker_and_tag() {
        let tr = MemoryTracker::new();
        with_tracker(tr.clone(), || {
            with_tag(MemoryTag::Grads, || {
                let (a, b) = join(
                    || Charge::new(Device::Cpu, 10),
                    || Charge::new(Device::Cpu, 20),
                );
                assert_eq!(tr.stats().current_of(MemoryTag::Grads), 30);
                drop((a, b));
            });
        });
        assert_eq!(tr.stats().current, 0);
    }

    #[test]
    fn retagging_moves_the_bytes_between_tags() {
        let tr = MemoryTracker::new();
        with_tracker(tr.clone(), || {
            let a = Charge::new(Device::Cpu, 64);
            a.retag(MemoryTag::Grads);
            let s = tr.stats();
            assert_eq!((s.current, s.current_of(MemoryTag::Other)), (64, 0));
            assert_eq!(s.current_of(MemoryTag::Grads), 64);
            assert_eq!(s.model_state_current, 64);
            a.retag(MemoryTag::Activations);
            assert_eq!(tr.stats().model_state_current, 0);
            drop(a);
            let s = tr.stats();
            assert_eq!((s.current, s.current_of(MemoryTag::Activations)), (0, 0));
            assert_eq!(s.peak_of(MemoryTag::Grads), 64);
        });
    }

    #[test]
    fn charges_and_peaks() {
        let tr = MemoryTracker::new();
        with_tracker(tr.clone(), || {
            let a = with_tag(MemoryTag::Params, || Charge::new(Device::Cpu, 100));
            let b = Charge::new(Device::Cpu, 50);
            assert_eq!(tr.stats().current, 150);
            assert_eq!(tr.stats().current_of(MemoryTag::Params), 100);
            let c = with_tag(MemoryTag::Grads, || Charge::new(Device::Cpu, 30));
            assert_eq!(tr.stats().model_state_current, 130);
            drop(c);
            drop(a);
            assert_eq!(tr.stats().current, 50);
            assert_eq!(tr.stats().peak, 180);
            assert_eq!(tr.stats().model_state_peak, 130);
            assert_eq!(tr.stats().model_state_current, 0);
            tr.reset_peak();
            assert_eq!(tr.stats().peak, 50);
            assert_eq!(tr.stats().model_state_peak, 0);
            drop(b);
        });
        assert_eq!(tr.stats().current, 0);
    }
}
