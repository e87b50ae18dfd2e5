//! Layer normalisation.

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{join, Init, Module, ParamFactory};

/// Layer norm over the last dim with learned weight (init 1) and optional bias (init 0).
pub struct LayerNorm {
    /// `[dim]`
    pub weight: Var,
    /// `[dim]`, if present.
    pub bias: Option<Var>,
    /// Variance epsilon.
    pub eps: f64,
}

impl LayerNorm {
    /// A new layer norm named `name`.
    pub fn new(f: &ParamFactory, name: &str, dim: usize, bias: bool, eps: f64) -> Result<Self> {
        let weight = f.param(&join(name, "weight"), dim, Init::Ones)?;
        let bias = if bias {
            Some(f.param(&join(name, "bias"), dim, Init::Zeros)?)
        } else {
            None
        };
        Ok(LayerNorm { weight, bias, eps })
    }

    /// Normalises `x [..., dim]` (fused kernel).
    pub fn forward(&self, x: &Var) -> Result<Var> {
        x.layer_norm(Some(&self.weight), self.bias.as_ref(), self.eps)
    }
}

impl Module for LayerNorm {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        f(join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(join(prefix, "bias"), b);
        }
    }
}
