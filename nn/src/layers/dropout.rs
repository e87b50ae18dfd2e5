//! Dropout with counter-based masks keyed by layer, step, use and global element index.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use meshgrad_autograd::distributed::{split_dim, ChunkOrder};
use meshgrad_autograd::{next_use, DropoutSpec, ForwardCtx, Var};
use meshgrad_tensor::{Result, Tensor};

use crate::module::{name_seed, Child, Forward, Module};
use crate::param_builder::ParamBuilder;
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
/// element is the one its global position gets. Under context parallelism
/// ([`Dropout::on_sequence`], [`Dropout::with_chunk_order`]) the local sequence is the rank's two
/// chunks ([`ChunkOrder`]), and each local position gets its global position's mask too.
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
    training: AtomicBool,
    stream: AtomicU64,
    tp: OnceLock<(ParallelStyle, TensorParallel)>,
    /// The context-parallel chunks of the sequence (dimension 1) this rank holds, if split.
    chunks: Option<ChunkOrder>,
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
            chunks: None,
        })
    }

    /// A dropout with probability `p` on the `[B, T, ...]` activations of the model `b` builds:
    /// under `b`'s context parallelism ([`ParamBuilder::context_parallel`]) its masks are those
    /// of the global positions of the rank's chunks ([`Dropout::with_chunk_order`]); otherwise
    /// [`Dropout::new`].
    pub fn on_sequence(p: f64, b: &ParamBuilder) -> Result<Self> {
        let d = Dropout::new(p)?;
        Ok(
            match b.context_parallel_group().filter(|cp| cp.degree() > 1) {
                Some(cp) => d.with_chunk_order(cp.order()),
                None => d,
            },
        )
    }

    /// This dropout's input `[B, T_local, ...]` holds, along dimension 1, the chunks of the
    /// sequence that `order` gives (a context-parallel rank's two chunks, side by side; under
    /// sequence parallelism this rank's part of them): each local position gets the mask its
    /// global position gets on one device.
    pub fn with_chunk_order(mut self, order: ChunkOrder) -> Self {
        self.chunks = (order.size > 1).then_some(order);
        self
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
        if sp.is_some() || self.chunks.is_some() {
            if t.rank() != 3 {
                meshgrad_tensor::bail!(
                    "dropout: sequence or context parallelism needs [B, T, C] activations, got {}",
                    t.shape()
                );
            }
            // This rank's positions of the [B, T, C] activation: its sequence-parallel part
            // and its context-parallel chunks.
            let n = t.dims()[1];
            let window = sp.map_or((0, n), |(_, tp)| (tp.rank() * n, n * tp.degree()));
            let runs = self.position_runs(n, window)?;
            return self.slice_mask(&x, seed, ctx.first_row, &runs);
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
        let runs = SliceRuns {
            runs: vec![(first_head, h)],
            global: heads,
        };
        self.slice_mask(x, seed, ctx.first_row, &runs)
    }

    /// Where the `n` local positions of dimension 1 lie in the global sequence, given `window =
    /// (start, len)`: they begin at position `start` of the rank's sequence of `len` positions
    /// (`start` 0 and `len` `n` without sequence parallelism), which under context parallelism
    /// is its two chunks side by side.
    fn position_runs(&self, n: usize, (start, len): (usize, usize)) -> Result<SliceRuns> {
        let Some(order) = self.chunks else {
            return Ok(SliceRuns {
                runs: vec![(start, n)],
                global: len,
            });
        };
        let global = len * order.size;
        let chunks = order.ranges(global)?;
        let l = len / 2;
        // The window's overlap with each local chunk [s l, (s + 1) l), at its global place.
        let runs = chunks
            .iter()
            .enumerate()
            .filter_map(|(s, g)| {
                let (lo, hi) = (start.max(s * l), (start + n).min((s + 1) * l));
                (lo < hi).then(|| (g.start + lo - s * l, hi - lo))
            })
            .collect();
        Ok(SliceRuns { runs, global })
    }

    /// Dropout of slices of dimension 1: `x [B, n, ...]` holds, side by side, the runs
    /// `runs.runs` (global start, length) of a `[B, runs.global, ...]` tensor (this rank's heads,
    /// or its sequence positions). Each batch row's runs of local elements get the masks of their
    /// global indices, so the masks are the ones a single device draws for the whole tensor.
    fn slice_mask(&self, x: &Var, seed: u64, first_row: u64, runs: &SliceRuns) -> Result<Var> {
        let t = x.tensor();
        let (b, n) = (t.dims()[0], t.dims()[1]);
        let inner = (t.elem_count() / (b * n).max(1)) as u64;
        let row = runs.global as u64 * inner;
        // The masks of each row's runs in row-major order are the local tensor's elements in
        // order: one concatenation of flat pieces (a mask depends on the element index alone).
        let masks: Vec<Tensor> = (0..b as u64)
            .flat_map(|i| runs.runs.iter().map(move |&(start, len)| (i, start, len)))
            .map(|(i, start, len)| {
                Tensor::dropout_mask(
                    seed,
                    (first_row + i) * row + start as u64 * inner,
                    self.p,
                    len * inner as usize,
                    t.dtype(),
                    t.device(),
                )
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = masks.iter().collect();
        let mask = Tensor::cat(&refs, 0)?.reshape(t.dims())?;
        x.mul(&Var::constant(mask))
    }
}

/// Runs `(global start, length)` of dimension 1 that a local tensor holds side by side, out of
/// `global` entries.
struct SliceRuns {
    runs: Vec<(usize, usize)>,
    global: usize,
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

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_tensor::{DType, Device};

    fn layer(p: f64) -> Dropout {
        let d = Dropout::new(p).unwrap();
        d.on_init("h.0.mlp.dropout", 7);
        d
    }

    #[test]
    fn context_parallel_chunks_get_the_masks_of_their_global_positions() {
        // [B, T, C] = [3, 16, 5], rows from global row 4: one device's output, cut to each
        // rank's two chunks, is what that rank's layer gives on its chunks of the input.
        let x = Tensor::randn((3, 16, 5), 11).unwrap();
        let ctx = ForwardCtx::new(2, 4);
        let whole = ctx
            .scope(|| layer(0.3).forward(&Var::constant(x.clone())))
            .unwrap();
        for size in [2, 4] {
            for rank in 0..size {
                let order = ChunkOrder::new(rank, size);
                let local = Var::constant(order.local_of(&x, 1).unwrap());
                let got = ctx
                    .scope(|| layer(0.3).with_chunk_order(order).forward(&local))
                    .unwrap();
                let want = order.local_of(whole.tensor(), 1).unwrap();
                assert_eq!(
                    got.tensor().to_vec_f32().unwrap(),
                    want.to_vec_f32().unwrap(),
                    "rank {rank} of {size}"
                );
                // Keyed by local positions instead, a later rank's masks differ.
                if rank > 0 {
                    let plain = ctx.scope(|| layer(0.3).forward(&local)).unwrap();
                    assert_ne!(
                        plain.tensor().to_vec_f32().unwrap(),
                        want.to_vec_f32().unwrap()
                    );
                }
            }
        }
    }

    #[test]
    fn a_sequence_that_does_not_split_into_the_chunks_is_an_error() {
        let x = Var::constant(Tensor::zeros((1, 3, 2), DType::F32, Device::Cpu).unwrap());
        let d = layer(0.5).with_chunk_order(ChunkOrder::new(0, 2));
        let err = ForwardCtx::new(0, 0).scope(|| d.forward(&x)).unwrap_err();
        assert!(err.to_string().contains("does not split"), "{err}");
    }
}
