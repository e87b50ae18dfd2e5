//! RMS normalisation (Llama's norm).

use std::sync::OnceLock;

use meshgrad_autograd::distributed::split_dim;
use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{Child, Forward, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::tp::reference::rms_norm_positions;
use crate::tp::{ParallelStyle, TensorParallel};

/// `x / sqrt(mean(x²) + eps) * weight` over the last dim, with a learned scale (fused forward and
/// backward, [`Var::rms_norm`]).
///
/// Under sequence parallelism ([`ParallelStyle::SequenceParallel`], or
/// [`ParallelStyle::SequenceSplit`] which first cuts a replicated input to this rank's positions)
/// it normalises this rank's positions; its replicated weight's gradient is summed over the
/// tensor-parallel ranks. In reference mode the weight gradient is a tree over position chunks.
pub struct RmsNorm {
    /// Scale `[dim]` (initialised to ones).
    pub weight: Var,
    /// Added to the mean square.
    pub eps: f64,
    tp: OnceLock<(ParallelStyle, TensorParallel)>,
}

impl RmsNorm {
    /// A norm over `dim` features. `eps` must be positive and finite.
    pub fn new(p: &ParamBuilder, dim: usize, eps: f64) -> Result<Self> {
        if !(eps.is_finite() && eps > 0.0) {
            meshgrad_tensor::bail!("rms norm: eps must be positive and finite, got {eps}");
        }
        Ok(RmsNorm {
            weight: p.param(dim, Init::Ones)?,
            eps,
            tp: OnceLock::new(),
        })
    }
}

impl Forward for RmsNorm {
    fn forward(&self, x: &Var) -> Result<Var> {
        let Some((style, tp)) = self.tp.get() else {
            return x.rms_norm(Some(&self.weight), self.eps);
        };
        let x = if tp.splits_sequence() && *style == ParallelStyle::SequenceSplit {
            split_dim(x, 1, &tp.group)?
        } else {
            x.clone()
        };
        let (w, _) = tp.replicated_params(&self.weight, None)?;
        if let Some(folded) = tp.folded_for(x.tensor()) {
            // Reference mode's folded position order: once per position leaf.
            return folded.leafwise(&x, 1, &[&w], |xl| xl.rms_norm(Some(&w), self.eps));
        }
        match tp.position_chunks() {
            Some(chunks) => rms_norm_positions(&x, &w, self.eps, chunks),
            None => x.rms_norm(Some(&w), self.eps),
        }
    }
}

impl Module for RmsNorm {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        f("weight", Child::Param(&self.weight));
    }
    fn module_type(&self) -> &'static str {
        "RmsNorm"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if !matches!(
            style,
            ParallelStyle::SequenceParallel | ParallelStyle::SequenceSplit
        ) {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: rms norm `{path}` takes SequenceParallel or \
                 SequenceSplit, not {style:?}"
            );
        }
        let _ = self.tp.set((*style, tp.clone()));
        Ok(())
    }
}
