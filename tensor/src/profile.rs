//! A small, low-overhead op profiler: wall time per (phase, op name), for benchmarks.
//!
//! Tensor ops open a [`scope`] named after the op; while profiling is [enabled](set_enabled), the
//! outermost scope on a thread records its wall time under the thread's current [`Phase`] (the
//! autograd engine sets [`Phase::Backward`] while it runs backward rules; an optimizer step can
//! set [`Phase::Optimizer`]). Nested scopes (an op calling other ops) are not recorded, so times
//! never double count, and neither are ops running inside rayon tasks (the op that spawned the
//! tasks covers them). When profiling is disabled a scope costs one relaxed atomic load.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
/// What an outermost scope calls before taking its time (see [`set_sync`]).
type SyncHook = Arc<dyn Fn() + Send + Sync>;
static SYNC: RwLock<Option<SyncHook>> = RwLock::new(None);
static RECORDS: Mutex<Option<HashMap<(Phase, &'static str), OpTime>>> = Mutex::new(None);

/// Which part of a training step an op ran in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Forward pass (the default).
    Forward,
    /// Backward pass (set by the autograd engine).
    Backward,
    /// Optimizer step.
    Optimizer,
}

impl Phase {
    /// A short lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// Accumulated time of one (phase, op).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTime {
    /// Number of recorded calls.
    pub calls: u64,
    /// Total wall time, seconds.
    pub seconds: f64,
}

thread_local! {
    static PHASE: Cell<Phase> = const { Cell::new(Phase::Forward) };
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Turns recording on or off (off by default).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether recording is on.
#[inline]
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Sets (or, with `None`, removes) what every recorded (outermost) scope calls before it takes
/// its time: a device synchronisation, so that an asynchronous device's work counts in the op
/// that queued it rather than in whichever later op waits for it. It slows the step: profile
/// separately from timing.
pub fn set_sync(hook: Option<SyncHook>) {
    *SYNC.write().unwrap_or_else(|e| e.into_inner()) = hook;
}

/// Clears every record.
pub fn reset() {
    *RECORDS.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// The records so far, sorted by phase then decreasing time.
pub fn snapshot() -> Vec<(Phase, &'static str, OpTime)> {
    let g = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<_> = g
        .iter()
        .flat_map(|m| m.iter().map(|(&(p, n), &t)| (p, n, t)))
        .collect();
    v.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then(b.2.seconds.total_cmp(&a.2.seconds))
            .then(a.1.cmp(b.1))
    });
    v
}

/// Restores the previous phase when dropped.
pub struct PhaseGuard(Phase);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        PHASE.with(|p| p.set(self.0));
    }
}

/// Sets this thread's phase until the guard drops.
pub fn phase(p: Phase) -> PhaseGuard {
    PhaseGuard(PHASE.with(|c| c.replace(p)))
}

/// Records the enclosing op's time when dropped (see [`scope`]).
pub struct Scope {
    name: &'static str,
    start: Instant,
}

impl Drop for Scope {
    fn drop(&mut self) {
        let depth = DEPTH.with(|d| {
            let v = d.get() - 1;
            d.set(v);
            v
        });
        if depth > 0 {
            return;
        }
        let hook = SYNC.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(sync) = hook {
            sync();
        }
        let dt = self.start.elapsed().as_secs_f64();
        let phase = PHASE.with(|p| p.get());
        let mut g = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
        let e = g
            .get_or_insert_with(HashMap::new)
            .entry((phase, self.name))
            .or_default();
        e.calls += 1;
        e.seconds += dt;
    }
}

/// Opens a timing scope for op `name` (`None`, at the cost of one atomic load, when profiling
/// is off). Keep the guard alive for the op's duration: `let _p = profile::scope("matmul");`.
#[inline]
pub fn scope(name: &'static str) -> Option<Scope> {
    // Ops running inside rayon tasks are covered by the scope of the op that spawned them.
    if !is_enabled() || rayon::current_thread_index().is_some() {
        return None;
    }
    DEPTH.with(|d| d.set(d.get() + 1));
    Some(Scope {
        name,
        start: Instant::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_scopes_record_once_under_the_phase() {
        // Only this test touches the global switch in this crate's unit tests.
        set_enabled(true);
        reset();
        {
            let _b = phase(Phase::Backward);
            let _o = scope("outer_test_op");
            let _i = scope("inner_test_op");
        }
        {
            let _o = scope("outer_test_op");
        }
        set_enabled(false);
        let _ = scope("ignored_test_op");
        let s = snapshot();
        let find = |p: Phase, n: &str| s.iter().find(|r| r.0 == p && r.1 == n).map(|r| r.2);
        assert_eq!(find(Phase::Backward, "outer_test_op").unwrap().calls, 1);
        assert_eq!(find(Phase::Forward, "outer_test_op").unwrap().calls, 1);
        assert!(find(Phase::Backward, "inner_test_op").is_none());
        assert!(find(Phase::Forward, "ignored_test_op").is_none());

        // A sync hook runs once per recorded (outermost) scope, inside its time. (Other tests'
        // ops on other threads may record while the switch is on: count this thread's calls.)
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let me = std::thread::current().id();
        set_sync(Some(Arc::new(move || {
            if std::thread::current().id() == me {
                counted.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })));
        set_enabled(true);
        reset();
        {
            let _o = scope("synced_test_op");
            let _i = scope("inner_test_op");
        }
        set_enabled(false);
        set_sync(None);
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        let s = snapshot();
        let t = s.iter().find(|r| r.1 == "synced_test_op").unwrap().2;
        assert!(t.seconds >= 0.02, "{t:?}");
    }
}
