//! [`TreeReduce`]: a communicator whose float sums follow one fixed binary tree over the group's
//! ranks on every backend, the reduction order reference mode builds on.
//!
//! Backends combine contributions in their own order (the in-process backend in rank order, MPI
//! and NCCL by algorithm and message size). `TreeReduce` wraps any communicator and computes
//! float `Sum` and `Avg` reductions itself: it all-gathers the contributions, and every rank adds
//! them in the *aligned binary tree* over group ranks, the tree whose nodes are the blocks
//! `[k·2ʲ, (k+1)·2ʲ)` (cut at the group size; [`meshgrad_tensor::tree_sum`]): `(x0 + x1) + (x2 + x3)` for four ranks, and
//! `((x0 + x1) + (x2 + x3)) + (x4 + x5)` for six. So every rank gets the same bits on every
//! backend, and a group of `2ʲ` ranks each holding the sum of an aligned block of `n` leaves
//! reproduces the tree over all `2ʲ·n` leaves. [`ReduceOp::Avg`] divides the tree's sum by the
//! group size (or not at all: [`TreeReduce::for_reference`]). bf16 and f16 are added in f32 and
//! rounded once at the end. Integer sums (associative, so order-free) and `Max` go to the
//! wrapped communicator unchanged, as do every other operation and sub-groups, which are wrapped
//! in turn.
//!
//! The cost is memory and bandwidth: each rank receives every contribution (the group size times
//! the tensor), instead of a ring's two passes.

use std::sync::Arc;

use meshgrad_tensor::tree_sum::tree_sum;
use meshgrad_tensor::{DType, Result, Tensor};

use super::{Communicator, ReduceOp, Work};

/// A communicator whose float sums follow the aligned binary tree over group ranks (see the
/// [module docs](self)).
pub struct TreeReduce {
    inner: Arc<dyn Communicator>,
    /// Whether `Avg` divides the sum by the group size (off: reference mode's contributions are
    /// already shares of a global mean).
    avg_divides: bool,
}

impl TreeReduce {
    /// Wraps `inner`: its sub-groups are wrapped too.
    pub fn wrap(inner: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
        Arc::new(TreeReduce {
            inner,
            avg_divides: true,
        })
    }

    /// Wraps `inner` for reference mode, where every rank's contribution to an average is
    /// already its share of the global mean (each row group's loss is scaled by one over the
    /// number of row groups before its backward, on every layout): `Avg` is the tree's sum,
    /// not divided by the group size, so no layout rescales a gradient (a rescaling by a power
    /// of two is exact only above the subnormal range). Sub-groups are wrapped alike.
    pub fn for_reference(inner: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
        Arc::new(TreeReduce {
            inner,
            avg_divides: false,
        })
    }

    /// Whether `op` on `dtype` is reduced here (float sums), not by the wrapped communicator.
    fn is_tree(dtype: DType, op: ReduceOp) -> bool {
        dtype.is_float() && matches!(op, ReduceOp::Sum | ReduceOp::Avg)
    }

    /// The tree-ordered reduction of `tensor` over the group (a [`Work`] whose result every
    /// rank computes from the gathered contributions).
    fn tree_all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let shape = tensor.shape().clone();
        let dtype = tensor.dtype();
        let n = self.inner.world_size();
        let divide = op == ReduceOp::Avg && self.avg_divides;
        // Gather as a flat vector so 0-d tensors and any leading size behave alike.
        let flat = tensor.reshape(tensor.elem_count())?;
        let len = flat.elem_count();
        Ok(self.inner.all_gather(&flat)?.map(move |all| {
            let acc = if dtype == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let parts: Vec<Tensor> = (0..n)
                .map(|r| all.narrow(0, r * len, len)?.to_dtype(acc))
                .collect::<Result<_>>()?;
            let mut sum = tree_sum(&parts)?;
            if divide {
                let d = Tensor::full(n as f64, (), acc, sum.device())?;
                sum = sum.div(&d)?;
            }
            sum.to_dtype(dtype)?.reshape(shape)
        }))
    }
}

