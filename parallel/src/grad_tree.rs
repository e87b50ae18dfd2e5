//! Reference mode's gradient tree: per-row-group gradients added over the aligned binary tree of
//! their indices, whatever order they arrive in ([`GradTree`]), so that one device and every
//! layout add the same numbers in the same order (the data-parallel group then adds the ranks'
//! subtrees in the same tree: [`TreeReduce`](crate::comm::TreeReduce)). `meshgrad train
//! --reference` builds on it.
//!
//! A layer may compute, in one pass, a parameter's gradient contributions from the row groups of
//! several ranks (an expert under expert parallelism meets the token copies of every rank of its
//! group). It sets them aside per source rank ([`meshgrad_autograd::source_grads`]), and
//! [`RowGroupTrees`] adds them over the tree of the row groups of those ranks, each contribution
//! at its own row group's leaf: the leaves one device computes.

use std::ops::Range;

use meshgrad_autograd::{source_grads, Var};
use meshgrad_tensor::tree_sum::{tree_split, tree_sum_f64};
use meshgrad_tensor::{bail, Result, Tensor};

/// The gradients of a model's parameters, taken out of their `.grad` (which is left empty).
pub fn take_grads(params: &[Var]) -> Vec<Option<Tensor>> {
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
pub struct GradTree {
    n: usize,
    /// Complete subtrees not yet added to their sibling: ((first leaf, leaves), gradients).
    pending: Vec<(Node, Vec<Option<Tensor>>)>,
}

/// A subtree: (first leaf, number of leaves).
type Node = (usize, usize);

impl GradTree {
    /// A tree over leaves `0..n`.
    pub fn new(n: usize) -> Self {
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
    pub fn push(&mut self, i: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        if i >= self.n
            || self
                .pending
                .iter()
                .any(|((s, l), _)| (*s..s + l).contains(&i))
        {
            bail!(
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
    pub fn finish(mut self) -> Result<Vec<Option<Tensor>>> {
        if self.pending.len() != 1 || self.pending[0].0 != (0, self.n) {
            bail!(
                "reference mode: internal error: the row-group tree over {} leaves is incomplete",
                self.n
            );
        }
        Ok(self.pending.pop().expect("one node").1)
    }
}

/// One step's gradient trees for one model chunk's parameters in reference mode (see the [module
/// docs](self)). Over `m` microbatches (this rank's row groups), whose gradients in `.grad` are
/// leaves `0..m` of the rank's tree; and over the row groups of `sources` consecutive
/// data-parallel ranks (this one among them) for gradients set aside per source rank while
/// [`source_grads::collect`] runs: source `s`'s contribution in microbatch `mb` is leaf
/// `s * m + mb` of a tree over `sources * m` leaves, the subtree of those ranks' row groups
/// (which the ranks holding the same parameter then add in the data-parallel tree).
pub struct RowGroupTrees {
    params: Vec<Var>,
    m: usize,
    sources: usize,
    own: GradTree,
    spread: GradTree,
}

impl RowGroupTrees {
    /// Trees for `params` over `m` microbatches, with `sources` source ranks (1: none but this
    /// one).
    pub fn new(params: Vec<Var>, m: usize, sources: usize) -> Self {
        let sources = sources.max(1);
        RowGroupTrees {
            params,
            m,
            sources,
            own: GradTree::new(m),
            spread: GradTree::new(sources * m),
        }
    }

    /// Microbatch `mb`'s gradients once its backward is complete: `own` (per parameter, taken
    /// out of `.grad`), and what was set aside for these parameters since the last call.
    pub fn push(&mut self, mb: usize, own: Vec<Option<Tensor>>) -> Result<()> {
        let ids: Vec<_> = self.params.iter().map(Var::id).collect();
        let mut by_source: Vec<Vec<Option<Tensor>>> = vec![vec![None; ids.len()]; self.sources];
        for g in source_grads::take(&ids) {
            let pos = ids
                .iter()
                .position(|&i| i == g.param)
                .expect("taken for these ids");
            if g.source >= self.sources {
                bail!(
                    "reference mode: internal error: a gradient set aside for source {} of {}",
                    g.source,
                    self.sources
                );
            }
            by_source[g.source][pos] = Some(g.grad);
        }
        self.own.push(mb, own)?;
        for (s, grads) in by_source.into_iter().enumerate() {
            self.spread.push(s * self.m + mb, grads)?;
        }
        Ok(())
    }

    /// Every microbatch pushed: leaves the tree sums in the parameters' `.grad`.
    pub fn finish(self) -> Result<()> {
        let own = self.own.finish()?;
        let spread = self.spread.finish()?;
        for ((p, a), b) in self.params.iter().zip(own).zip(spread) {
            if a.is_some() && b.is_some() {
                bail!(
                    "reference mode: internal error: a parameter has both its own and set-aside \
                     gradients"
                );
            }
            p.set_grad(a.or(b));
        }
        Ok(())
    }
}

/// One step's forward and backward passes in reference mode on one device (`meshgrad bench
/// --row-group`), on `groups` (row ranges): `loss_of(rows)` builds a row group's loss, which is
/// multiplied by `factor` (`1 / G` for a mean over `G` row groups) and back-propagated; the row
/// groups' gradients are added over their tree into the parameters' `.grad`. Returns the tree
/// sum of the row groups' (unscaled) losses.
pub fn reference_step(
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
