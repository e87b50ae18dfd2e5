//! Fully connected layer.

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{join, Init, Module, ParamFactory};

/// `y = x Wᵀ + b` with `W` stored `[out, in]` (the PyTorch `nn.Linear` convention; the
/// transposed read is a strided view, never a copy).
pub struct Linear {
    /// `[out_features, in_features]`
    pub weight: Var,
    /// `[out_features]`, if present.
    pub bias: Option<Var>,
}

impl Linear {
    /// A new layer named `name` with weights ~ N(0, std) and zero bias.
    pub fn new(
        f: &ParamFactory,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let weight = f.param(
            &join(name, "weight"),
            (out_features, in_features),
            Init::Normal(std),
        )?;
        let bias = if bias {
            Some(f.param(&join(name, "bias"), out_features, Init::Zeros)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// Applies the layer to `x [..., in]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        let in_features = self.weight.tensor().dims()[1];
        if x.tensor().dims().last() != Some(&in_features) {
            meshgrad_tensor::bail!(
                "linear: input of shape {} does not end in in_features {in_features} (weight {})",
                x.tensor().shape(),
                self.weight.tensor().shape()
            );
        }
        // One fused op: a single gemm over all rows with the bias as its starting value.
        Var::linear(x, &self.weight, self.bias.as_ref())
    }
}

impl Module for Linear {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        f(join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(join(prefix, "bias"), b);
        }
    }
}
