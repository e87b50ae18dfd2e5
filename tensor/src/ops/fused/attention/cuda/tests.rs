//! Host-side tests of the attention launches: layouts, parameters, chunking, grids, argument
//! lists (no GPU needed).

use std::collections::BTreeSet;

use meshgrad_kernels::cuda::{AttnParams, HeadLayout};
use meshgrad_kernels::ops::AttentionShape;

use super::params::*;
use super::{covered, mask_heads};
use crate::cuda_backend::fused::args::{assert_known, assert_launch};
use crate::cuda_backend::fused::args::{Arg, Kind::*};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::attention::MaskArgs;
use crate::DType;

fn shape(bh: usize, sq: usize, sk: usize, d: usize) -> AttentionShape {
    AttentionShape {
        batch_heads: bh,
        seq_q: sq,
        seq_k: sk,
        head_dim: d,
        causal: true,
        scale: 0.125,
    }
}

/// attention.cu's `head_row(L, heads, bh, t) + c`.
fn addr(l: &HeadLayout, heads: i32, bh: usize, t: usize, c: usize) -> usize {
    let (bh, heads) = (bh as i64, heads as i64);
    (l.offset
        + (bh / heads) * l.batch_stride
        + (bh % heads) * l.head_stride
        + t as i64 * l.row_stride) as usize
        + c
}

#[test]
fn separate_buffers_are_contiguous_batch_head_rows() {
    let s = shape(6, 5, 7, 64);
    let p = separate_params(&s, 3);
    assert_eq!((p.batch_heads, p.seq_q, p.seq_k), (6, 5, 7));
    assert_eq!((p.heads, p.mask_heads, p.causal, p.scale), (1, 3, 1, 0.125));
    for bh in 0..6 {
        for c in [0, 63] {
            for t in 0..5 {
                let e = bh * 5 * 64 + t * 64 + c;
                // q, out, dout, dq
                for i in [0, 3, 4, 5] {
                    assert_eq!(addr(&p.layouts[i], p.heads, bh, t, c), e, "layout {i}");
                }
            }
            for t in 0..7 {
                let e = bh * 7 * 64 + t * 64 + c;
                // k, v, dk, dv
                for i in [1, 2, 6, 7] {
                    assert_eq!(addr(&p.layouts[i], p.heads, bh, t, c), e, "layout {i}");
                }
            }
        }
    }
}

#[test]
fn qkv_slices_tile_the_fused_buffer() {
    let (b, t, h, d) = (2, 5, 3, 64);
    let c = h * d;
    let p = qkv_params(&shape(b * h, t, t, d), h, h);
    assert_eq!(p.heads, 3);
    let mut seen = BTreeSet::new();
    for (which, li) in [(0, 0), (1, 1), (2, 2)] {
        let l = &p.layouts[li];
        // The gradients go to the same places of dqkv.
        assert_eq!(p.layouts[li + 5], *l);
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    for ci in 0..d {
                        let a = addr(l, p.heads, bi * h + hi, ti, ci);
                        // [B, T, 3C]: q at columns 0..C, k at C..2C, v at 2C..3C; head hi at hi*D.
                        assert_eq!(a, bi * t * 3 * c + ti * 3 * c + which * c + hi * d + ci);
                        assert!(seen.insert(a), "address {a} read twice");
                    }
                }
            }
        }
    }
    assert_eq!(seen.len(), b * t * 3 * c, "q, k and v cover the buffer");
    // out and dout are [B, T, C].
    for i in [3, 4] {
        assert_eq!(addr(&p.layouts[i], p.heads, 4, 2, 7), t * c + 2 * c + d + 7);
    }
}

#[test]
fn batch_heads_split_at_the_grid_limit() {
    assert_eq!(bh_chunks(100, 1, 1, MAX_GRID_Y), Some(vec![(0, 100)]));
    assert_eq!(
        bh_chunks(70000, 1, 1, MAX_GRID_Y),
        Some(vec![(0, 65535), (65535, 4465)])
    );
    // Chunks start at multiples of lcm(heads, mask heads) = 12.
    let c = bh_chunks(140_000, 4, 6, MAX_GRID_Y).unwrap();
    assert_eq!(c[0], (0, 65532));
    assert_eq!(c[1], (65532, 65532));
    assert_eq!(c.iter().map(|x| x.1).sum::<usize>(), 140_000);
    assert!(c.iter().all(|x| x.0 % 12 == 0));
    assert_eq!(bh_chunks(0, 1, 1, MAX_GRID_Y), Some(vec![]));
    assert_eq!(bh_chunks(10, 70000, 1, MAX_GRID_Y), None);
}

#[test]
fn a_chunk_addresses_what_the_whole_call_does() {
    let (h, t, d) = (3, 4, 64);
    let p = qkv_params(&shape(12 * h, t, t, d), h, h);
    let first = 6;
    let cp = chunk_params(&p, first, 9);
    assert_eq!(cp.batch_heads, 9);
    for l in 0..8 {
        for local in 0..9 {
            assert_eq!(
                addr(&cp.layouts[l], cp.heads, local, 3, 5),
                addr(&p.layouts[l], p.heads, first + local, 3, 5)
            );
        }
    }
    assert_eq!(row_offset(&p, first), first * t);
    assert_eq!(mask_offset(&p, first), (first / h) * t);
    let s = separate_params(&shape(8, 3, 5, 128), 4);
    let cs = chunk_params(&s, 4, 4);
    assert_eq!(cs.layouts[1].offset, 4 * 5 * 128);
    assert_eq!(mask_offset(&s, 4), 5);
}

