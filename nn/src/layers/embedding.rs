//! Token / position embedding table.

use std::sync::OnceLock;

use meshgrad_autograd::Var;
use meshgrad_tensor::{Result, Tensor};

use crate::module::{Child, Init, Module, ParamBuilder};

/// A lookup table `[num, dim]`; `forward(ids)` gathers rows.
pub struct Embedding {
    /// `[num_embeddings, dim]`
    pub weight: Var,
    path: OnceLock<String>,
}

impl Embedding {
    /// A table of `num` rows of width `dim`, drawn from N(0, std).
    pub fn new(p: &ParamBuilder, num: usize, dim: usize, std: f64) -> Result<Self> {
        Ok(Embedding {
            weight: p.param((num, dim), Init::Normal(std))?,
            path: OnceLock::new(),
        })
    }

    /// Rows of the table for integer `ids` of any shape: `[..., dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        Var::embedding(&self.weight, ids).map_err(|e| {
            meshgrad_tensor::Error::msg(format!(
                "embedding {}: {e}",
                self.path.get().map(String::as_str).unwrap_or("")
            ))
        })
    }
}

impl Module for Embedding {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        f("weight", Child::Param(&self.weight));
    }
    fn module_type(&self) -> &'static str {
        "Embedding"
    }
    fn on_init(&self, path: &str, _seed: u64) {
        let _ = self.path.set(path.to_string());
    }
}
