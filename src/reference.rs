//! Reference mode (`--reference`, `train.reference`): training whose every loss, gradient norm
//! and weight is the same bit for bit under every supported layout, for the same seed, global
//! batch and row group.
//!
//! Fast mode sums in orders the layout decides: a rank's micro-batches accumulate in `.grad` one
//! after the other, collectives add ranks in their own order, a ZeRO shard's norm covers other
//! elements than a whole parameter's. Reference mode fixes every such sum:
//!
//! * **Row groups.** The global batch is cut into `G = batch_size / row_group` row groups. Each
//!   row group's loss and gradient come from its own forward and backward pass, the same
//!   computation on one device as on any rank (kernels whose summation order depends only on
//!   the shapes, random numbers keyed by global rows).
//! * **One tree.** Row-group gradients and losses are added over the aligned binary tree of the
//!   `G` row groups (`((g0 + g1) + (g2 + g3)) + ...`). A rank computes the subtree of its rows
//!   ([`GradTree`](meshgrad_parallel::grad_tree::GradTree): whatever order its passes finish in), and the data-parallel group adds the
//!   ranks' subtrees in the same tree ([`TreeReduce`]), which needs each rank's rows to be an
//!   aligned subtree: `G / dp` a power of two.
//! * **Scaling.** Each row group's loss is multiplied by `1 / G` before its backward, on every
//!   layout, so the gradient sum *is* the global mean: the tree reductions add without dividing
//!   by the group size ([`TreeReduce::for_reference`]).
//! * **Norms.** The gradient norm is an order-free exact sum of squares
//!   ([`meshgrad_tensor::exact_sum::ExactSum`]), so it does not matter how ZeRO cuts parameters
//!   into shards.
//!
//! * **Pipelines.** A pipeline's microbatches are the row groups; each stage adds its
//!   per-row-group gradients over the same tree, the tied table's two copies per row group first
//!   (see [`crate::rank_train`]).
//! * **Tensor parallelism.** Every sum a tensor-parallel group splits (row-parallel products,
//!   column-parallel input gradients, the vocabulary-parallel softmax, parameter gradients over
//!   sequence-parallel positions) is a tree over a chunk count of the model's, on one device as
//!   on `tp` ranks ([`crate::reference_tp`], [`meshgrad_nn::tp::reference`]).
//! * **Expert parallelism.** An expert meets the token copies of its group's ranks in one pass;
//!   each source rank's copies run through it apart and their gradients are set aside per
//!   source ([`meshgrad_nn::moe::ExpertParallel`]), then added at their row groups' leaves of
//!   the tree over the group's row groups
//!   ([`RowGroupTrees`](meshgrad_parallel::grad_tree::RowGroupTrees)).
//!
//! * **Context parallelism** (with `train.reference_positions=folded`, on one device too):
//!   every sum over a sequence's positions is a tree over position leaves in which each cp
//!   rank's positions are a subtree; the layers run once per leaf and attention pairs fine
//!   chunks in one fixed order; a cp group's sums land whole on its first rank, so the
//!   data-parallel tree over `dp x cp` ranks adds each once
//!   ([`meshgrad_autograd::distributed::folded`]).
//!
//! What is not covered yet is refused in one line before the run ([`check_reference`]).

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;
use meshgrad_parallel::comm::TreeReduce;
use meshgrad_parallel::{micro_rows, Communicator, ParallelLayout};

use crate::config::TrainConfig;

/// The communicator reference mode builds a layout's mesh over: `world` with float sums in the
/// aligned tree and `Avg` adding without dividing; `world` itself in fast mode.
pub(crate) fn mesh_world(world: Arc<dyn Communicator>, reference: bool) -> Arc<dyn Communicator> {
    if reference {
        TreeReduce::for_reference(world)
    } else {
        world
    }
}

