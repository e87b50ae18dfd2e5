//! Fused scaled dot-product attention (flash-attention style: online softmax, no score matrix
//! kept), forward and backward, over operands laid out with arbitrary head and row strides (so
//! q, k and v can be read straight out of a fused `[B, T, 3C]` qkv projection and the output
//! written straight into `[B, T, C]`).
//!
//! Both passes work on tiles of [`BLOCK_Q`] query rows by [`BLOCK_K`] keys. Every product inside
//! a tile (`S = Q Kᵀ`, `O += P V`, and in the backward `dP = dO Vᵀ`, `dV += Pᵀ dO`,
//! `dK += dSᵀ Q`, `dQ += dS K`) is a small register-blocked matrix product (`gemm_tile` in
//! `cpu/tile_gemm.rs`) whose every output element sums its terms in increasing index order with
//! fused multiply-adds. Key tiles wholly past the causal limit (or past the last key the padding
//! mask keeps) are never visited; inside a tile masked scores are computed and then discarded.
//!
//! Masking beyond causal ([`ScoreMask`]: a key padding mask and an additive bias): the softmax
//! inputs are `z = scale q·k + bias`, `-inf` where padded; a row with no finite input gets output
//! 0, `lse = -inf` and zero gradients. Both passes exist in a masked and an unmasked instance
//! (a const generic chosen once per call), so the unmasked loops never look at a mask.
//!
//! Forward: tasks are (batch-head, query tile) pairs, run in parallel when the problem is large.
//! Per row, the online softmax keeps a running max `m`, running sum `l` and an unnormalised
//! accumulator, rescaled by `exp(m_old - m_new)` when the max grows.
//!
//! Backward: one task per batch-head (each writes only its own rows of `dq`, `dk`, `dv`), so
//! every gradient element is accumulated in a fixed order (query rows increasing for `dk`/`dv`,
//! keys increasing for `dq`) whatever the thread count. Probabilities are recomputed as
//! `P = exp(z - lse)`; with `D_i = dout_i · out_i`, the softmax-input gradient is
//! `dZ = P (dout·v - D_i)` (what a bias gradient is summed from, written out on request),
//! `dS = scale dZ`, and `dv += Pᵀ dout`, `dq += dS k`, `dk += dSᵀ q`.
//!
//! All arithmetic is in `T` (f32 uses the crate's vectorised `exp`); nothing depends on the
//! thread count or on which instance (AVX2+FMA or portable) of the loops runs.
//!
//! Files: this one holds the shapes, layouts, checks and scratch shared by both passes;
//! `forward.rs` and `backward.rs` the two passes; the tile products live in
//! `cpu/tile_gemm.rs`, which knows nothing of attention; `mask.rs` the key padding mask and
//! additive bias.

mod backward;
mod forward;
mod mask;
#[cfg(test)]
mod tests;

pub use backward::{attention_backward, attention_backward_strided};
pub use forward::{attention_forward, attention_forward_strided};
pub use mask::ScoreMask;

use crate::ops::AttentionShape;
use crate::Float;

/// Where one attention operand's rows live in a flat buffer. With `heads` heads per batch entry
/// (`batch_heads = batch * heads`), element `c` of row `t` of batch-head `bh = b * heads + h` is at
/// `offset + b * batch_stride + h * head_stride + t * row_stride + c` (elements of a row are
/// contiguous).
///
/// Examples: a contiguous `[batch_heads, seq, d]` tensor is `heads = 1`, `batch_stride = seq * d`,
/// `row_stride = d`; the q part of a fused `[B, T, 3C]` qkv buffer with `H` heads of `D = C / H`
/// is `offset = 0`, `batch_stride = T * 3C`, `head_stride = D`, `row_stride = 3C` (k: offset `C`,
/// v: offset `2C`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadLayout {
    /// Offset of batch-head 0's row 0.
    pub offset: usize,
    /// Stride between batch entries.
    pub batch_stride: usize,
    /// Stride between heads of one batch entry.
    pub head_stride: usize,
    /// Stride between rows (positions).
    pub row_stride: usize,
}

impl HeadLayout {
    /// The layout of a contiguous `[batch_heads, seq, head_dim]` operand (with `heads = 1`).
    pub fn contiguous(seq: usize, head_dim: usize) -> Self {
        HeadLayout {
            offset: 0,
            batch_stride: seq * head_dim,
            head_stride: 0,
            row_stride: head_dim,
        }
    }

    /// Offset of row `t` of batch-head `bh`.
    #[inline(always)]
    fn row(&self, heads: usize, bh: usize, t: usize) -> usize {
        self.offset
            + (bh / heads) * self.batch_stride
            + (bh % heads) * self.head_stride
            + t * self.row_stride
    }

    /// One past the largest index touched by `batch_heads` heads of `seq` rows of `d` elements.
    fn extent(&self, heads: usize, batch_heads: usize, seq: usize, d: usize) -> usize {
        if batch_heads == 0 || seq == 0 || d == 0 {
            return 0;
        }
        let b = batch_heads / heads;
        self.offset
            + (b - 1) * self.batch_stride
            + (heads.min(batch_heads) - 1) * self.head_stride
            + (seq - 1) * self.row_stride
            + d
    }
}

