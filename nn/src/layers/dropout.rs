//! Dropout with counter-based masks keyed by layer, step, use and global element index.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use meshgrad_autograd::{next_use, DropoutSpec, ForwardCtx, Var};
use meshgrad_tensor::Result;

use crate::module::{name_seed, Child, Forward, Module};

/// Dropout layer; identity in eval mode or with `p == 0`.
///
/// The mask of a forward is keyed by the layer's path (set by
/// [`ParamBuilder::init`](crate::ParamBuilder::init)), the [`ForwardCtx`] step, the use of this
/// layer within the current context (a second call in the same forward gets a fresh mask) and
/// the global element index (`first_row` of the context times the row size, plus the local
/// index), so every parallel layout draws the same masks as one device.
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
    training: AtomicBool,
    stream: AtomicU64,
}

impl Dropout {
    /// A dropout with probability `p` in `[0, 1)`.
    pub fn new(p: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            meshgrad_tensor::bail!("dropout: p must be in [0, 1), got {p}");
        }
        // Until init names it, each dropout gets a distinct stream.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Ok(Dropout {
            p,
            training: AtomicBool::new(true),
            stream: AtomicU64::new(name_seed(NEXT.fetch_add(1, Ordering::Relaxed), "dropout")),
        })
    }

    /// Whether masks are applied (training mode).
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
}

impl Forward for Dropout {
    /// Applies dropout to `x` whose first dim is the batch (rows).
    fn forward(&self, x: &Var) -> Result<Var> {
        if !self.is_training() || self.p == 0.0 {
            return Ok(x.clone());
        }
        let t = x.tensor();
        let row_elems = if t.rank() == 0 {
            1
        } else {
            t.elem_count() / t.dims()[0].max(1)
        };
        let stream = self.stream.load(Ordering::Relaxed);
        let ctx = ForwardCtx::current();
        let seed = match next_use(stream) {
            0 => name_seed(stream, &ctx.step.to_string()),
            n => name_seed(stream, &format!("{}.{n}", ctx.step)),
        };
        x.dropout(DropoutSpec {
            p: self.p,
            seed,
            start: ctx.first_row * row_elems as u64,
        })
    }
}

impl Module for Dropout {
    fn visit_children(&self, _f: &mut dyn FnMut(&str, Child<'_>)) {}
    fn module_type(&self) -> &'static str {
        "Dropout"
    }
    fn set_own_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
    fn on_init(&self, path: &str, seed: u64) {
        self.stream.store(name_seed(seed, path), Ordering::Relaxed);
    }
}
