//! Fused scaled dot-product attention (flash-attention style: online softmax, no score matrix
//! kept), forward and backward.

use crate::Float;

/// Sizes of one attention call. `q` is `[batch_heads, seq_q, head_dim]`, `k` and `v` are
/// `[batch_heads, seq_k, head_dim]`, all contiguous.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// batch * heads
    pub batch_heads: usize,
    /// Query positions.
    pub seq_q: usize,
    /// Key/value positions.
    pub seq_k: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Causal masking, aligned bottom-right: query `i` sees keys `j <= i + (seq_k - seq_q)`
    /// (requires `seq_k >= seq_q`). Masked key blocks are skipped, not computed.
    pub causal: bool,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f64,
}

/// `out = softmax(scale · q kᵀ + mask) v`; also writes `lse` (`[batch_heads, seq_q]`), the
/// log-sum-exp of each row of scaled scores, for the backward pass.
pub fn attention_forward<T: Float>(shape: AttentionShape, q: &[T], k: &[T], v: &[T], out: &mut [T], lse: &mut [T]) {
    let _ = (shape, q, k, v, out, lse);
    todo!("attention_forward")
}

/// Backward of [`attention_forward`] from `dout`, recomputing probabilities from `lse`;
/// overwrites `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    shape: AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    lse: &[T],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    let _ = (shape, q, k, v, out, lse, dout, dq, dk, dv);
    todo!("attention_backward")
}
