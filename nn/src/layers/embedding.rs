//! Embedding table.

use meshgrad_autograd::Var;
use meshgrad_tensor::{Result, Tensor};

use crate::module::{join, Init, Module, ParamFactory};

/// A `[num_embeddings, dim]` lookup table.
pub struct Embedding {
    /// `[num_embeddings, dim]`
    pub weight: Var,
}

impl Embedding {
    /// A new table named `name` with entries ~ N(0, std).
    pub fn new(f: &ParamFactory, name: &str, num: usize, dim: usize, std: f64) -> Result<Self> {
        Ok(Embedding {
            weight: f.param(&join(name, "weight"), (num, dim), Init::Normal(std))?,
        })
    }

    /// Looks up integer `ids` of any shape: result `ids.shape + [dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        Var::embedding(&self.weight, ids)
    }
}

impl Module for Embedding {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        f(join(prefix, "weight"), &self.weight);
    }
}
