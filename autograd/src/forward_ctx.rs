//! The forward context: which training step a forward belongs to and which global batch rows it
//! sees, plus a per-stream use counter, so that random ops (dropout) draw fresh, layout-invariant
//! masks without the caller threading a context through every layer.
//!
//! A training loop enters a context per forward ([`ForwardCtx::scope`]); layers read it with
//! [`ForwardCtx::current`] and take a use index with [`next_use`]. Masks are keyed by
//! `(stream, step, use)` and the *global* element index (`first_row` times the row size plus the
//! local index), so:
//!
//! * a dropout applied twice in one forward draws two different masks (use 0 and use 1);
//! * a loop that never enters a scope (or never advances `step`) still gets fresh masks, because
//!   uses keep counting in the thread's default context;
//! * a batch split across data-parallel ranks or microbatches gives every row the mask it has in
//!   the single-device run: each part enters its own scope with its own `first_row`, and use
//!   counts restart in every scope;
//! * activation checkpointing ([`crate::checkpoint`]) snapshots the context when the block first
//!   runs and replays it when the block is recomputed, so recomputation draws the same masks.
//!
//! The context is per thread (ranks run as threads).
//!
//! A scope also carries the **loss scale** of its forward ([`ForwardCtx::scope_scaled`],
//! [`loss_scale`]): the factor the backward's root multiplies this forward's loss by (the
//! pipeline executor's `1 / M` over `M` microbatches, times an f16 run's loss scale). A layer that
//! adds an auxiliary loss term through its backward alone (a mixture of experts' load balancing,
//! [`Var::attach_aux_loss`](crate::Var::attach_aux_loss)) reads it, so the term's gradient is
//! scaled as the main loss's is, on whatever pipeline stage the layer sits. Checkpointing replays
//! it with the rest of the context. Outside any scope it is 1.

use std::cell::RefCell;
use std::collections::HashMap;

/// Which step and which global rows a forward computes. See the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardCtx {
    /// Training step (any counter that changes between steps).
    pub step: u64,
    /// Global index of the first batch row this forward processes.
    pub first_row: u64,
}

/// The context and its use counters, as saved by checkpointing.
#[derive(Clone, Debug)]
pub(crate) struct CtxState {
    ctx: ForwardCtx,
    uses: HashMap<u64, u64>,
    loss_scale: f64,
}

impl Default for CtxState {
    fn default() -> Self {
        CtxState {
            ctx: ForwardCtx::default(),
            uses: HashMap::new(),
            loss_scale: 1.0,
        }
    }
}

thread_local! {
    static STATE: RefCell<CtxState> = RefCell::new(CtxState::default());
}

struct Restore(Option<CtxState>);
impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            STATE.with(|st| *st.borrow_mut() = s);
        }
    }
}

impl ForwardCtx {
    /// A context for step `step` whose batch starts at global row `first_row`.
    pub fn new(step: u64, first_row: u64) -> Self {
        ForwardCtx { step, first_row }
    }

    /// The context of the current forward on this thread (the default, step 0 row 0, outside
    /// any scope).
    pub fn current() -> ForwardCtx {
        STATE.with(|s| s.borrow().ctx)
    }

    /// Runs `f` inside this context, with fresh use counters; the previous context is restored
    /// afterwards (also on panic).
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        self.scope_scaled(1.0, f)
    }

    /// [`ForwardCtx::scope`] whose forward's loss the backward multiplies by `loss_scale`: a
    /// term a layer adds to the objective itself (a mixture of experts' load-balancing loss,
    /// [`Var::attach_aux_loss`](crate::Var::attach_aux_loss)) reads it with [`loss_scale`] so
    /// that it is scaled as the loss is.
    pub fn scope_scaled<R>(self, loss_scale: f64, f: impl FnOnce() -> R) -> R {
        let fresh = CtxState {
            ctx: self,
            uses: HashMap::new(),
            loss_scale,
        };
        let prev = STATE.with(|s| std::mem::replace(&mut *s.borrow_mut(), fresh));
        let _restore = Restore(Some(prev));
        f()
    }
}

/// The loss scale of the current forward ([`ForwardCtx::scope_scaled`]): 1 outside any scope.
pub fn loss_scale() -> f64 {
    STATE.with(|s| s.borrow().loss_scale)
}

/// Takes the next use index of random stream `stream` in the current context (0 for its first
/// use in a scope, then 1, 2, ...).
pub fn next_use(stream: u64) -> u64 {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let n = s.uses.entry(stream).or_insert(0);
        let u = *n;
        *n += 1;
        u
    })
}

/// The current context and counters (for checkpointing).
pub(crate) fn snapshot() -> CtxState {
    STATE.with(|s| s.borrow().clone())
}

/// Runs `f` with `state` as the context (for checkpoint recomputation); restores afterwards.
pub(crate) fn replay<R>(state: CtxState, f: impl FnOnce() -> R) -> R {
    let prev = STATE.with(|s| std::mem::replace(&mut *s.borrow_mut(), state));
    let _restore = Restore(Some(prev));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_count_per_stream_and_restart_per_scope() {
        ForwardCtx::new(3, 8).scope(|| {
            assert_eq!(ForwardCtx::current(), ForwardCtx::new(3, 8));
            assert_eq!(next_use(1), 0);
            assert_eq!(next_use(1), 1);
            assert_eq!(next_use(2), 0);
            ForwardCtx::new(4, 0).scope(|| assert_eq!(next_use(1), 0));
            assert_eq!(next_use(1), 2);
            let snap = snapshot();
            assert_eq!(next_use(1), 3);
            replay(snap, || assert_eq!(next_use(1), 3));
            assert_eq!(next_use(1), 4);
        });
    }

    #[test]
    fn the_loss_scale_is_scoped_and_replayed() {
        assert_eq!(loss_scale(), 1.0);
        ForwardCtx::new(1, 0).scope_scaled(0.25, || {
            assert_eq!(loss_scale(), 0.25);
            let snap = snapshot();
            ForwardCtx::new(1, 4).scope(|| assert_eq!(loss_scale(), 1.0));
            replay(snap, || assert_eq!(loss_scale(), 0.25));
        });
        assert_eq!(loss_scale(), 1.0);
    }
}