/// A one-line reason reference mode cannot run `cfg` on `layout` (`None`: one device), or `Ok`
/// when it can (or reference mode is off).
pub(crate) fn check_reference(cfg: &TrainConfig, layout: Option<&ParallelLayout>) -> Result<()> {
    let t = &cfg.train;
    if !t.reference {
        return Ok(());
    }
    if t.precision != "f32" {
        anyhow::bail!(
            "reference mode trains in f32 (train.precision is {}; bf16 and f16 are not covered)",
            t.precision
        );
    }
    if t.device != "cpu" {
        anyhow::bail!(
            "reference mode runs on the CPU (train.device is {}; CUDA kernels are not covered)",
            t.device
        );
    }
    let (b, r) = (t.batch_size, t.row_group);
    if !b.is_multiple_of(r) {
        anyhow::bail!("reference mode: train.row_group {r} does not divide train.batch_size {b}");
    }
    let groups = b / r;
    crate::reference_tp::check_tp(cfg, layout)?;
    check_positions(cfg, layout)?;
    let Some(layout) = layout else {
        return Ok(());
    };
    let dp = layout.data_parallel_degree();
    // Rank k owns row groups [k·s, (k+1)·s): a node of the aligned tree over all G row groups
    // exactly when s is a power of two (and then the tree over the ranks' blocks is the
    // aligned tree over the dp ranks, which TreeReduce adds in).
    if dp > 1 && !(groups.is_multiple_of(dp) && (groups / dp).is_power_of_two()) {
        anyhow::bail!(
            "reference mode: the data-parallel degree {dp} (layout {layout}) must split the \
             {groups} row groups (batch {b} / row group {r}) into a power of two per rank, so \
             that each rank owns a whole subtree of the row groups' sum"
        );
    }
    // An expert-parallel group's E consecutive ranks must own a subtree too: their experts' tree
    // adds the row groups of all of them (see meshgrad_parallel::grad_tree::RowGroupTrees).
    let ep = layout.ep();
    if ep > 1 && !(ep.is_power_of_two() || ep == dp) {
        anyhow::bail!(
            "reference mode: ep = {ep} (layout {layout}) must be a power of two or the \
             data-parallel degree {dp}, so that each expert-parallel group's row groups are a \
             subtree of the row groups' sum"
        );
    }
    Ok(())
}

/// Whether reference mode adds over positions in the folded order
/// (`train.reference_positions=folded`; see [`meshgrad_autograd::distributed::folded`]).
pub(crate) fn folded_positions(cfg: &TrainConfig) -> bool {
    cfg.train.reference && cfg.train.reference_positions == "folded"
}

/// A one-line reason reference mode cannot run its position order on `layout`: context
/// parallelism needs the folded order, which covers GPT, Llama and Mixtral on dp and cp
/// layouts, with
/// position leaves (the reference chunk count `K`) that split the sequence into `2K` chunks
/// and that the cp degree divides.
fn check_positions(cfg: &TrainConfig, layout: Option<&ParallelLayout>) -> Result<()> {
    let cp = layout.map_or(1, |l| l.cp());
    if !folded_positions(cfg) {
        if cp > 1 {
            anyhow::bail!(
                "reference mode under context parallelism (layout {}) adds over positions in the \
                 folded order: pass --set train.reference_positions=folded (to the one-device run \
                 you compare with too)",
                layout.expect("cp > 1 comes from a layout")
            );
        }
        return Ok(());
    }
    use crate::config::ModelKind;
    if !matches!(
        cfg.model.kind,
        ModelKind::Gpt | ModelKind::Llama | ModelKind::Mixtral
    ) {
        anyhow::bail!(
            "reference mode: train.reference_positions=folded covers GPT, Llama and Mixtral, \
             not {}",
            cfg.model.kind.as_str()
        );
    }
    let k = crate::reference_tp::chunk_count(cfg).unwrap_or(1);
    let t = cfg.model.block_size;
    if k < 2 || !t.is_multiple_of(2 * k) || !k.is_multiple_of(cp) {
        anyhow::bail!(
            "reference mode: train.reference_positions=folded needs the reference chunk count \
             K = {k} (train.reference_chunks {}) to be at least 2 and divisible by cp = {cp}, \
             and 2K to divide block_size {t} (K is the largest power of two dividing the \
             model's sizes; train.reference_chunks may lower it)",
            cfg.train.reference_chunks
        );
    }
    if let Some(l) = layout.filter(|l| l.tp() > 1 || l.pp() > 1 || l.ep() > 1 || l.zero().is_some())
    {
        anyhow::bail!(
            "reference mode: train.reference_positions=folded covers dp and cp layouts, not {l} \
             (tp, pp, ep and ZeRO/FSDP are not covered in the folded order yet)"
        );
    }
    Ok(())
}

/// This rank's row groups: `rows` cut into groups of `row_group` rows (`rows` holds a whole
/// number of them, which [`check_reference`] ensured).
pub(crate) fn row_groups(rows: Range<u64>, row_group: usize) -> Result<Vec<Range<u64>>> {
    let n = (rows.end - rows.start) as usize / row_group;
    Ok(micro_rows(rows, n)?)
}
