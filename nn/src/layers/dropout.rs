//! Dropout with counter-based masks.

use std::sync::atomic::{AtomicBool, Ordering};

use meshgrad_autograd::{DropoutSpec, Var};
use meshgrad_tensor::Result;

use crate::module::{name_seed, Module};

/// Per-forward context: which training step this is and which global batch rows this forward
/// sees. Dropout masks are keyed by `(seed, layer, step)` and the global element index, so the
/// same step gives the same masks however the batch is split across devices or recomputed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardCtx {
    /// Training step (any counter that changes between steps).
    pub step: u64,
    /// Global index of the first batch row this forward processes.
    pub first_row: u64,
}

/// Dropout layer; identity in eval mode or with `p == 0`.
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
    training: AtomicBool,
    stream: u64,
}

impl Dropout {
    /// A dropout named `name` (the name keys its random stream) with run seed `seed`.
    pub fn new(seed: u64, name: &str, p: f64) -> Self {
        Dropout {
            p,
            training: AtomicBool::new(true),
            stream: name_seed(seed, name),
        }
    }

    /// Whether masks are applied (training mode).
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// Applies dropout to `x` whose first dim is the batch (rows).
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if !self.is_training() || self.p == 0.0 {
            return Ok(x.clone());
        }
        let t = x.tensor();
        let row_elems = if t.rank() == 0 {
            1
        } else {
            t.elem_count() / t.dims()[0].max(1)
        };
        let spec = DropoutSpec {
            p: self.p,
            seed: name_seed(self.stream, &ctx.step.to_string()),
            start: ctx.first_row * row_elems as u64,
        };
        x.dropout(spec)
    }
}

impl Module for Dropout {
    fn visit_params(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Var)) {}
    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
}
