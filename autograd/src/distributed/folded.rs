//! Reference mode's *folded* position order: how a sum over the positions of a sequence is
//! added in one fixed order on one device and on every context-parallel layout
//! ([`FoldedPositions`]).
//!
//! The sequence is cut into `2K` equal fine chunks; position leaf `j` (of `K`) is fine chunks
//! `j` and `2K - 1 - j`. A context-parallel rank `i` of `C` (`C` a power of two dividing `K`)
//! holds chunks `i` and `2C - 1 - i` of `2C` ([`ChunkOrder`](super::ChunkOrder)), which are
//! exactly leaves `[i K/C, (i + 1) K/C)`: an aligned block of the leaves, so a subtree of the
//! aligned binary tree over them. One device is the group of one rank holding every leaf.
//!
//! * **Per-position work** ([`FoldedPositions::leafwise`]): a layer runs once per leaf, on the
//!   leaf's positions `[B, 2 T/(2K), ...]` alone, so every kernel call has the same shapes on
//!   every layout; its parameters' gradients are the tree over the leaves of each leaf's
//!   gradient.
//! * **Sums over the group** ([`FoldedPositions::reduce`]): a rank adds the subtree of its
//!   leaves and the group's tree all-reduce (reference mode's `TreeReduce`) adds the ranks'
//!   subtrees in the tree over all `K` leaves: one device's sum. The sum lands whole on the
//!   group's first rank and is zero on the others, so the data-parallel reduction over
//!   `dp x cp` ranks that follows adds each row group's sum once (`x + 0` is exact).
//! * **Attention** over the whole sequence in the same order:
//!   [`folded_attention`](super::folded_attention::folded_attention).
//!
//! A per-position table read at the global positions (GPT's learned positions) needs no leaves:
//! each position's row gathers its gradient on the one rank holding the position, from the
//! same rows in the same order as one device, and the other ranks hold zeros there.

use std::ops::Range;
use std::sync::Arc;

use meshgrad_tensor::tree_sum::tree_sum;
use meshgrad_tensor::{Result, Tensor};

use super::Collectives;
use crate::{engine, grad_mode, Var};

/// The folded position order of `leaves` leaves over a context-parallel `group` (a group of one
/// rank on one device); see the [module docs](self).
#[derive(Clone)]
pub struct FoldedPositions {
    leaves: usize,
    group: Arc<dyn Collectives>,
}

impl std::fmt::Debug for FoldedPositions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FoldedPositions({} leaves, rank {} of {})",
            self.leaves,
            self.group.rank(),
            self.group.describe()
        )
    }
}

impl FoldedPositions {
    /// `leaves` position leaves over `group`, or a one-line error unless `leaves` is a power of
    /// two that the group size divides.
    pub fn new(leaves: usize, group: Arc<dyn Collectives>) -> Result<Self> {
        let c = group.size();
        if !leaves.is_power_of_two() || !leaves.is_multiple_of(c) {
            meshgrad_tensor::bail!(
                "folded positions: {leaves} leaves must be a power of two divisible by the \
                 context-parallel degree {c}"
            );
        }
        Ok(FoldedPositions { leaves, group })
    }

    /// The number of leaves over the whole sequence (`K`).
    pub fn leaves(&self) -> usize {
        self.leaves
    }

    /// The context-parallel group.
    pub fn group(&self) -> &Arc<dyn Collectives> {
        &self.group
    }

    /// This rank's number of leaves (`K / C`).
    pub fn local_leaves(&self) -> usize {
        self.leaves / self.group.size()
    }

    /// The fine chunk length of a local sequence of `local` positions (`2 K/C` fine chunks).
    pub fn chunk_len(&self, local: usize) -> Result<usize> {
        let n = 2 * self.local_leaves();
        if local == 0 || !local.is_multiple_of(n) {
            meshgrad_tensor::bail!(
                "reference mode: this rank's {local} positions do not split into {n} fine chunks \
                 ({} position leaves of two chunks over {} context-parallel rank(s))",
                self.leaves,
                self.group.size()
            );
        }
        Ok(local / n)
    }

    /// Whether a local sequence of `local` positions splits into this rank's fine chunks.
    pub fn splits(&self, local: usize) -> bool {
        local > 0 && local.is_multiple_of(2 * self.local_leaves())
    }

    /// The two local position ranges of this rank's leaf `a` (of [`Self::local_leaves`]) in a
    /// local sequence of `local` positions: its early chunk at `a`, its late one mirrored from
    /// the end of the rank's late half.
    pub fn leaf_ranges(&self, local: usize, a: usize) -> Result<[Range<usize>; 2]> {
        let f = self.chunk_len(local)?;
        let m = self.local_leaves();
        let late = local / 2 + (m - 1 - a) * f;
        Ok([a * f..(a + 1) * f, late..late + f])
    }

    /// The global fine chunk (of `2K`) at local fine chunk `c` (of `2 K/C`) of this rank.
    pub fn global_chunk(&self, c: usize) -> usize {
        self.chunk_at(self.group.rank(), c)
    }

    /// The global fine chunk (of `2K`) at local fine chunk `c` (of `2 K/C`) of rank `r`.
    pub fn chunk_at(&self, r: usize, c: usize) -> usize {
        let m = self.local_leaves();
        if c < m {
            r * m + c
        } else {
            (2 * self.group.size() - 1 - r) * m + (c - m)
        }
    }

