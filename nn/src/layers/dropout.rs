//! Dropout with counter-based masks keyed by layer, step, use and global element index.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use meshgrad_autograd::distributed::split_dim;
use meshgrad_autograd::{next_use, DropoutSpec, ForwardCtx, Var};
use meshgrad_tensor::{Result, Tensor};

use crate::module::{name_seed, Child, Forward, Module};
use crate::tp::{ParallelStyle, TensorParallel};

/// Dropout layer; identity in eval mode or with `p == 0`.
///
/// The mask of a forward is keyed by the layer's path (set by
/// [`ParamBuilder::init`](crate::ParamBuilder::init)), the [`ForwardCtx`] step, the use of this
/// layer within the current context (a second call in the same forward gets a fresh mask) and
/// the global element index (`first_row` of the context times the row size, plus the local
/// index), so every parallel layout draws the same masks as one device. Under sequence
/// parallelism ([`ParallelStyle::SequenceParallel`], or [`ParallelStyle::SequenceSplit`] which
/// first cuts a replicated `[B, T, C]` input to this rank's positions) the mask of each local
/// element is the one its global position gets.
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
    training: AtomicBool,
    stream: AtomicU64,
    tp: OnceLock<(ParallelStyle, TensorParallel)>,
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
            tp: OnceLock::new(),
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
        let sp = self.tp.get().filter(|(_, tp)| tp.splits_sequence());
        let x = match sp {
            Some((ParallelStyle::SequenceSplit, tp)) => split_dim(x, 1, &tp.group)?,
            _ => x.clone(),
        };
        if !self.is_training() || self.p == 0.0 {
            return Ok(x);
        }
        let (seed, ctx) = self.next_seed();
        let t = x.tensor();
        if let Some((_, tp)) = sp {
            if t.rank() != 3 {
                meshgrad_tensor::bail!(
                    "dropout: sequence parallelism needs [B, T, C] activations, got {}",
                    t.shape()
                );
            }
            // This rank's positions [B, T/tp, C] of the [B, T, C] activation.
            let tl = t.dims()[1];
            return self.slice_mask(&x, seed, ctx.first_row, tp.rank() * tl, tl * tp.degree());
        }
        let row_elems = if t.rank() == 0 {
            1
        } else {
            t.elem_count() / t.dims()[0].max(1)
        };
        x.dropout(DropoutSpec {
            p: self.p,
            seed,
            start: ctx.first_row * row_elems as u64,
        })
    }
}

impl Dropout {
    /// The mask seed of this use of the layer in the current [`ForwardCtx`] (taking the use).
    fn next_seed(&self) -> (u64, ForwardCtx) {
        let stream = self.stream.load(Ordering::Relaxed);
        let ctx = ForwardCtx::current();
        let seed = match next_use(stream) {
            0 => name_seed(stream, &ctx.step.to_string()),
            n => name_seed(stream, &format!("{}.{n}", ctx.step)),
        };
        (seed, ctx)
    }

    /// Dropout of a slice of attention heads: `x [B, h, ...]` holds heads
    /// `first_head..first_head + h` of a `[B, heads, ...]` tensor (tensor parallelism splits
    /// attention by heads, rank `r` holding heads `[r heads/tp, (r+1) heads/tp)`). Each local
    /// element `(b, i, rest)` gets the mask of its global element `(b, first_head + i, rest)`,
    /// i.e. global index `((first_row + b) heads + first_head + i) * rest + ...`, so the masks are
    /// the ones a single device draws for the whole tensor. With `h == heads` this is
    /// [`Forward::forward`].
    pub fn forward_heads(&self, x: &Var, heads: usize, first_head: usize) -> Result<Var> {
        let t = x.tensor();
        let h = match t.dims() {
            [_, h, ..] if first_head + h <= heads => *h,
            _ => meshgrad_tensor::bail!(
                "dropout: heads {first_head}.. of {heads} do not fit an input of shape {} \
                 ([B, heads, ...] expected)",
                t.shape()
            ),
        };
        if h == heads {
            return self.forward(x);
        }
        if !self.is_training() || self.p == 0.0 {
            return Ok(x.clone());
        }
        let (seed, ctx) = self.next_seed();
        self.slice_mask(x, seed, ctx.first_row, first_head, heads)
    }

    /// Dropout of a slice of dimension 1: `x [B, n, ...]` holds entries `start..start + n` of a
    /// `[B, global, ...]` tensor (this rank's heads, or its sequence positions). Each batch row's
    /// run of local elements gets the masks of its global indices, so the masks are the ones a
    /// single device draws for the whole tensor.
    fn slice_mask(
        &self,
        x: &Var,
        seed: u64,
        first_row: u64,
        start: usize,
        global: usize,
    ) -> Result<Var> {
        let t = x.tensor();
        let (b, n) = (t.dims()[0], t.dims()[1]);
        let inner = (t.elem_count() / (b * n).max(1)) as u64;
        let row = global as u64 * inner;
        let mut one = t.dims().to_vec();
        one[0] = 1;
        let masks: Vec<Tensor> = (0..b as u64)
            .map(|i| {
                Tensor::dropout_mask(
                    seed,
                    (first_row + i) * row + start as u64 * inner,
                    self.p,
                    one.clone(),
                    t.dtype(),
                    t.device(),
                )
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = masks.iter().collect();
        x.mul(&Var::constant(Tensor::cat(&refs, 0)?))
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
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if !matches!(
            style,
            ParallelStyle::SequenceParallel | ParallelStyle::SequenceSplit
        ) {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: dropout `{path}` takes SequenceParallel or SequenceSplit, \
                 not {style:?}"
            );
        }
        let _ = self.tp.set((*style, tp.clone()));
        Ok(())
    }
}
