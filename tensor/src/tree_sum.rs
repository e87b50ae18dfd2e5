//! The aligned binary tree: the one fixed order in which reference mode adds partial sums (of
//! row groups, of tensor-parallel chunks, of ranks). Its nodes are the blocks `[k·2ʲ, (k+1)·2ʲ)`
//! of the leaves' indices, cut at the leaf count: `(x0 + x1) + (x2 + x3)` for four leaves,
//! `((x0 + x1) + (x2 + x3)) + (x4 + x5)` for six. A block of `2ʲ` leaves aligned to `2ʲ` is a
//! node, so whoever adds an aligned block computes a subtree of the whole sum.
//!
//! ```
//! use meshgrad_tensor::tree_sum::{tree_split, tree_sum_f64};
//! assert_eq!(tree_split(6), 4);
//! assert_eq!(tree_sum_f64(&[1e16, 1.0, -1e16, 1.0]), (1e16 + 1.0) + (-1e16 + 1.0));
//! ```

use crate::{Result, Tensor};

/// Where the aligned binary tree over `n >= 2` leaves splits: the largest power of two below `n`
/// (the left subtree's leaves).
pub fn tree_split(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// The sum of `parts` (at least one, all of one shape and dtype) over the aligned binary tree.
pub fn tree_sum(parts: &[Tensor]) -> Result<Tensor> {
    match parts.len() {
        0 => crate::bail!("tree_sum: nothing to add"),
        1 => Ok(parts[0].clone()),
        n => {
            let left = tree_split(n);
            tree_sum(&parts[..left])?.add(&tree_sum(&parts[left..])?)
        }
    }
}

/// [`tree_sum`] for f64 values (0 for none).
pub fn tree_sum_f64(parts: &[f64]) -> f64 {
    match parts.len() {
        0 => 0.0,
        1 => parts[0],
        n => {
            let left = tree_split(n);
            tree_sum_f64(&parts[..left]) + tree_sum_f64(&parts[left..])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_points() {
        let want = [(2, 1), (3, 2), (4, 2), (5, 4), (8, 4), (9, 8)];
        for (n, s) in want {
            assert_eq!(tree_split(n), s, "n={n}");
        }
    }

    #[test]
    fn tensors_and_f64_follow_the_same_tree() {
        let v = [1e16, 3.0, -1e16, 5.0, 7.0];
        let parts: Vec<Tensor> = v
            .iter()
            .map(|&x| Tensor::from_vec(vec![x], 1, crate::Device::Cpu).unwrap())
            .collect();
        let want = ((1e16 + 3.0) + (-1e16 + 5.0)) + 7.0;
        assert_eq!(tree_sum(&parts).unwrap().to_vec::<f64>().unwrap()[0], want);
        assert_eq!(tree_sum_f64(&v), want);
        assert!(tree_sum(&[]).is_err());
    }
}
