//! Which data each data-parallel rank reads.
//!
//! * Token datasets ([`meshgrad_nn::data::TokenDataset::batch`]) draw global batch row `b` of
//!   step `s` as a pure function of `(seed, s, b)`, so a rank only needs its rows:
//!   [`rank_rows`] (and [`micro_rows`] for gradient accumulation).
//! * Index datasets use [`DistributedSampler`]: a permutation keyed by `(seed, epoch)`, dealt to
//!   the ranks like PyTorch's `DistributedSampler`.

use std::ops::Range;

use meshgrad_nn::data::splitmix64;
use meshgrad_tensor::Result;

/// The rows `[rank * B / world, (rank + 1) * B / world)` of a global batch of `global_batch`
/// rows that `rank` of a data-parallel group of `world` ranks processes. An error, naming the
/// numbers, when the batch does not split evenly.
pub fn rank_rows(global_batch: usize, world: usize, rank: usize) -> Result<Range<u64>> {
    if world == 0 || rank >= world {
        meshgrad_tensor::bail!("rank_rows: rank {rank} is not a rank of a group of {world}");
    }
    if global_batch == 0 || !global_batch.is_multiple_of(world) {
        meshgrad_tensor::bail!(
            "the global batch of {global_batch} rows does not split evenly over {world} \
             data-parallel ranks"
        );
    }
    let per = (global_batch / world) as u64;
    Ok(rank as u64 * per..(rank as u64 + 1) * per)
}

/// Splits `rows` into `microbatches` consecutive, equal ranges (gradient accumulation), or an
/// error when they do not split evenly.
pub fn micro_rows(rows: Range<u64>, microbatches: usize) -> Result<Vec<Range<u64>>> {
    let n = rows.end.saturating_sub(rows.start);
    if microbatches == 0 || n == 0 || !n.is_multiple_of(microbatches as u64) {
        meshgrad_tensor::bail!("{n} rows do not split evenly into {microbatches} micro-batches");
    }
    let per = n / microbatches as u64;
    Ok((0..microbatches as u64)
        .map(|m| rows.start + m * per..rows.start + (m + 1) * per)
        .collect())
}

/// Domain tag of the sampler's permutation stream (ASCII `"mg-dsamp"`).
const DOMAIN: u64 = 0x6d67_2d64_7361_6d70;

/// Deals the indices `0..len` of a dataset to the ranks of a data-parallel group, reshuffled
/// every epoch.
///
/// The epoch's order is `0..len`, or with `shuffle` a Fisher–Yates permutation keyed by
/// `(seed, epoch)` (every rank computes the same one). It is then made a multiple of `world`
/// long: padded by repeating its head (the default, like PyTorch, so every index is seen), or,
/// with `drop_last`, truncated. Rank `r` takes positions `r, r + world, r + 2 world, ...`.
///
/// Layout invariance: if every rank reads its indices in batches of `b`, the union of the
/// ranks' k-th batches is positions `k*b*world .. (k+1)*b*world` of the epoch's order, the same
/// set a single device reads as its k-th batch of `b * world` (in a different row order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    /// Dataset length.
    pub len: usize,
    /// Number of data-parallel ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Seed of the permutation.
    pub seed: u64,
    /// Whether to permute each epoch.
    pub shuffle: bool,
    /// Drop the tail instead of padding.
    pub drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler at epoch 0 (padding, not dropping, the tail).
    pub fn new(len: usize, world: usize, rank: usize, seed: u64, shuffle: bool) -> Result<Self> {
        if world == 0 || rank >= world {
            meshgrad_tensor::bail!(
                "distributed sampler: rank {rank} is not a rank of a group of {world}"
            );
        }
        Ok(DistributedSampler {
            len,
            world,
            rank,
            seed,
            shuffle,
            drop_last: false,
            epoch: 0,
        })
    }

    /// The same sampler dropping the tail instead of padding it.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which keys the permutation.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of indices each rank gets per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world
        } else {
            self.len.div_ceil(self.world)
        }
    }

    /// The epoch's order of all `len` indices (before padding and dealing).
    pub fn epoch_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let key = splitmix64(splitmix64(self.seed ^ DOMAIN) ^ self.epoch);
            for i in (1..self.len).rev() {
                let h = splitmix64(key ^ i as u64);
                let j = ((h as u128 * (i as u128 + 1)) >> 64) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// This rank's indices for the current epoch (`num_samples()` of them).
    pub fn indices(&self) -> Vec<usize> {
        let order = self.epoch_order();
        let total = self.num_samples() * self.world;
        if order.is_empty() {
            return Vec::new();
        }
        (self.rank..total)
            .step_by(self.world)
            .map(|pos| order[pos % order.len()])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_split_and_errors() {
        assert_eq!(rank_rows(8, 4, 3).unwrap(), 6..8);
        assert_eq!(rank_rows(8, 1, 0).unwrap(), 0..8);
        let e = rank_rows(6, 4, 0).unwrap_err().to_string();
        assert!(e.contains("6 rows does not split evenly over 4"), "{e}");
        assert_eq!(micro_rows(4..8, 2).unwrap(), vec![4..6, 6..8]);
        assert!(micro_rows(4..7, 2).is_err());
        assert!(micro_rows(4..8, 0).is_err());
    }

    #[test]
    fn sampler_partitions_pads_and_reshuffles() {
        let mk = |rank| DistributedSampler::new(10, 4, rank, 5, true).unwrap();
        let all: Vec<Vec<usize>> = (0..4).map(|r| mk(r).indices()).collect();
        assert!(all.iter().all(|v| v.len() == 3));
        let mut seen: Vec<usize> = all.concat();
        seen.sort();
        seen.dedup();
        assert_eq!(
            seen,
            (0..10).collect::<Vec<_>>(),
            "padding repeats, nothing is lost"
        );
        let mut s = mk(0);
        let e0 = s.epoch_order();
        s.set_epoch(1);
        assert_ne!(e0, s.epoch_order());
        let mut sorted = s.epoch_order();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        let dropped: Vec<usize> = (0..4)
            .flat_map(|r| mk(r).with_drop_last(true).indices())
            .collect();
        assert_eq!(dropped.len(), 8);
        let plain = DistributedSampler::new(5, 2, 1, 0, false).unwrap();
        assert_eq!(plain.indices(), vec![1, 3, 0]);
        // Batches of b per rank cover the same positions as a single device's batches of b*world.
        let single = mk(0).epoch_order();
        let b = 1;
        let mut step0: Vec<usize> = (0..4)
            .map(|r| mk(r).indices()[0..b].to_vec())
            .collect::<Vec<_>>()
            .concat();
        step0.sort();
        let mut want = single[0..4].to_vec();
        want.sort();
        assert_eq!(step0, want);
    }
}
