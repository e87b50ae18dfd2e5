//! Tensor and sequence parallelism, as data.
//!
//! A [`TpPlan`] maps module path patterns (`h.*.attn.c_attn`, `*` = one path component) to a
//! [`ParallelStyle`]. Building a model through a [`ParamBuilder`](crate::ParamBuilder) that
//! carries a plan ([`ParamBuilder::tensor_parallel`](crate::ParamBuilder::tensor_parallel))
//!
//! 1. creates every parameter at its **local** shape only (a split parameter is never
//!    materialised whole on any rank), recording its [`Placement`] on the variable;
//! 2. fills each local part with exactly the values the same slice of the single-device
//!    parameter has (initialisation is keyed by name and global element index);
//! 3. hands each matched module its style ([`Module::parallelize`](crate::Module::parallelize)),
//!    so its forward inserts the communication (the differentiable functions of
//!    [`meshgrad_autograd::distributed`]) where Megatron-LM puts it.
//!
//! | style                 | modules             | parameters                          | forward |
//! |-----------------------|---------------------|-------------------------------------|---------|
//! | `Colwise { chunks }`  | `Linear`            | weight, bias split by output rows    | input gathered (SP) or replicated; output split by features |
//! | `Rowwise`             | `Linear`            | weight split by input columns        | partial output summed (all-reduce), or reduce-scattered along the sequence (SP); then the bias |
//! | `VocabEmbedding`      | `Embedding`         | table split by vocabulary rows        | lookups outside the shard are zeros; summed |
//! | `VocabHead`           | `LmHead` (or a module holding one) | (reads a vocab-split table); its own `weight` (an untied table) and `bias` split by vocabulary | logits stay split by vocabulary; loss-parallel cross-entropy |
//! | `SequenceParallel`    | `LayerNorm`, `RmsNorm`, `Dropout`, `Linear` | replicated   | SP: runs on this rank's sequence chunk (parameter gradients summed) |
//! | `SequenceSplit`       | `LayerNorm`, `RmsNorm`, `Dropout`, `SequenceEntry` | replicated | SP: first cuts the replicated input to this rank's chunk |
//!
//! With sequence parallelism off, the last two are plain replicated computation. On a group of
//! one rank, every style degenerates to the plain module (no communication, no copies).
//!
//! Sequence parallelism splits activations `[B, T, C]` along `T` (dimension 1): rank `r` holds
//! positions `[r T / tp, (r + 1) T / tp)` of every sequence. Dropout keys its masks by global
//! element index, so a sequence-parallel run draws the masks a single device draws.

mod loss;
mod plan;
pub mod reference;

pub use loss::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_chunked};
pub use meshgrad_autograd::distributed::{Collectives, Placement};
pub use plan::{ParallelStyle, TpPlan};

use std::sync::Arc;

/// The tensor-parallel group of this rank and whether sequence parallelism is on.
#[derive(Clone)]
pub struct TensorParallel {
    /// The ranks that split each layer (mesh dimension `tp`).
    pub group: Arc<dyn Collectives>,
    /// Split the LayerNorm / dropout regions along the sequence.
    pub sequence_parallel: bool,
    /// Reference mode's chunk count `K` (see [`mod@reference`]): `None` in fast mode. When set, the
    /// layers compute every sum the group splits as a tree over `K` chunks, on one device (a
    /// group of one rank) as on `T` ranks (`T` dividing `K`).
    pub reference: Option<usize>,
    /// Reference mode's folded position order ([`TensorParallel::folded`]), if set.
    pub folded: Option<meshgrad_autograd::distributed::FoldedPositions>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TensorParallel(rank {} of {}, sequence_parallel={}, reference={:?})",
            self.group.rank(),
            self.group.size(),
            self.sequence_parallel,
            self.reference
        )
    }
}

impl TensorParallel {
    /// Tensor parallelism over `group`, without sequence parallelism.
    pub fn new(group: Arc<dyn Collectives>) -> Self {
        TensorParallel {
            group,
            sequence_parallel: false,
            reference: None,
            folded: None,
        }
    }

    /// The reference-mode context of a single-device run: a group of one rank (every collective
    /// returns its input) with reference chunk count `chunks`.
    pub fn single_device(chunks: usize) -> Self {
        TensorParallel::new(Arc::new(reference::OneRank)).reference(Some(chunks))
    }

    /// With reference mode's chunk count `K` (`None`: fast mode).
    pub fn reference(mut self, chunks: Option<usize>) -> Self {
        self.reference = chunks;
        self
    }

    /// Whether the layers take their tensor-parallel path: more than one rank, or reference
    /// mode (whose chunked sums a single device computes too).
    pub fn is_active(&self) -> bool {
        self.degree() > 1 || self.reference.is_some()
    }

    /// In reference mode, the number of the `K` chunks of a split dimension this rank holds
    /// (`K / degree`).
    pub fn local_chunks(&self) -> Option<usize> {
        self.reference.map(|k| (k / self.degree()).max(1))
    }

