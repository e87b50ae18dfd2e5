//! Grad mode (recording on or off) and the leaf collector used by activation checkpointing.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use crate::var::{Var, VarId};

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(true) };
    static COLLECTOR: RefCell<Option<BTreeMap<VarId, Var>>> = const { RefCell::new(None) };
}

/// Whether ops record graph nodes on this thread.
pub fn is_enabled() -> bool {
    ENABLED.with(|e| e.get())
}

struct RestoreMode(bool);
impl Drop for RestoreMode {
    fn drop(&mut self) {
        ENABLED.with(|e| e.set(self.0));
    }
}

/// Runs `f` without recording graph nodes (inference, optimizer updates).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let prev = ENABLED.with(|e| e.replace(false));
    let _g = RestoreMode(prev);
    f()
}

/// Runs `f` with recording on (even inside [`no_grad`]).
pub fn enable_grad<R>(f: impl FnOnce() -> R) -> R {
    let prev = ENABLED.with(|e| e.replace(true));
    let _g = RestoreMode(prev);
    f()
}

/// Runs `f` without recording, collecting every gradient-requiring leaf that an op consumed:
/// the parameters a checkpointed function closes over.
pub(crate) fn collect_leaves<R>(f: impl FnOnce() -> R) -> (R, Vec<Var>) {
    let prev = COLLECTOR.with(|c| c.replace(Some(BTreeMap::new())));
    struct RestoreCollector(Option<Option<BTreeMap<VarId, Var>>>);
    impl Drop for RestoreCollector {
        fn drop(&mut self) {
            if let Some(p) = self.0.take() {
                COLLECTOR.with(|c| *c.borrow_mut() = p);
            }
        }
    }
    let mut guard = RestoreCollector(Some(prev));
    let r = no_grad(f);
    let mut prev = guard.0.take().expect("set above");
    let leaves = COLLECTOR.with(|c| c.take()).unwrap_or_default();
    // A nested collection (a checkpoint inside a checkpointed block) reports its leaves to the
    // enclosing one too: the outer block's recomputation needs their gradients.
    if let Some(outer) = prev.as_mut() {
        for (id, v) in &leaves {
            outer.entry(*id).or_insert_with(|| v.clone());
        }
    }
    COLLECTOR.with(|c| *c.borrow_mut() = prev);
    (r, leaves.into_values().collect())
}

/// Called by ops that skip recording: remembers consumed leaves for an active collector.
pub(crate) fn record_leaves(inputs: &[&Var]) {
    COLLECTOR.with(|c| {
        if let Some(map) = c.borrow_mut().as_mut() {
            for v in inputs {
                if v.is_leaf() && v.requires_grad() {
                    map.entry(v.id()).or_insert_with(|| (*v).clone());
                }
            }
        }
    });
}
