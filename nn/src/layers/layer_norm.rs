//! Layer normalisation.

use std::sync::OnceLock;

use meshgrad_autograd::distributed::split_dim;
use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{Child, Forward, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::tp::reference::layer_norm_positions;
use crate::tp::{ParallelStyle, TensorParallel};

/// Layer norm over the last dim with a learned scale and (optionally) shift.
///
/// Under sequence parallelism ([`ParallelStyle::SequenceParallel`], or
/// [`ParallelStyle::SequenceSplit`] which first cuts a replicated input to this rank's positions)
/// it normalises this rank's positions; its replicated parameters' gradients are summed over the
/// tensor-parallel ranks.
pub struct LayerNorm {
    /// Scale `[dim]` (initialised to ones).
    pub weight: Var,
    /// Shift `[dim]` (zeros), if present.
    pub bias: Option<Var>,
    /// Added to the variance.
    pub eps: f64,
    tp: OnceLock<(ParallelStyle, TensorParallel)>,
}

impl LayerNorm {
    /// A norm over `dim` features, with a bias when `bias`. `eps` must be positive and finite.
    pub fn new(p: &ParamBuilder, dim: usize, bias: bool, eps: f64) -> Result<Self> {
        if !(eps.is_finite() && eps > 0.0) {
            meshgrad_tensor::bail!("layer norm: eps must be positive and finite, got {eps}");
        }
        let weight = p.param(dim, Init::Ones)?;
        let bias = if bias {
            Some(p.param(dim, Init::Zeros)?)
        } else {
            None
        };
        Ok(LayerNorm {
            weight,
            bias,
            eps,
            tp: OnceLock::new(),
        })
    }
}

impl Forward for LayerNorm {
    fn forward(&self, x: &Var) -> Result<Var> {
        let Some((style, tp)) = self.tp.get() else {
            return x.layer_norm(Some(&self.weight), self.bias.as_ref(), self.eps);
        };
        let x = if tp.splits_sequence() && *style == ParallelStyle::SequenceSplit {
            split_dim(x, 1, &tp.group)?
        } else {
            x.clone()
        };
        let (w, b) = tp.replicated_params(&self.weight, self.bias.as_ref())?;
        if let Some(folded) = tp.folded_for(x.tensor()) {
            // Reference mode's folded position order: once per position leaf.
            let mut params = vec![&w];
            params.extend(b.as_ref());
            return folded.leafwise(&x, 1, &params, |xl| {
                xl.layer_norm(Some(&w), b.as_ref(), self.eps)
            });
        }
        match tp.position_chunks() {
            // Reference mode (also on one device): parameter gradients as trees over position
            // chunks, the same with or without sequence parallelism.
            Some(chunks) => layer_norm_positions(&x, &w, b.as_ref(), self.eps, chunks),
            None => x.layer_norm(Some(&w), b.as_ref(), self.eps),
        }
    }
}

impl Module for LayerNorm {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        f("weight", Child::Param(&self.weight));
        if let Some(b) = &self.bias {
            f("bias", Child::Param(b));
        }
    }
    fn module_type(&self) -> &'static str {
        "LayerNorm"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if !matches!(
            style,
            ParallelStyle::SequenceParallel | ParallelStyle::SequenceSplit
        ) {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: layer norm `{path}` takes SequenceParallel or \
                 SequenceSplit, not {style:?}"
            );
        }
        let _ = self.tp.set((*style, tp.clone()));
        Ok(())
    }
}