impl Communicator for TreeReduce {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn ranks(&self) -> &[usize] {
        self.inner.ranks()
    }
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        if !Self::is_tree(tensor.dtype(), op) || self.world_size() == 1 {
            return self.inner.all_reduce(tensor, op);
        }
        self.tree_all_reduce(tensor, op)
    }
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        if !Self::is_tree(tensor.dtype(), op) || self.world_size() == 1 {
            return self.inner.reduce_scatter(tensor, op);
        }
        let (n, rank) = (self.world_size(), self.rank());
        let rows = tensor.dims().first().copied().unwrap_or(0);
        if tensor.rank() == 0 || rows % n != 0 {
            meshgrad_tensor::bail!(
                "reduce_scatter on group {}: the leading dimension of {} is not divisible by the \
                 group size {n}",
                self.describe(),
                tensor.shape()
            );
        }
        let block = rows / n;
        Ok(self
            .tree_all_reduce(tensor, op)?
            .map(move |full| full.narrow(0, rank * block, block)?.contiguous()))
    }
    fn all_gather(&self, tensor: &Tensor) -> Result<Work> {
        self.inner.all_gather(tensor)
    }
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        self.inner.broadcast(tensor, root)
    }
    fn all_to_all(
        &self,
        tensor: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Work> {
        self.inner.all_to_all(tensor, send_splits, recv_splits)
    }
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        self.inner.send(tensor, dst)
    }
    fn recv(&self, src: usize) -> Result<Work> {
        self.inner.recv(src)
    }
    fn barrier(&self) -> Result<Work<()>> {
        self.inner.barrier()
    }
    fn batch_p2p(&self, ops: Vec<super::P2pOp>) -> Result<Vec<super::P2pWork>> {
        self.inner.batch_p2p(ops)
    }
    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(TreeReduce {
            inner: self.inner.new_group(ranks, tag)?,
            avg_divides: self.avg_divides,
        }))
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{run_ranks, RunOptions};
    use meshgrad_tensor::Device;

    fn leaf(r: usize, i: usize) -> f32 {
        // Values whose sums round differently in different orders.
        let big = if r.is_multiple_of(2) { 3e-8 } else { 1e7 };
        1.0 + (r * 7 + i) as f32 * 1.37e-3 + big
    }

    /// The aligned tree in f32, written independently of `tree_sum`.
    fn tree(v: &[f32]) -> f32 {
        if v.len() == 1 {
            return v[0];
        }
        let mut l = 1;
        while l * 2 < v.len() {
            l *= 2;
        }
        tree(&v[..l]) + tree(&v[l..])
    }

    #[test]
    fn sums_follow_the_tree_on_every_rank() {
        for n in [2usize, 3, 4, 6, 8] {
            let results = run_ranks(n, &RunOptions::default(), move |ctx| {
                let comm = TreeReduce::wrap(ctx.comm.clone());
                let r = comm.rank();
                let x = Tensor::from_vec((0..4).map(|i| leaf(r, i)).collect(), 4, Device::Cpu)?;
                let sum = comm
                    .all_reduce(&x, ReduceOp::Sum)?
                    .wait()?
                    .to_vec::<f32>()?;
                let avg = comm
                    .all_reduce(&x, ReduceOp::Avg)?
                    .wait()?
                    .to_vec::<f32>()?;
                let x8 =
                    Tensor::from_vec((0..4 * n).map(|i| leaf(r, i)).collect(), 4 * n, Device::Cpu)?;
                let block = comm
                    .reduce_scatter(&x8, ReduceOp::Sum)?
                    .wait()?
                    .to_vec::<f32>()?;
                // Reference mode's Avg is the sum itself.
                let presummed = TreeReduce::for_reference(ctx.comm.clone());
                let ref_avg = presummed
                    .all_reduce(&x, ReduceOp::Avg)?
                    .wait()?
                    .to_vec::<f32>()?;
                assert_eq!(ref_avg, sum);
                Ok((sum, avg, block))
            })
            .unwrap();
            for i in 0..4 {
                let v: Vec<f32> = (0..n).map(|r| leaf(r, i)).collect();
                let want = tree(&v);
                for (sum, avg, _) in &results {
                    assert_eq!(sum[i].to_bits(), want.to_bits(), "n={n} i={i}");
                    assert_eq!(avg[i].to_bits(), (want / n as f32).to_bits(), "n={n} i={i}");
                }
            }
            for (r, (_, _, block)) in results.iter().enumerate() {
                for (j, got) in block.iter().enumerate() {
                    let v: Vec<f32> = (0..n).map(|q| leaf(q, r * 4 + j)).collect();
                    assert_eq!(got.to_bits(), tree(&v).to_bits(), "n={n} r={r} j={j}");
                }
            }
        }
    }

    #[test]
    fn integer_sums_and_max_pass_through() {
        let out = run_ranks(3, &RunOptions::default(), |ctx| {
            let comm = TreeReduce::wrap(ctx.comm.clone());
            let x = Tensor::from_vec(vec![comm.rank() as i64 + 1], 1, Device::Cpu)?;
            let s = comm
                .all_reduce(&x, ReduceOp::Sum)?
                .wait()?
                .to_vec::<i64>()?;
            let g = comm.new_group(&[0, 1, 2], "sub")?;
            let m = g
                .all_reduce(&x.to_dtype(DType::F32)?, ReduceOp::Max)?
                .wait()?
                .to_vec::<f32>()?;
            Ok((s[0], m[0]))
        })
        .unwrap();
        assert!(out.iter().all(|&(s, m)| s == 6 && m == 3.0));
    }
}
