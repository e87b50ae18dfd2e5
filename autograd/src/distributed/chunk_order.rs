//! [`ChunkOrder`]: which positions of a sequence a rank of a context-parallel group holds. The
//! sequence is cut into `2C` equal chunks and rank `i` of `C` holds chunks `i` and `2C - 1 - i`,
//! side by side (Megatron-LM's and torchtitan's load balancing for causal attention: every rank
//! gets one early and one late chunk, so the same share of the causal score matrix).

use std::ops::Range;

use meshgrad_tensor::{Device, Result, Tensor};

/// Rank `rank` of a context-parallel group of `size` ranks: it holds chunks `rank` and
/// `2 size - 1 - rank` of every sequence (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkOrder {
    /// This rank's index in the group.
    pub rank: usize,
    /// Number of ranks (`C`).
    pub size: usize,
}

impl ChunkOrder {
    /// Rank `rank` of `size` ranks.
    pub fn new(rank: usize, size: usize) -> Self {
        ChunkOrder { rank, size }
    }

    /// The two global chunk indices this rank holds, in local order: `[rank, 2 size - 1 - rank]`.
    pub fn chunks(&self) -> [usize; 2] {
        [self.rank, 2 * self.size - 1 - self.rank]
    }

    /// Where chunk `g` (of `2 size`) lies when every rank's two chunks are concatenated in rank
    /// order (an all-gather of the ranks' local sequences): piece `2 r + s` is rank `r`'s chunk
    /// `chunks()[s]`.
    pub fn gathered_piece(size: usize, g: usize) -> usize {
        if g < size {
            2 * g
        } else {
            2 * (2 * size - 1 - g) + 1
        }
    }

    /// The length of one chunk of a sequence of `t` positions, or a one-line error when `t` does
    /// not split into `2 size` equal chunks.
    pub fn chunk_len(&self, t: usize) -> Result<usize> {
        let n = 2 * self.size;
        if t == 0 || !t.is_multiple_of(n) {
            meshgrad_tensor::bail!(
                "context parallelism: the sequence length {t} does not split into 2 x cp = {n} \
                 equal chunks (cp = {})",
                self.size
            );
        }
        Ok(t / n)
    }

    /// The global position ranges of this rank's local positions for a sequence of `t`
    /// positions, in local order.
    pub fn ranges(&self, t: usize) -> Result<[Range<usize>; 2]> {
        let l = self.chunk_len(t)?;
        Ok(self.chunks().map(|c| c * l..(c + 1) * l))
    }

    /// The global positions of this rank's local positions (`i64`, `[2 t / (2 size)]`) for a
    /// sequence of `t` positions: what learned position embeddings and rotary embeddings read.
    pub fn positions(&self, t: usize, device: Device) -> Result<Tensor> {
        let pos: Vec<i64> = self
            .ranges(t)?
            .into_iter()
            .flatten()
            .map(|p| p as i64)
            .collect();
        let n = pos.len();
        Tensor::from_vec(pos, n, device)
    }

    /// This rank's part of `full` along dimension `dim` (its two chunks side by side, a
    /// contiguous copy); `full`'s length along `dim` is the whole sequence.
    pub fn local_of(&self, full: &Tensor, dim: usize) -> Result<Tensor> {
        let Some(&t) = full.dims().get(dim) else {
            meshgrad_tensor::bail!(
                "context parallelism: shape {} has no sequence dimension {dim}",
                full.shape()
            );
        };
        let parts: Vec<Tensor> = self
            .ranges(t)?
            .into_iter()
            .map(|r| full.narrow(dim as isize, r.start, r.len()))
            .collect::<Result<_>>()?;
        Tensor::cat(&[&parts[0], &parts[1]], dim as isize)?.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_one_early_and_one_late_chunk() {
        let o = ChunkOrder::new(1, 4);
        assert_eq!(o.chunks(), [1, 6]);
        assert_eq!(o.ranges(16).unwrap(), [2..4, 12..14]);
        let p = o.positions(16, Device::Cpu).unwrap();
        assert_eq!(p.to_vec::<i64>().unwrap(), [2, 3, 12, 13]);
        let full = Tensor::from_vec((0..16i64).collect::<Vec<_>>(), (1, 16), Device::Cpu).unwrap();
        let local = o.local_of(&full, 1).unwrap();
        assert_eq!(local.to_vec::<i64>().unwrap(), [2, 3, 12, 13]);
        let e = o.chunk_len(12).unwrap_err().to_string();
        assert!(
            e.contains("sequence length 12 does not split into 2 x cp = 8"),
            "{e}"
        );
        assert!(!e.contains('\n'));
    }
}