    /// Reference mode's folded position order (`train.reference_positions=folded`, under
    /// context parallelism or on one device): the layers run once per position leaf and add
    /// their parameters' gradients over the leaves' tree
    /// ([`FoldedPositions::leafwise`](meshgrad_autograd::distributed::FoldedPositions::leafwise)),
    /// instead of the sequence-order chunks of [`TensorParallel::position_chunks`].
    pub fn folded(
        mut self,
        folded: Option<meshgrad_autograd::distributed::FoldedPositions>,
    ) -> Self {
        self.folded = folded;
        self
    }

    /// The folded order's leaves when `x` is `[B, T, ...]` whose positions split into them
    /// (reference mode's training sequences always do; a shorter context is taken whole).
    pub fn folded_for(
        &self,
        x: &meshgrad_tensor::Tensor,
    ) -> Option<&meshgrad_autograd::distributed::FoldedPositions> {
        self.folded
            .as_ref()
            .filter(|f| x.rank() >= 2 && f.splits(x.dims()[1]))
    }

    /// In reference mode, the number of position chunks of this rank's activations: `K / degree`
    /// under sequence parallelism (its positions are a `1 / degree` share), else `K`. `None`
    /// in the folded order, where each layer runs per position leaf instead.
    pub fn position_chunks(&self) -> Option<usize> {
        if self.folded.is_some() {
            return None;
        }
        self.reference.map(|k| {
            if self.splits_sequence() {
                (k / self.degree()).max(1)
            } else {
                k
            }
        })
    }

    /// With or without sequence parallelism.
    pub fn sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Number of ranks.
    pub fn degree(&self) -> usize {
        self.group.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// A placement splitting dimension `dim` (in `chunks` blocks) over this group.
    pub fn placement(&self, dim: usize, chunks: usize) -> Placement {
        Placement::shard(dim, chunks, "tp", self.group.clone())
    }

    /// A replicated layer's `weight` and `bias` as its forward uses them: under sequence
    /// parallelism each rank applies them to its own positions, so their gradients are summed
    /// over the group (`all_reduce_backward`); otherwise they are used as they are.
    pub fn replicated_params(
        &self,
        weight: &meshgrad_autograd::Var,
        bias: Option<&meshgrad_autograd::Var>,
    ) -> meshgrad_tensor::Result<(meshgrad_autograd::Var, Option<meshgrad_autograd::Var>)> {
        use meshgrad_autograd::distributed::all_reduce_backward;
        if !self.splits_sequence() {
            return Ok((weight.clone(), bias.cloned()));
        }
        let b = bias
            .map(|b| all_reduce_backward(b, &self.group))
            .transpose()?;
        Ok((all_reduce_backward(weight, &self.group)?, b))
    }

    /// Whether activations in the LayerNorm / dropout regions are split along the sequence
    /// (sequence parallelism on a group of more than one rank).
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.degree() > 1
    }
}

/// The largest power of two dividing every one of `sizes` (1 when there are none, or one is
/// odd): a model's reference chunk count (see [`mod@reference`]) is this over the sizes its
/// chunked sums split.
pub fn largest_common_power_of_two(sizes: &[usize]) -> usize {
    let twos = sizes
        .iter()
        .map(|n| n.trailing_zeros().min(usize::BITS - 1))
        .min()
        .unwrap_or(0);
    1 << twos
}

/// Every parameter of `model` by name at its full shape: parameters split across ranks are
/// gathered over their group (a collective: every rank of the group calls it, in the same
/// order), replicated ones are copied as they are. The result is the single-device state dict.
pub fn full_state_dict(
    model: &dyn crate::Module,
) -> meshgrad_tensor::Result<Vec<(String, meshgrad_tensor::Tensor)>> {
    model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let t = match p.placement() {
                Some(pl) => pl.gather(p.tensor())?,
                None => p.tensor().contiguous()?,
            };
            Ok((name, t))
        })
        .collect()
}

/// Checks that each named size splits over `tp` ranks (and `sequence`, the sequence length
/// under sequence parallelism): a one-line error naming the first that does not, e.g.
/// `tensor parallelism: gpt n_head = 3 is not divisible by tp = 2`. A model's own check
/// (`check_tp_sizes`) lists its sizes; a vocabulary that does not split says it is not padded.
pub fn check_split_sizes(
    model: &str,
    tp: usize,
    sizes: &[(&str, usize)],
    sequence: Option<usize>,
) -> meshgrad_tensor::Result<()> {
    if tp <= 1 {
        return Ok(());
    }
    for &(what, n) in sizes {
        if !n.is_multiple_of(tp) {
            meshgrad_tensor::bail!(
                "tensor parallelism: {model} {what} = {n} is not divisible by tp = {tp}{}",
                if what == "vocab_size" {
                    " (the vocabulary is not padded: choose a size that is a multiple of tp)"
                } else {
                    ""
                }
            );
        }
    }
    if let Some(t) = sequence {
        if !t.is_multiple_of(tp) {
            meshgrad_tensor::bail!(
                "sequence parallelism: the sequence length {t} is not divisible by tp = {tp}"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::largest_common_power_of_two;

    #[test]
    fn largest_common_power_of_two_of_model_sizes() {
        assert_eq!(largest_common_power_of_two(&[12, 256, 64]), 4);
        assert_eq!(largest_common_power_of_two(&[4, 261, 128]), 1);
        assert_eq!(largest_common_power_of_two(&[4, 264, 128]), 4);
        assert_eq!(largest_common_power_of_two(&[]), 1);
    }
}
