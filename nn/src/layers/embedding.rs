//! Token / position embedding table.

use std::sync::OnceLock;

use meshgrad_autograd::distributed::all_reduce_forward;
use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Result, Tensor};

use crate::module::{Child, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::tp::{ParallelStyle, TensorParallel};

/// A lookup table `[num, dim]`; `forward(ids)` gathers rows.
///
/// Under [`ParallelStyle::VocabEmbedding`] each rank holds rows `[r num/tp, (r+1) num/tp)`;
/// ids outside them look up zeros and the ranks' results are summed.
pub struct Embedding {
    /// `[num_embeddings, dim]` (this rank's rows under tensor parallelism)
    pub weight: Var,
    path: OnceLock<String>,
    tp: OnceLock<TensorParallel>,
}

impl Embedding {
    /// A table of `num` rows of width `dim`, drawn from N(0, std).
    pub fn new(p: &ParamBuilder, num: usize, dim: usize, std: f64) -> Result<Self> {
        Ok(Embedding {
            weight: p.param((num, dim), Init::Normal(std))?,
            path: OnceLock::new(),
            tp: OnceLock::new(),
        })
    }

    /// Rows of the table for integer `ids` of any shape: `[..., dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        let r = match self.tp.get() {
            Some(tp) if tp.degree() > 1 => self.forward_vocab_parallel(ids, tp),
            // Reference mode's folded position order: the lookup once per position leaf.
            Some(tp) if tp.folded_for(ids).is_some() => {
                let folded = tp.folded_for(ids).expect("checked");
                folded.leafwise(&Var::constant(ids.clone()), 1, &[&self.weight], |leaf| {
                    Var::embedding(&self.weight, leaf.tensor())
                })
            }
            _ => Var::embedding(&self.weight, ids),
        };
        r.map_err(|e| {
            meshgrad_tensor::Error::msg(format!(
                "embedding {}: {e}",
                self.path.get().map(String::as_str).unwrap_or("")
            ))
        })
    }
}

impl Embedding {
    fn forward_vocab_parallel(&self, ids: &Tensor, tp: &TensorParallel) -> Result<Var> {
        let rows = self.weight.tensor().dims()[0];
        let (start, vocab) = ((tp.rank() * rows) as i64, (rows * tp.degree()) as i64);
        let all: Vec<i64> = ids.to_vec_f64()?.iter().map(|&v| v as i64).collect();
        if let Some(&bad) = all.iter().find(|&&v| !(0..vocab).contains(&v)) {
            meshgrad_tensor::bail!("id {bad} is outside the table of {vocab} rows");
        }
        let mine = |v: i64| (start..start + rows as i64).contains(&v);
        let local: Vec<i64> = all
            .iter()
            .map(|&v| if mine(v) { v - start } else { 0 })
            .collect();
        let keep: Vec<f64> = all
            .iter()
            .map(|&v| if mine(v) { 1.0 } else { 0.0 })
            .collect();
        let mut mask_dims = ids.dims().to_vec();
        mask_dims.push(1);
        let mask = Tensor::from_vec(keep, mask_dims, ids.device())?
            .to_dtype(self.weight.tensor().dtype())?;
        let local = Tensor::from_vec(local, ids.shape().clone(), ids.device())?.to_dtype(
            if ids.dtype().is_int() {
                ids.dtype()
            } else {
                DType::I64
            },
        )?;
        let rows = Var::embedding(&self.weight, &local)?.mul(&Var::constant(mask))?;
        all_reduce_forward(&rows, &tp.group)
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
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if *style != ParallelStyle::VocabEmbedding {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: embedding `{path}` takes VocabEmbedding, not {style:?}"
            );
        }
        let _ = self.tp.set(tp.clone());
        Ok(())
    }
}
