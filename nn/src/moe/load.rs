//! The expert load of a training step: what each [`SparseMoe`](super::SparseMoe) layer routed
//! and its load-balancing loss, collected per thread (a rank is a thread) while a step's
//! forwards run ([`collect_expert_load`]).

use std::cell::RefCell;
use std::collections::BTreeMap;

/// One layer's load, summed over the forwards of a collection.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerLoad {
    /// Token copies routed to each expert (before capacity drops).
    pub routed: Vec<f64>,
    /// Token copies dropped for capacity.
    pub dropped: f64,
    /// The load-balancing loss summed over the sequences (under context parallelism, this rank's
    /// part of each sequence's loss times the group size: the group's sums over its `rows`
    /// give the sequences' mean).
    pub aux_sum: f64,
    /// Sequences.
    pub rows: f64,
}

/// The load of every layer (by global layer index) over a collection.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertLoad {
    /// Per layer.
    pub layers: BTreeMap<usize, LayerLoad>,
}

impl ExpertLoad {
    /// Whether no mixture-of-experts layer ran.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The routed counts of every layer, concatenated in layer order.
    pub fn routed_flat(&self) -> Vec<f64> {
        self.layers
            .values()
            .flat_map(|l| l.routed.clone())
            .collect()
    }

    /// `(sum of aux over sequences and layers, sequences x layers, dropped copies)`.
    pub fn aux_totals(&self) -> (f64, f64, f64) {
        self.layers.values().fold((0.0, 0.0, 0.0), |(a, r, d), l| {
            (a + l.aux_sum, r + l.rows, d + l.dropped)
        })
    }
}

thread_local! {
    static COLLECTING: RefCell<Option<ExpertLoad>> = const { RefCell::new(None) };
}

/// Runs `f` and returns what the mixture-of-experts layers that ran a recorded forward (grad
/// mode on: a training forward, or a checkpointed block's recomputation, never both) on this
/// thread recorded meanwhile. Nested collections report to the innermost only.
pub fn collect_expert_load<R>(f: impl FnOnce() -> R) -> (R, ExpertLoad) {
    let prev = COLLECTING.with(|c| c.replace(Some(ExpertLoad::default())));
    struct Restore(Option<Option<ExpertLoad>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(p) = self.0.take() {
                COLLECTING.with(|c| *c.borrow_mut() = p);
            }
        }
    }
    let mut guard = Restore(Some(prev));
    let r = f();
    let load = COLLECTING.with(|c| c.take()).unwrap_or_default();
    if let Some(p) = guard.0.take() {
        COLLECTING.with(|c| *c.borrow_mut() = p);
    }
    (r, load)
}

/// Adds one forward of layer `layer` to the current collection, if any and if grad mode is
/// on.
pub(crate) fn record(layer: usize, routed: &[usize], dropped: usize, aux_sum: f64, rows: usize) {
    if !meshgrad_autograd::is_grad_enabled() {
        return;
    }
    COLLECTING.with(|c| {
        if let Some(load) = c.borrow_mut().as_mut() {
            let l = load.layers.entry(layer).or_default();
            if l.routed.len() < routed.len() {
                l.routed.resize(routed.len(), 0.0);
            }
            for (a, &b) in l.routed.iter_mut().zip(routed) {
                *a += b as f64;
            }
            l.dropped += dropped as f64;
            l.aux_sum += aux_sum;
            l.rows += rows as f64;
        }
    });
}
