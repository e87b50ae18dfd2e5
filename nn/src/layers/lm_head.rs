//! The output projection onto the vocabulary over a table owned by another module (a tied
//! embedding), and its loss.

use std::sync::OnceLock;

use meshgrad_autograd::distributed::{all_gather_dim, all_reduce_backward};
use meshgrad_autograd::Var;
use meshgrad_tensor::{Result, Tensor};

use crate::module::{Child, Module};
use crate::tp::reference::column_linear;
use crate::tp::{
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_chunked, ParallelStyle,
    TensorParallel,
};

/// Logits `x tableᵀ` for a table `[vocab, C]` passed at call time (GPT's head reads `wte`), and
/// the mean cross-entropy of logits. It owns no parameters.
///
/// Under [`ParallelStyle::VocabHead`] the table is this rank's vocabulary rows, the logits stay
/// split (`[..., vocab / tp]`, never gathered) and [`LmHead::loss`] is loss-parallel.
#[derive(Default)]
pub struct LmHead {
    tp: OnceLock<TensorParallel>,
}

impl LmHead {
    /// A head with no parallel style.
    pub fn new() -> Self {
        LmHead::default()
    }

    /// The tensor-parallel group when the logits are split by vocabulary.
    pub fn vocab_parallel(&self) -> Option<&TensorParallel> {
        self.tp.get().filter(|tp| tp.degree() > 1)
    }

    /// Logits `[..., vocab]` (this rank's vocabulary slice under [`ParallelStyle::VocabHead`]) of
    /// hidden states `x [..., C]`.
    pub fn forward(&self, x: &Var, table: &Var) -> Result<Var> {
        self.forward_with_bias(x, table, None)
    }

    /// As [`LmHead::forward`] with an output bias `[vocab]` (BERT's decoder bias); under
    /// [`ParallelStyle::VocabHead`] the bias is this rank's vocabulary slice `[vocab / tp]`, like
    /// the table.
    pub fn forward_with_bias(&self, x: &Var, table: &Var, bias: Option<&Var>) -> Result<Var> {
        match self.tp.get().filter(|tp| tp.is_active()) {
            Some(tp) => {
                let x = if tp.splits_sequence() {
                    all_gather_dim(x, 1, &tp.group)?
                } else {
                    all_reduce_backward(x, &tp.group)?
                };
                match (tp.local_chunks(), tp.folded_for(x.tensor())) {
                    // Reference mode's folded position order: once per position leaf.
                    (Some(units), Some(folded)) => {
                        let mut params = vec![table];
                        params.extend(bias);
                        folded.leafwise(&x, 1, &params, |xl| {
                            column_linear(xl, table, bias, 1, units)
                        })
                    }
                    // Reference mode: one product per vocabulary chunk.
                    (Some(units), None) => column_linear(&x, table, bias, 1, units),
                    (None, _) => Var::linear(&x, table, bias),
                }
            }
            None => Var::linear(x, table, bias),
        }
    }

    /// Mean cross-entropy of `logits [..., V]` (as [`LmHead::forward`] returns them) against
    /// `targets [...]`, skipping `ignore_index`.
    pub fn loss(&self, logits: &Var, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        let dims = logits.tensor().dims();
        let v = *dims.last().unwrap_or(&0);
        let n = targets.elem_count();
        if logits.tensor().elem_count() != n * v {
            meshgrad_tensor::bail!(
                "lm head loss: logits {} do not match targets {}",
                logits.tensor().shape(),
                targets.shape()
            );
        }
        // Reference mode's folded position order: the token sum over the position leaves' tree.
        let folded = self
            .tp
            .get()
            .and_then(|tp| tp.folded_for(targets))
            .map(|f| (f, targets.dims()[1]));
        let flat = logits.reshape((n, v))?;
        let targets = targets.reshape(n)?;
        match self.tp.get().filter(|tp| tp.is_active()) {
            Some(tp) => match tp.local_chunks() {
                // Reference mode (also on one device): softmax statistics per vocabulary chunk.
                Some(chunks) => vocab_parallel_cross_entropy_chunked(
                    &flat,
                    &targets,
                    ignore_index,
                    tp,
                    chunks,
                    folded,
                ),
                None => vocab_parallel_cross_entropy(&flat, &targets, ignore_index, tp),
            },
            None => flat.cross_entropy(&targets, ignore_index),
        }
    }
}

impl Module for LmHead {
    fn visit_children(&self, _f: &mut dyn FnMut(&str, Child<'_>)) {}
    fn module_type(&self) -> &'static str {
        "LmHead"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if *style != ParallelStyle::VocabHead {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: head `{path}` takes VocabHead, not {style:?}"
            );
        }
        let _ = self.tp.set(tp.clone());
        Ok(())
    }
}
