//! Layer normalisation.

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{Forward, Init, ParamBuilder};

/// Layer norm over the last dim with a learned scale and (optionally) shift.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct LayerNorm {
    /// Scale `[dim]` (initialised to ones).
    pub weight: Var,
    /// Shift `[dim]` (zeros), if present.
    pub bias: Option<Var>,
    /// Added to the variance.
    pub eps: f64,
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
        Ok(LayerNorm { weight, bias, eps })
    }
}

impl Forward for LayerNorm {
    fn forward(&self, x: &Var) -> Result<Var> {
        x.layer_norm(Some(&self.weight), self.bias.as_ref(), self.eps)
    }
}
