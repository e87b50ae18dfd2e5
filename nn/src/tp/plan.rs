//! [`ParallelStyle`] and [`TpPlan`]: which module is split how.

use std::collections::HashMap;

use meshgrad_tensor::Result;

use super::TensorParallel;
use crate::module::{path_matches, Module};

/// How one module is split across the tensor-parallel group (see the [module docs](super)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParallelStyle {
    /// A `Linear` split by output features. The output dimension is `chunks` equal blocks each
    /// split across the ranks (3 for a fused `[q | k | v]` projection, so each rank holds its heads
    /// of q, k and v).
    Colwise {
        /// Equal blocks of the output dimension, each split separately.
        chunks: usize,
    },
    /// A `Linear` split by input features; the partial outputs are summed.
    Rowwise,
    /// An `Embedding` split by vocabulary rows.
    VocabEmbedding,
    /// An output head over a vocabulary-split table: logits stay split, the loss is
    /// loss-parallel. A `bias` parameter of the head's module (BERT's `cls.predictions.bias`) is
    /// split by vocabulary like the table, and so is its own `weight` (an untied head's table,
    /// Llama's `lm_head.weight`).
    VocabHead,
    /// A `LayerNorm`, `Dropout` or replicated `Linear` whose input is already split along the
    /// sequence (under sequence parallelism); replicated parameters get their gradients summed
    /// over the group.
    SequenceParallel,
    /// A `LayerNorm` or `Dropout` whose replicated input is first cut to this rank's sequence
    /// chunk (where a sequence-parallel region begins).
    SequenceSplit,
}

impl ParallelStyle {
    /// How a module in this style splits its parameter named `leaf` (`weight`, `bias`): the
    /// dimension and chunk count, or `None` when it is replicated.
    pub fn split_of(&self, leaf: &str) -> Option<(usize, usize)> {
        match (self, leaf) {
            (ParallelStyle::Colwise { chunks }, "weight" | "bias") => Some((0, *chunks)),
            (ParallelStyle::Rowwise, "weight") => Some((1, 1)),
            (ParallelStyle::VocabEmbedding, "weight") => Some((0, 1)),
            (ParallelStyle::VocabHead, "weight" | "bias") => Some((0, 1)),
            _ => None,
        }
    }
}

/// A tensor-parallel plan: module path patterns and their styles, applied in order (the first
/// pattern that matches a module decides its style). Every pattern must match some module.
///
/// ```
/// use meshgrad_nn::tp::{ParallelStyle, TpPlan};
/// let plan = TpPlan::new()
///     .with("layers.*.up", ParallelStyle::Colwise { chunks: 1 })
///     .with("layers.*.down", ParallelStyle::Rowwise);
/// assert_eq!(plan.entries().len(), 2);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TpPlan {
    entries: Vec<(String, ParallelStyle)>,
}

impl TpPlan {
    /// An empty plan (everything replicated).
    pub fn new() -> Self {
        TpPlan::default()
    }

    /// Adds `pattern -> style`.
    pub fn with(mut self, pattern: impl Into<String>, style: ParallelStyle) -> Self {
        self.entries.push((pattern.into(), style));
        self
    }

    /// The entries, in order.
    pub fn entries(&self) -> &[(String, ParallelStyle)] {
        &self.entries
    }

    /// The style of every module the plan matches, by module path; an error naming a pattern that
    /// matches no module of `model`.
    pub fn resolve(&self, model: &dyn Module) -> Result<HashMap<String, ParallelStyle>> {
        let paths = model.module_paths();
        let mut styles = HashMap::new();
        for (pattern, _) in &self.entries {
            if !paths.iter().any(|p| path_matches(pattern, p)) {
                meshgrad_tensor::bail!(
                    "tensor-parallel plan: pattern `{pattern}` matches no module of this {} \
                     (its modules include: {})",
                    model.module_type(),
                    paths
                        .iter()
                        .filter(|p| !p.is_empty())
                        .take(12)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        for p in &paths {
            if let Some((_, style)) = self.entries.iter().find(|(pat, _)| path_matches(pat, p)) {
                styles.insert(p.clone(), *style);
            }
        }
        Ok(styles)
    }

    /// The split of parameter `name` (`module.path.leaf`) under the styles `resolve` returned.
    pub fn split_of(styles: &HashMap<String, ParallelStyle>, name: &str) -> Option<(usize, usize)> {
        let (module, leaf) = name.rsplit_once('.').unwrap_or(("", name));
        styles.get(module).and_then(|s| s.split_of(leaf))
    }

    /// Hands every matched module of `model` its style (its forward then communicates over
    /// `tp`). The parameters must already have their local shapes (build the model through
    /// [`crate::ParamBuilder::tensor_parallel`]).
    pub fn apply(&self, model: &dyn Module, tp: &TensorParallel) -> Result<()> {
        let styles = self.resolve(model)?;
        let mut err = None;
        model.visit_modules("", &mut |path, m| {
            if err.is_some() {
                return;
            }
            if let Some(style) = styles.get(path) {
                if let Err(e) = m.parallelize(path, style, tp) {
                    err = Some(e);
                }
            }
        });
        err.map_or(Ok(()), Err)
    }
}