#[test]
fn forward_launch_matches_the_kernel_signature() {
    // attn_fwd_d<D>_<t>(const T *q, const T *k, const T *v, T *out, float *lse,
    //                   const u8 *key_padding, AttnParams P)
    let p = separate_params(&shape(10, 100, 100, 64), 1);
    let l = fwd_launch("bf16", 64, [1, 2, 3, 4, 5, 0], &p);
    assert_launch(&l, "attn_fwd_d64_bf16", &[P, P, P, P, P, P, Attn]);
    assert_eq!(l.args[5], Arg::Ptr(0));
    assert_eq!(l.args[6], Arg::Attn(Box::new(p)));
    assert_eq!(l.grid, (4, 10, 1)); // ceil(100 / 32) query tiles of BQ = 32
    assert_eq!(l.block, (128, 1, 1));
    assert_eq!(l.shared, 0);
    let p = separate_params(&shape(10, 100, 100, 128), 1);
    let l = fwd_launch("f32", 128, [1, 2, 3, 4, 5, 6], &p);
    assert_eq!(l.entry, "attn_fwd_d128_f32");
    assert_eq!(l.grid, (7, 10, 1)); // BQ = 16
    assert_known(&l);
    assert_eq!(
        l.sizes().iter().sum::<usize>(),
        6 * 8 + std::mem::size_of::<AttnParams>()
    );
}

#[test]
fn backward_launches_match_the_kernel_signatures() {
    let p = separate_params(&shape(3, 50, 70, 64), 1);
    // attn_bwd_delta_<t>(const T *out, const T *dout, float *delta, AttnParams P, i64 head_dim)
    let l = delta_launch("f16", 64, [1, 2, 3], &p);
    assert_launch(&l, "attn_bwd_delta_f16", &[P, P, P, Attn, I64]);
    assert_eq!(l.args[4], Arg::I64(64));
    // One warp per row: 150 rows, 8 warps per block of 256.
    assert_eq!((l.grid, l.block), ((19, 1, 1), (256, 1, 1)));
    // attn_bwd_dq_d<D>_<t>(q, k, v, dout, const float *lse, const float *delta, T *dq,
    //                      const u8 *key_padding, AttnParams P)
    let l = dq_launch("f16", 64, [1, 2, 3, 4, 5, 6, 7, 8], &p);
    assert_launch(&l, "attn_bwd_dq_d64_f16", &[P, P, P, P, P, P, P, P, Attn]);
    assert_eq!(l.grid, (4, 3, 1)); // ceil(50 / 16)
                                   // attn_bwd_dkdv_d<D>_<t>(q, k, v, dout, lse, delta, T *dk, T *dv, key_padding, P)
    let l = dkdv_launch("f16", 64, [1, 2, 3, 4, 5, 6, 7, 8, 9], &p);
    assert_launch(
        &l,
        "attn_bwd_dkdv_d64_f16",
        &[P, P, P, P, P, P, P, P, P, Attn],
    );
    assert_eq!(l.grid, (5, 3, 1)); // ceil(70 / 16) key blocks
    let p = separate_params(&shape(3, 50, 70, 128), 1);
    assert_eq!(dq_launch("f32", 128, [0; 8], &p).grid, (7, 3, 1)); // BQ = 8
    assert_eq!(dkdv_launch("f32", 128, [0; 9], &p).grid, (9, 3, 1)); // BKB = 8
}

#[test]
fn static_tiles_fit_the_default_shared_memory() {
    for d in HEAD_DIMS {
        for bytes in static_shared_bytes(d) {
            assert!(bytes <= 48 * 1024, "head dim {d}: {bytes} bytes");
        }
    }
    // attn_fwd_d128: Qs[16][128] + Ks[32][129] + Vs[32][128] floats.
    assert_eq!(
        static_shared_bytes(128)[0],
        (16 * 128 + 32 * 129 + 32 * 128) * 4
    );
}

#[test]
fn what_the_kernels_do_not_cover_is_declined() {
    let m = MaskArgs::<CudaStorage> {
        heads: 1,
        key_padding: None,
        bias: None,
    };
    assert_eq!(
        covered(DType::BF16, &shape(1, 1, 1, 128), &m, false),
        Some("bf16")
    );
    assert_eq!(
        covered(DType::F32, &shape(1, 1, 1, 64), &m, false),
        Some("f32")
    );
    assert_eq!(covered(DType::F64, &shape(1, 1, 1, 64), &m, false), None);
    assert_eq!(covered(DType::F32, &shape(1, 1, 1, 96), &m, false), None);
    assert_eq!(covered(DType::F32, &shape(1, 1, 1, 64), &m, true), None);
    // Without a padding mask its heads do not constrain the launches.
    let m = MaskArgs::<CudaStorage> { heads: 70000, ..m };
    assert_eq!(mask_heads(&m), 1);
}
