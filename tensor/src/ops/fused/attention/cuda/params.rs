//! The pure part of the attention launches: the `HeadLayout`s and `AttnParams` of attention.cu
//! built from an `AttentionShape` (separate q, k, v buffers, or strided slices of one fused
//! `[B, T, 3C]` qkv buffer), the tile sizes and grids each kernel needs, the split of the
//! batch-heads over launches (the grid's y dimension holds at most 65535), and the launches'
//! parameter lists.

use meshgrad_kernels::cuda::{AttnParams, HeadLayout};
use meshgrad_kernels::ops::AttentionShape;

use crate::cuda_backend::fused::args::{i64_of, Arg, Launch, MAX_BLOCKS};

/// The head dims the kernels are instantiated for.
pub(crate) const HEAD_DIMS: [usize; 2] = [64, 128];

/// Threads per block of the forward, dq and dkdv kernels (4 warps, `__launch_bounds__(128)`).
pub(crate) const ATTN_THREADS: u32 = 128;

/// Threads per block of the delta kernel (one warp per query row).
pub(crate) const DELTA_THREADS: u32 = 256;

/// The most blocks along the grid's y dimension (one per batch-head).
pub(crate) const MAX_GRID_Y: usize = 65535;

/// Query rows per block of `attn_fwd_d<D>` (`BQ`).
pub(crate) fn fwd_rows_per_block(head_dim: usize) -> usize {
    if head_dim >= 128 {
        16
    } else {
        32
    }
}

/// Query rows per block of `attn_bwd_dq_d<D>` (`BQ`).
pub(crate) fn dq_rows_per_block(head_dim: usize) -> usize {
    if head_dim >= 128 {
        8
    } else {
        16
    }
}

/// Keys per block of `attn_bwd_dkdv_d<D>` (`BKB = RK * 4`).
pub(crate) fn dkdv_keys_per_block(head_dim: usize) -> usize {
    if head_dim >= 128 {
        8
    } else {
        16
    }
}

/// The layout of a contiguous `[batch_heads, seq, head_dim]` buffer, addressed with one head per
/// batch entry (`AttnParams::heads == 1`).
pub(crate) fn bhtd_layout(seq: usize, head_dim: usize) -> HeadLayout {
    HeadLayout {
        offset: 0,
        batch_stride: (seq * head_dim) as i64,
        head_stride: 0,
        row_stride: head_dim as i64,
    }
}

/// The q, k, v layouts inside a contiguous `[B, T, 3C]` buffer with `heads` heads of
/// `head_dim` (`C = heads * head_dim`): q at columns `0..C`, k at `C..2C`, v at `2C..3C`, head
/// `h` at `h * head_dim` within each.
pub(crate) fn qkv_layouts(seq: usize, heads: usize, head_dim: usize) -> [HeadLayout; 3] {
    let c = heads * head_dim;
    let at = |offset: usize| HeadLayout {
        offset: offset as i64,
        batch_stride: (seq * 3 * c) as i64,
        head_stride: head_dim as i64,
        row_stride: (3 * c) as i64,
    };
    [at(0), at(c), at(2 * c)]
}

/// The layout of a contiguous `[B, T, C]` buffer with `heads` heads of `head_dim`.
pub(crate) fn btc_layout(seq: usize, heads: usize, head_dim: usize) -> HeadLayout {
    let c = heads * head_dim;
    HeadLayout {
        offset: 0,
        batch_stride: (seq * c) as i64,
        head_stride: head_dim as i64,
        row_stride: c as i64,
    }
}

/// `AttnParams` with `layouts` (q, k, v, out, dout, dq, dk, dv), `heads` heads per batch entry
/// of the layouts and `mask_heads` per entry of the key padding mask.
pub(crate) fn attn_params(
    shape: &AttentionShape,
    heads: usize,
    mask_heads: usize,
    layouts: [HeadLayout; 8],
) -> AttnParams {
    AttnParams {
        layouts,
        batch_heads: shape.batch_heads as i64,
        seq_q: shape.seq_q as i64,
        seq_k: shape.seq_k as i64,
        heads: heads.max(1) as i32,
        mask_heads: mask_heads.max(1) as i32,
        causal: shape.causal as i32,
        scale: shape.scale as f32,
    }
}

