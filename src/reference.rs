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
//!   ([`GradTree`]: whatever order its passes finish in), and the data-parallel group adds the
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
//!
//! What is not covered yet is refused in one line before the run ([`check_reference`]).

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;
use meshgrad_autograd::Var;
use meshgrad_parallel::comm::TreeReduce;
use meshgrad_parallel::{micro_rows, Communicator, ParallelLayout};
use meshgrad_tensor::tree_sum::{tree_split, tree_sum_f64};
use meshgrad_tensor::Tensor;

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
    Ok(())
}

/// This rank's row groups: `rows` cut into groups of `row_group` rows (`rows` holds a whole
/// number of them, which [`check_reference`] ensured).
pub(crate) fn row_groups(rows: Range<u64>, row_group: usize) -> Result<Vec<Range<u64>>> {
    let n = (rows.end - rows.start) as usize / row_group;
    Ok(micro_rows(rows, n)?)
}

/// The gradients of a model's parameters, taken out of their `.grad` (which is left empty).
pub(crate) fn take_grads(params: &[Var]) -> Vec<Option<Tensor>> {
    params
        .iter()
        .map(|p| {
            let g = p.grad();
            p.set_grad(None);
            g
        })
        .collect()
}

/// `a + b` per parameter (a missing gradient counts as none at all).
fn add_grads(a: Vec<Option<Tensor>>, b: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
    a.into_iter()
        .zip(b)
        .map(|(x, y)| {
            Ok(match (x, y) {
                (Some(x), Some(y)) => Some(x.add(&y)?),
                (x, None) => x,
                (None, y) => y,
            })
        })
        .collect()
}

/// Adds per-row-group gradients over the aligned binary tree of their indices (the tree of
/// [`tree_sum`](meshgrad_tensor::tree_sum::tree_sum)), in whatever order they arrive: two
/// siblings are added as soon as both are there. After every leaf of `0..n` arrived,
/// [`GradTree::finish`] returns the tree's sum, the same bits as `tree_sum` over the leaves in
/// index order. Memory: the pending subtrees, at most one per level when leaves arrive in order.
pub(crate) struct GradTree {
    n: usize,
    /// Complete subtrees not yet added to their sibling: ((first leaf, leaves), gradients).
    pending: Vec<(Node, Vec<Option<Tensor>>)>,
}

/// A subtree: (first leaf, number of leaves).
type Node = (usize, usize);

impl GradTree {
    /// A tree over leaves `0..n`.
    pub(crate) fn new(n: usize) -> Self {
        GradTree {
            n,
            pending: Vec::new(),
        }
    }

    /// The parent of `node`, its sibling, and whether `node` is the left child; `None` for the
    /// root. Walks down from the root.
    fn parent(&self, node: Node) -> Option<(Node, Node, bool)> {
        let mut cur = (0, self.n);
        while cur != node && cur.1 >= 2 {
            let l = tree_split(cur.1);
            let (a, b) = ((cur.0, l), (cur.0 + l, cur.1 - l));
            if a == node {
                return Some((cur, b, true));
            }
            if b == node {
                return Some((cur, a, false));
            }
            cur = if node.0 < b.0 { a } else { b };
        }
        None
    }

    /// Adds leaf `i`'s gradients.
    pub(crate) fn push(&mut self, i: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        if i >= self.n
            || self
                .pending
                .iter()
                .any(|((s, l), _)| (*s..s + l).contains(&i))
        {
            anyhow::bail!(
                "reference mode: internal error: row group {i} of {} given twice or out of range",
                self.n
            );
        }
        let (mut node, mut grads) = ((i, 1), grads);
        while let Some((parent, sibling, is_left)) = self.parent(node) {
            let Some(pos) = self.pending.iter().position(|(n, _)| *n == sibling) else {
                break;
            };
            let (_, other) = self.pending.swap_remove(pos);
            grads = if is_left {
                add_grads(grads, other)?
            } else {
                add_grads(other, grads)?
            };
            node = parent;
        }
        self.pending.push((node, grads));
        Ok(())
    }

    /// The sum over every leaf (all must have arrived).
    pub(crate) fn finish(mut self) -> Result<Vec<Option<Tensor>>> {
        if self.pending.len() != 1 || self.pending[0].0 != (0, self.n) {
            anyhow::bail!(
                "reference mode: internal error: the row-group tree over {} leaves is incomplete",
                self.n
            );
        }
        Ok(self.pending.pop().expect("one node").1)
    }
}

/// One step's forward and backward passes in reference mode on one device (`meshgrad bench
/// --row-group`), on `groups` (row ranges): `loss_of(rows)` builds a row group's loss, which is
/// multiplied by `factor` (`1 / G` for a mean over `G` row groups) and back-propagated; the row
/// groups' gradients are added over their tree into the parameters' `.grad`. Returns the tree
/// sum of the row groups' (unscaled) losses.
pub(crate) fn reference_step(
    params: &[Var],
    groups: &[Range<u64>],
    factor: f64,
    mut loss_of: impl FnMut(&Range<u64>) -> Result<Var>,
) -> Result<f64> {
    let mut tree = GradTree::new(groups.len());
    let mut losses = Vec::with_capacity(groups.len());
    for (i, rows) in groups.iter().enumerate() {
        let loss = loss_of(rows)?;
        losses.push(loss.tensor().item()?);
        let loss = if factor != 1.0 {
            loss.mul_scalar(factor)?
        } else {
            loss
        };
        loss.backward()?;
        tree.push(i, take_grads(params))?;
    }
    for (p, g) in params.iter().zip(tree.finish()?) {
        p.set_grad(g);
    }
    Ok(tree_sum_f64(&losses))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_tensor::tree_sum::tree_sum;
    use meshgrad_tensor::Device;

    fn leaf(i: usize) -> Vec<Option<Tensor>> {
        let v: Vec<f32> = (0..3)
            .map(|k| {
                1.0 + (i * 3 + k) as f32 * 1.37e-3 + if i.is_multiple_of(3) { 1e6 } else { 0.0 }
            })
            .collect();
        vec![Some(Tensor::from_vec(v, 3, Device::Cpu).unwrap()), None]
    }

    #[test]
    fn any_arrival_order_gives_the_tree_sum() {
        for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 16] {
            let want = tree_sum(
                &(0..n)
                    .map(|i| leaf(i)[0].clone().unwrap())
                    .collect::<Vec<_>>(),
            )
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
            let orders: Vec<Vec<usize>> = vec![
                (0..n).collect(),
                (0..n).rev().collect(),
                (0..n).map(|i| (i * 5 + 3) % n).collect::<Vec<_>>(),
            ];
            for order in orders {
                let mut seen = vec![false; n];
                if order.iter().any(|&i| std::mem::replace(&mut seen[i], true)) {
                    continue; // not a permutation for this n
                }
                let mut t = GradTree::new(n);
                for &i in &order {
                    t.push(i, leaf(i)).unwrap();
                }
                let got = t.finish().unwrap();
                assert!(got[1].is_none());
                let got = got[0].as_ref().unwrap().to_vec::<f32>().unwrap();
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "n={n} order={order:?}: {got:?} vs {want:?}");
            }
        }
    }

    #[test]
    fn an_incomplete_tree_is_an_error() {
        let mut t = GradTree::new(4);
        t.push(0, leaf(0)).unwrap();
        t.push(2, leaf(2)).unwrap();
        assert!(t.finish().is_err());
        assert!(GradTree::new(2).push(2, leaf(0)).is_err());
    }
}
