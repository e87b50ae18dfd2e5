//! What besides the causal mask shapes the scores of one attention call: a key padding mask and
//! an additive bias ([`ScoreMask`]), and their resolution for one batch-head ([`HeadMask`]).
//!
//! The scores a query row `i` of batch-head `bh` feeds to its softmax are
//! `z_ij = scale · q_i·k_j + bias_ij` for the keys `j` it may see (causal limit, padding), and
//! `-inf` for the others. A row that sees no key at all (every key padded, or every visible
//! bias `-inf`) has output 0, log-sum-exp `-inf` and zero gradients.

use crate::ops::{AttentionShape, BiasLayout};
use crate::Float;

/// The key padding mask and additive score bias of one attention call (the causal mask is part
/// of [`AttentionShape`]). [`ScoreMask::none`] has neither; the kernels then run their unmasked
/// instances, which never look at a mask.
#[derive(Clone, Copy, Debug)]
pub struct ScoreMask<'a, T> {
    /// Heads per batch entry, for indexing `key_padding` and `bias`: batch-head `bh` is batch
    /// `bh / heads`, head `bh % heads` (`batch_heads` must be a multiple of it when a mask is
    /// given). Independent of the `heads` of the operands' [`super::HeadLayout`]s.
    pub heads: usize,
    /// Contiguous `[batch_heads / heads, seq_k]`: nonzero = the key may be attended to, 0 = it is
    /// masked for every query of that batch entry.
    pub key_padding: Option<&'a [u8]>,
    /// Additive bias of the scaled scores and its layout.
    pub bias: Option<(&'a [T], BiasLayout)>,
}

impl<T> ScoreMask<'_, T> {
    /// No padding mask and no bias.
    pub fn none() -> Self {
        ScoreMask {
            heads: 1,
            key_padding: None,
            bias: None,
        }
    }

    /// Whether there is neither a padding mask nor a bias.
    pub fn is_none(&self) -> bool {
        self.key_padding.is_none() && self.bias.is_none()
    }
}

impl<'a, T: Float> ScoreMask<'a, T> {
    /// Panics unless the mask fits the shape: `heads` divides `batch_heads`, the padding mask is
    /// `[batch, seq_k]` and every bias element the call reads lies inside the bias buffer.
    pub(super) fn check(&self, sh: &AttentionShape) {
        if self.is_none() || sh.batch_heads == 0 {
            // Nothing is read.
            return;
        }
        assert!(
            self.heads >= 1 && sh.batch_heads.is_multiple_of(self.heads),
            "attention: mask heads {} do not divide batch_heads {}",
            self.heads,
            sh.batch_heads
        );
        let batch = sh.batch_heads / self.heads;
        if let Some(p) = self.key_padding {
            assert_eq!(
                p.len(),
                batch * sh.seq_k,
                "attention: key padding has {} elements, expected [{batch}, {}]",
                p.len(),
                sh.seq_k
            );
        }
        if let Some((data, l)) = self.bias {
            if sh.batch_heads > 0 && sh.seq_q > 0 && sh.seq_k > 0 {
                let last = l.offset
                    + (batch - 1) * l.batch_stride
                    + (self.heads - 1) * l.head_stride
                    + (sh.seq_q - 1) * l.row_stride
                    + (sh.seq_k - 1) * l.col_stride;
                assert!(
                    last < data.len(),
                    "attention: bias layout {l:?} for [{batch}, {}, {}, {}] reads element {last}, buffer has {}",
                    self.heads,
                    sh.seq_q,
                    sh.seq_k,
                    data.len()
                );
            }
        }
    }

    /// The mask of batch-head `bh` (after [`ScoreMask::check`]).
    pub(super) fn head(&self, sh: &AttentionShape, bh: usize) -> HeadMask<'a, T> {
        let heads = self.heads.max(1);
        let (b, h) = (bh / heads, bh % heads);
        let pad = self
            .key_padding
            .map(|p| &p[b * sh.seq_k..(b + 1) * sh.seq_k]);
        let key_end = pad.map_or(sh.seq_k, |p| {
            p.iter().rposition(|&m| m != 0).map_or(0, |j| j + 1)
        });
        let bias = match self.bias {
            Some((data, l)) if sh.seq_q > 0 && sh.seq_k > 0 => Some(HeadBias {
                data: &data[l.offset + b * l.batch_stride + h * l.head_stride..],
                row_stride: l.row_stride,
                col_stride: l.col_stride,
            }),
            _ => None,
        };
        HeadMask { pad, key_end, bias }
    }
}

/// The bias of one batch-head: query `i`, key `j` at `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
pub(super) struct HeadBias<'a, T> {
    data: &'a [T],
    row_stride: usize,
    col_stride: usize,
}

/// The padding mask and bias of one batch-head.
#[derive(Clone, Copy)]
pub(super) struct HeadMask<'a, T> {
    /// The batch entry's `[seq_k]` padding row.
    pad: Option<&'a [u8]>,
    /// One past the last key that is not padded (`seq_k` without padding): later key tiles are
    /// skipped.
    pub key_end: usize,
    bias: Option<HeadBias<'a, T>>,
}

impl<T: Float> HeadMask<'_, T> {
    /// No padding and no bias (what the unmasked kernel instances carry but never read).
    #[inline(always)]
    pub(super) fn unmasked(seq_k: usize) -> Self {
        HeadMask {
            pad: None,
            key_end: seq_k,
            bias: None,
        }
    }

    /// Turns the scaled scores `srow` of query `i` against keys `kb .. kb + srow.len()` into
    /// softmax inputs: adds the bias and sets padded keys to `-inf`.
    #[inline(always)]
    pub(super) fn apply(&self, i: usize, kb: usize, srow: &mut [T]) {
        let n = srow.len();
        if let Some(b) = &self.bias {
            let base = i * b.row_stride + kb * b.col_stride;
            if b.col_stride == 1 {
                for (x, &v) in srow.iter_mut().zip(&b.data[base..base + n]) {
                    *x += v;
                }
            } else {
                for (j, x) in srow.iter_mut().enumerate() {
                    *x += b.data[base + j * b.col_stride];
                }
            }
        }
        if let Some(p) = self.pad {
            for (x, &m) in srow.iter_mut().zip(&p[kb..kb + n]) {
                if m == 0 {
                    *x = T::NEG_INFINITY;
                }
            }
        }
    }
}