/// Query rows per tile.
pub const BLOCK_Q: usize = 32;
/// Keys per tile.
pub const BLOCK_K: usize = 64;

/// Work (batch_heads · seq_q · seq_k · head_dim) above which the passes run in parallel.
const PAR_WORK: usize = 1 << 16;

impl AttentionShape {
    /// The number of keys query row `i` sees (`seq_k`, or the causal limit).
    #[inline]
    fn key_limit(&self, i: usize) -> usize {
        if self.causal {
            (i + 1 + (self.seq_k - self.seq_q)).min(self.seq_k)
        } else {
            self.seq_k
        }
    }

    /// The first query row that sees key `j` (0 without masking).
    #[inline]
    fn first_row_seeing(&self, j: usize) -> usize {
        if self.causal {
            j.saturating_sub(self.seq_k - self.seq_q)
        } else {
            0
        }
    }

    fn work(&self) -> usize {
        self.batch_heads
            .saturating_mul(self.seq_q)
            .saturating_mul(self.seq_k)
            .saturating_mul(self.head_dim)
    }
}

/// Checks the shape against `heads` and that every operand's rows lie inside its buffer.
fn check_operands(sh: &AttentionShape, heads: usize, ops: &[(&str, usize, HeadLayout, usize)]) {
    assert!(
        !sh.causal || sh.seq_k >= sh.seq_q,
        "attention: causal masking needs seq_k >= seq_q, got seq_q {}, seq_k {}",
        sh.seq_q,
        sh.seq_k
    );
    assert!(
        heads >= 1 && sh.batch_heads.is_multiple_of(heads),
        "attention: batch_heads {} is not a multiple of heads {heads}",
        sh.batch_heads
    );
    for &(what, seq, l, len) in ops {
        let e = l.extent(heads, sh.batch_heads, seq, sh.head_dim);
        assert!(
            e <= len,
            "attention: {what} layout {l:?} for {} heads x {seq} rows x {} needs {e} elements, buffer has {len}",
            sh.batch_heads,
            sh.head_dim
        );
    }
}

/// Panics unless the rows of all `layouts` (each `batch_heads` heads of the paired number of rows
/// of `d` elements, inside a buffer of `len` elements) are pairwise disjoint: the written
/// operands of one call never overlap, so tasks may write them concurrently.
fn check_disjoint(
    heads: usize,
    batch_heads: usize,
    d: usize,
    len: usize,
    layouts: &[(&str, HeadLayout, usize)],
) {
    if d == 0 || batch_heads == 0 {
        return;
    }
    let mut bits = vec![0u64; len / 64 + 1];
    for &(what, l, seq) in layouts {
        for bh in 0..batch_heads {
            for t in 0..seq {
                // Mark bits start .. start + d a word at a time.
                let start = l.row(heads, bh, t);
                let mut idx = start;
                while idx < start + d {
                    let (w, b) = (idx / 64, idx % 64);
                    let n = (64 - b).min(start + d - idx);
                    let mask = if n == 64 {
                        u64::MAX
                    } else {
                        ((1u64 << n) - 1) << b
                    };
                    assert!(
                        bits[w] & mask == 0,
                        "attention: output {what} (layout {l:?}) overlaps another written row near element {idx}"
                    );
                    bits[w] |= mask;
                    idx += n;
                }
            }
        }
    }
}

/// Copies rows `0 .. n` of the operand at `src[base + t * rs ..]` transposed into the
/// `[d, BLOCK_K]` tile `dst`: `dst[c * BLOCK_K + t] = src[base + t * rs + c]`.
#[inline(always)]
fn transpose_tile<T: Float>(src: &[T], base: usize, rs: usize, d: usize, n: usize, dst: &mut [T]) {
    for t in 0..n {
        let row = &src[base + t * rs..base + t * rs + d];
        for (c, &x) in row.iter().enumerate() {
            dst[c * BLOCK_K + t] = x;
        }
    }
}

/// The operands of one call, resolved: buffers, layouts and the head count.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    layout: HeadLayout,
}

/// Per-task scratch buffers.
struct TileScratch<T> {
    kt: Vec<T>,
    vt: Vec<T>,
    s: Vec<T>,
    dp: Vec<T>,
    o: Vec<T>,
}

impl<T: Float> TileScratch<T> {
    fn new(d: usize, backward: bool) -> Self {
        let tile = d * BLOCK_K;
        TileScratch {
            kt: vec![T::ZERO; tile],
            vt: vec![T::ZERO; if backward { tile } else { 0 }],
            s: vec![T::ZERO; BLOCK_Q * BLOCK_K],
            dp: vec![T::ZERO; if backward { BLOCK_Q * BLOCK_K } else { 0 }],
            o: vec![T::ZERO; BLOCK_Q * d],
        }
    }
}