/// The parameters of a call on separate contiguous buffers: q, out, dout, dq
/// `[batch_heads, seq_q, head_dim]`, k, v, dk, dv `[batch_heads, seq_k, head_dim]`.
pub(crate) fn separate_params(shape: &AttentionShape, mask_heads: usize) -> AttnParams {
    let q = bhtd_layout(shape.seq_q, shape.head_dim);
    let k = bhtd_layout(shape.seq_k, shape.head_dim);
    attn_params(shape, 1, mask_heads, [q, k, k, q, q, q, k, k])
}

/// The parameters of a call on a fused `[B, T, 3C]` qkv buffer with `heads` heads: q, k, v and
/// dq, dk, dv are slices of the qkv (and dqkv) buffer, out and dout `[B, T, C]`.
pub(crate) fn qkv_params(shape: &AttentionShape, heads: usize, mask_heads: usize) -> AttnParams {
    let [q, k, v] = qkv_layouts(shape.seq_q, heads, shape.head_dim);
    let o = btc_layout(shape.seq_q, heads, shape.head_dim);
    attn_params(shape, heads, mask_heads, [q, k, v, o, o, q, k, v])
}

/// Greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The batch-head ranges `(first, count)` of the launches of `batch_heads` batch-heads: at most
/// `max` each, every range starting at a multiple of both `heads` and `mask_heads` (so a range
/// starts at a batch entry of the layouts and of the mask). `None` when one such unit exceeds
/// `max`.
pub(crate) fn bh_chunks(
    batch_heads: usize,
    heads: usize,
    mask_heads: usize,
    max: usize,
) -> Option<Vec<(usize, usize)>> {
    let (h, m) = (heads.max(1), mask_heads.max(1));
    let unit = h / gcd(h, m) * m;
    if unit > max {
        return None;
    }
    let step = max / unit * unit;
    Some(
        (0..batch_heads)
            .step_by(step)
            .map(|b0| (b0, step.min(batch_heads - b0)))
            .collect(),
    )
}

/// `p` restricted to the batch-heads `first .. first + count` (`first` a multiple of
/// `p.heads`): every layout's offset moves to batch entry `first / heads`. The per-row `lse` /
/// `delta` and the key padding mask move by [`row_offset`] and [`mask_offset`].
pub(crate) fn chunk_params(p: &AttnParams, first: usize, count: usize) -> AttnParams {
    let entry = (first / p.heads as usize) as i64;
    let mut c = *p;
    for l in &mut c.layouts {
        l.offset += entry * l.batch_stride;
    }
    c.batch_heads = count as i64;
    c
}

/// The element offset of batch-head `first`'s row 0 in a `[batch_heads, seq_q]` f32 buffer.
pub(crate) fn row_offset(p: &AttnParams, first: usize) -> usize {
    first * p.seq_q as usize
}

/// The element offset of batch-head `first`'s row in the `[batch, seq_k]` key padding mask.
pub(crate) fn mask_offset(p: &AttnParams, first: usize) -> usize {
    first / p.mask_heads as usize * p.seq_k as usize
}

/// The 128-thread block of the tiled kernels.
const ATTN_BLOCK: (u32, u32, u32) = (ATTN_THREADS, 1, 1);

/// A tiled attention kernel: the pointers `p`, then `P`; grid `(ceil(positions / per_block),
/// batch_heads)` of [`ATTN_BLOCK`] threads, where `positions` is `seq_q` for the query-tiled
/// kernels and `seq_k` for dk/dv.
fn tiled_launch(
    entry: String,
    p: &[u64],
    params: &AttnParams,
    positions: i64,
    per_block: usize,
) -> Launch {
    let mut args: Vec<Arg> = p.iter().map(|&x| Arg::Ptr(x)).collect();
    args.push(Arg::Attn(Box::new(*params)));
    Launch {
        file: "attention.cu",
        entry,
        grid: (
            (positions as usize).div_ceil(per_block) as u32,
            params.batch_heads as u32,
            1,
        ),
        block: ATTN_BLOCK,
        shared: 0,
        args,
    }
}

