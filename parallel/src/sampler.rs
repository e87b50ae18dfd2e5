//! Which data each data-parallel rank reads: token datasets
//! ([`meshgrad_nn::data::TokenDataset::batch`]) draw global batch row `b` of step `s` as a pure
//! function of `(seed, s, b)`, so a rank only needs its rows: [`rank_rows`] (and [`micro_rows`]
//! for gradient accumulation).

use std::ops::Range;

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
}
