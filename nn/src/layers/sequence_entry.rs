//! [`SequenceEntry`]: where a sequence-parallel region begins, in a model with no layer there
//! to begin it.

use std::sync::OnceLock;

use meshgrad_autograd::distributed::split_dim;
use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{Child, Forward, Module};
use crate::tp::{ParallelStyle, TensorParallel};

/// The identity, but under [`ParallelStyle::SequenceSplit`] with sequence parallelism on it cuts
/// a replicated `[B, T, C]` input to this rank's positions `[B, T / tp, C]` (its backward
/// gathers the gradient). It owns no parameters. GPT begins its sequence-parallel region at the
/// embedding dropout; a model without that dropout (Llama) places this module after its
/// embedding instead.
#[derive(Default)]
pub struct SequenceEntry {
    tp: OnceLock<TensorParallel>,
}

impl SequenceEntry {
    /// The identity until a plan gives it [`ParallelStyle::SequenceSplit`].
    pub fn new() -> Self {
        SequenceEntry::default()
    }
}

impl Forward for SequenceEntry {
    fn forward(&self, x: &Var) -> Result<Var> {
        match self.tp.get().filter(|tp| tp.splits_sequence()) {
            Some(tp) => split_dim(x, 1, &tp.group),
            None => Ok(x.clone()),
        }
    }
}

impl Module for SequenceEntry {
    fn visit_children(&self, _f: &mut dyn FnMut(&str, Child<'_>)) {}
    fn module_type(&self) -> &'static str {
        "SequenceEntry"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if *style != ParallelStyle::SequenceSplit {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: `{path}` takes SequenceSplit, not {style:?}"
            );
        }
        let _ = self.tp.set(tp.clone());
        Ok(())
    }
}