/// `attn_fwd_d<D>_<t>(q, k, v, out, lse, key_padding, P)`: grid `(ceil(seq_q / BQ),
/// batch_heads)`. `[q, k, v, out, lse, key_padding]` (key_padding 0 when absent).
pub(crate) fn fwd_launch(t: &str, head_dim: usize, p: [u64; 6], params: &AttnParams) -> Launch {
    tiled_launch(
        format!("attn_fwd_d{head_dim}_{t}"),
        &p,
        params,
        params.seq_q,
        fwd_rows_per_block(head_dim),
    )
}

/// `attn_bwd_delta_<t>(out, dout, delta, P, head_dim)`: one warp per query row over all
/// `batch_heads * seq_q` rows (grid-stride, no y dimension).
pub(crate) fn delta_launch(
    t: &str,
    head_dim: usize,
    [out, dout, delta]: [u64; 3],
    params: &AttnParams,
) -> Launch {
    let rows = (params.batch_heads * params.seq_q) as usize;
    let warps = (DELTA_THREADS / 32) as usize;
    Launch {
        file: "attention.cu",
        entry: format!("attn_bwd_delta_{t}"),
        grid: (rows.div_ceil(warps).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block: (DELTA_THREADS, 1, 1),
        shared: 0,
        args: vec![
            Arg::Ptr(out),
            Arg::Ptr(dout),
            Arg::Ptr(delta),
            Arg::Attn(Box::new(*params)),
            i64_of(head_dim),
        ],
    }
}

/// `attn_bwd_dq_d<D>_<t>(q, k, v, dout, lse, delta, dq, key_padding, P)`: grid
/// `(ceil(seq_q / BQ), batch_heads)`. `[q, k, v, dout, lse, delta, dq, key_padding]`.
pub(crate) fn dq_launch(t: &str, head_dim: usize, p: [u64; 8], params: &AttnParams) -> Launch {
    tiled_launch(
        format!("attn_bwd_dq_d{head_dim}_{t}"),
        &p,
        params,
        params.seq_q,
        dq_rows_per_block(head_dim),
    )
}

/// `attn_bwd_dkdv_d<D>_<t>(q, k, v, dout, lse, delta, dk, dv, key_padding, P)`: grid
/// `(ceil(seq_k / BKB), batch_heads)`. `[q, k, v, dout, lse, delta, dk, dv, key_padding]`.
pub(crate) fn dkdv_launch(t: &str, head_dim: usize, p: [u64; 9], params: &AttnParams) -> Launch {
    tiled_launch(
        format!("attn_bwd_dkdv_d{head_dim}_{t}"),
        &p,
        params,
        params.seq_k,
        dkdv_keys_per_block(head_dim),
    )
}

/// Bytes of static shared memory of each tiled kernel for `head_dim` (forward, dq, dkdv), as
/// attention.cu declares its tiles (f32): all under the 48 KiB a block gets without opting in,
/// so no dynamic shared memory and no attribute change is needed (checked by the tests).
#[cfg(test)]
pub(crate) fn static_shared_bytes(head_dim: usize) -> [usize; 3] {
    let d = head_dim;
    let bk = 32;
    let fwd = fwd_rows_per_block(d) * d + bk * (d + 1) + bk * d;
    let dq = 2 * dq_rows_per_block(d) * d + 2 * bk * (d + 1);
    let bkb = dkdv_keys_per_block(d);
    let dkdv = 2 * bkb * d + 2 * 32 * (d + 1) + 2 * 32;
    [fwd * 4, dq * 4, dkdv * 4]
}