    /// Where global fine chunk `c` (of `2K`) lies in the group's all-gathered sequence: the
    /// owning rank and the local fine chunk there.
    pub fn owner_of(&self, c: usize) -> (usize, usize) {
        let (m, size) = (self.local_leaves(), self.group.size());
        let coarse = c / m;
        if coarse < size {
            (coarse, c - coarse * m)
        } else {
            (2 * size - 1 - coarse, m + c - coarse * m)
        }
    }

    /// Leaf `a`'s positions of `t` along `dim` (its two chunks side by side, a contiguous copy).
    pub fn leaf(&self, t: &Tensor, dim: usize, a: usize) -> Result<Tensor> {
        let [r1, r2] = self.leaf_ranges(t.dims()[dim], a)?;
        let d = dim as isize;
        let (p1, p2) = (
            t.narrow(d, r1.start, r1.len())?,
            t.narrow(d, r2.start, r2.len())?,
        );
        Tensor::cat(&[&p1, &p2], d)?.contiguous()
    }

    /// The local sequence from every local leaf's part `[.., 2f, ..]` along `dim` (the inverse of
    /// [`Self::leaf`]): the leaves' early chunks in order, then their late chunks in reverse.
    pub fn assemble(&self, parts: &[Tensor], dim: usize) -> Result<Tensor> {
        let d = dim as isize;
        let f = parts.first().map_or(0, |p| p.dims()[dim] / 2);
        let mut pieces = Vec::with_capacity(2 * parts.len());
        for p in parts {
            pieces.push(p.narrow(d, 0, f)?);
        }
        for p in parts.iter().rev() {
            pieces.push(p.narrow(d, f, f)?);
        }
        let refs: Vec<&Tensor> = pieces.iter().collect();
        Tensor::cat(&refs, d)?.contiguous()
    }

    /// The tree over all `K` leaves of this rank's per-leaf `partials` (in local leaf order):
    /// the subtree of its leaves, added over the group in the group's tree, whole on the group's
    /// first rank and zero on the others (see the [module docs](self)).
    pub fn reduce(&self, partials: &[Tensor]) -> Result<Tensor> {
        let sum = self.sum_over_group(partials)?;
        if self.group.rank() == 0 {
            Ok(sum)
        } else {
            sum.zeros_like()
        }
    }

    /// As [`Self::reduce`], with the sum on every rank of the group.
    pub fn sum_over_group(&self, partials: &[Tensor]) -> Result<Tensor> {
        let local = tree_sum(partials)?;
        if self.group.size() == 1 {
            return Ok(local);
        }
        self.group.all_reduce_sum(&local.contiguous()?)
    }

    /// `f` applied to each of this rank's leaves of `x` (positions along `dim`) on its own, the
    /// results put back in local order along `dim`. `f` may read the parameters `params` (and
    /// no other tensor that needs a gradient); their gradients are the tree over the leaves of
    /// each leaf's ([`Self::reduce`]), `x`'s gradient each leaf's in place. Each leaf keeps its
    /// own graph until the backward.
    pub fn leafwise(
        &self,
        x: &Var,
        dim: usize,
        params: &[&Var],
        f: impl Fn(&Var) -> Result<Var>,
    ) -> Result<Var> {
        let xt = x.tensor().clone();
        let m = self.local_leaves();
        let x_grad = x.requires_grad() && grad_mode::is_enabled();
        let mut inputs = Vec::with_capacity(m);
        let mut outputs = Vec::with_capacity(m);
        for a in 0..m {
            let part = self.leaf(&xt, dim, a)?;
            let input = if x_grad {
                Var::leaf(part)
            } else {
                Var::constant(part)
            };
            outputs.push(f(&input)?);
            inputs.push(input);
        }
        let parts: Vec<Tensor> = outputs.iter().map(|o| o.tensor().clone()).collect();
        let out = self.assemble(&parts, dim)?;
        let mut all: Vec<&Var> = vec![x];
        all.extend(params.iter().copied());
        let params: Vec<Var> = params.iter().map(|&p| p.clone()).collect();
        let folded = self.clone();
        Ok(Var::from_op(
            "folded_leafwise",
            out,
            &all,
            Box::new(move |g, _| {
                let mut dxs = Vec::with_capacity(m);
                let mut per_param: Vec<Vec<Tensor>> = vec![Vec::new(); params.len()];
                for (a, (input, output)) in inputs.iter().zip(&outputs).enumerate() {
                    if !output.requires_grad() {
                        continue;
                    }
                    let mut wrt = vec![input.clone()];
                    wrt.extend(params.iter().cloned());
                    let ga = folded.leaf(g, dim, a)?;
                    let grads = engine::grad(&[(output.clone(), ga)], &wrt)?;
                    let mut grads = grads.into_iter();
                    let dx = grads.next().flatten();
                    dxs.push(match dx {
                        Some(d) => d,
                        None => input.tensor().zeros_like()?,
                    });
                    for (k, (d, p)) in grads.zip(&params).enumerate() {
                        per_param[k].push(match d {
                            Some(d) => d,
                            None => p.tensor().zeros_like()?,
                        });
                    }
                }
                let dx = if x_grad && dxs.len() == m {
                    Some(folded.assemble(&dxs, dim)?)
                } else {
                    None
                };
                let mut grads = vec![dx];
                for (parts, p) in per_param.iter().zip(&params) {
                    grads.push(if parts.len() == m && p.requires_grad() {
                        Some(folded.reduce(parts)?)
                    } else {
                        None
                    });
                }
                Ok(grads)
            }),
        ))
    }
}
