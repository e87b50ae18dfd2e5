//! Expert parallelism as the layers see it: [`ExpertParallel`], the group of ranks a mixture of
//! experts' experts are sharded over ([`crate::ParamBuilder::expert_parallel`]).
//!
//! Over `E` ranks, rank `r` holds experts `r * N/E .. (r + 1) * N/E` of every layer (named by
//! their global index, `experts.{e}`, as in the full model), and the router, attention, norms
//! and embeddings whole. Each rank routes its own tokens, then the layer moves each token copy
//! to the rank of its expert and back with an all-to-all of uneven splits
//! ([`meshgrad_autograd::distributed::all_to_all_rows`]; see [`super::SparseMoe`]). On a group of
//! one rank the layer is the plain layer.
//!
//! **Reference mode** ([`ExpertParallel::reference`]): a rank's expert meets, in one pass, the
//! token copies of the row groups of every rank of the group, which one device computes in
//! separate passes. So each source rank's copies run through the expert on their own (the same
//! products as one device's, row for row), and the expert's parameters are read through
//! [`meshgrad_autograd::source_grads::set_aside`] per source: each source's contribution to their
//! gradients is set aside for the trainer, which places it at that row group's leaf of the
//! gradient tree instead of adding it in `.grad`.

use std::ops::Range;
use std::sync::Arc;

use meshgrad_autograd::distributed::Collectives;
use meshgrad_tensor::Result;

/// This rank's expert-parallel group (see the [module docs](self)).
#[derive(Clone)]
pub struct ExpertParallel {
    /// The ranks the experts are sharded over, in expert order (rank `r` holds the `r`-th
    /// block of experts).
    pub group: Arc<dyn Collectives>,
    /// Reference mode: each source rank's token copies run through an expert apart, their
    /// gradients set aside per source (see the [module docs](self)).
    pub reference: bool,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertParallel(rank {} of {}{})",
            self.group.rank(),
            self.group.describe(),
            if self.reference { ", reference" } else { "" }
        )
    }
}

impl ExpertParallel {
    /// Expert parallelism over `group` (fast mode).
    pub fn new(group: Arc<dyn Collectives>) -> Self {
        ExpertParallel {
            group,
            reference: false,
        }
    }

    /// This group in reference mode when `on` (see the [module docs](self)).
    pub fn with_reference(self, on: bool) -> Self {
        ExpertParallel {
            reference: on,
            ..self
        }
    }

    /// Number of ranks (`E`).
    pub fn degree(&self) -> usize {
        self.group.size()
    }

    /// The experts (global indices) rank `rank` holds of `n_experts`, or a one-line error when
    /// `E` does not divide `n_experts`.
    pub fn experts_of(&self, rank: usize, n_experts: usize) -> Result<Range<usize>> {
        let e = self.degree();
        Self::check_divides(e, n_experts)?;
        let per = n_experts / e;
        Ok(rank * per..(rank + 1) * per)
    }

    /// The one-line refusal of `ep` ranks for `n_experts` experts that it does not divide.
    pub fn check_divides(ep: usize, n_experts: usize) -> Result<()> {
        if ep == 0 || !n_experts.is_multiple_of(ep) {
            meshgrad_tensor::bail!(
                "expert parallelism: ep = {ep} does not divide the {n_experts} experts of a layer"
            );
        }
        Ok(())
    }

    /// The experts this rank holds of `n_experts` ([`Self::experts_of`]).
    pub fn local_experts(&self, n_experts: usize) -> Result<Range<usize>> {
        self.experts_of(self.group.rank(), n_experts)
    }
}

/// The full names of the expert parameters (`...experts.{e}...`) of every
/// [`SparseMoe`](super::SparseMoe) in `model`: what expert parallelism shards, and what the ranks
/// that hold the same experts reduce apart from the other parameters.
pub fn expert_parameter_names(model: &dyn crate::Module) -> Vec<String> {
    let mut prefixes = Vec::new();
    model.visit_modules("", &mut |path, m| {
        if m.module_type() == "SparseMoe" {
            prefixes.push(if path.is_empty() {
                "experts.".to_string()
            } else {
                format!("{path}.experts.")
            });
        }
    });
    model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p.as_str())))
        .collect()
}
