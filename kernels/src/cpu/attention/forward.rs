//! The forward pass of fused attention (see the parent module for the algorithm).

use rayon::prelude::*;

use super::mask::HeadMask;
use super::{
    check_disjoint, check_operands, transpose_tile, AttentionShape, HeadLayout, Operand, ScoreMask,
    TileScratch, BLOCK_K, BLOCK_Q, PAR_WORK,
};
use crate::cpu::fastmath::exp;
use crate::cpu::tile_gemm::gemm_tile;
use crate::cpu::vecops::{max as vmax, simd, sum, SendPtr};
use crate::Float;

/// Forward over query rows `i0 .. i0 + rows` of batch-head `bh`, writing those rows of `out`
/// (through `out_ptr`, laid out by `ol`) and of `lse` (`lse_bh`, the batch-head's `[seq_q]`).
///
/// `MASKED` instances apply `hm` (padding, bias, skipping key tiles past `hm.key_end`); the
/// unmasked instance never looks at it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_tile<T: Float, const MASKED: bool>(
    sh: &AttentionShape,
    heads: usize,
    bh: usize,
    hm: &HeadMask<'_, T>,
    q: Operand<'_, T>,
    k: Operand<'_, T>,
    v: Operand<'_, T>,
    i0: usize,
    rows: usize,
    out: &mut [T],
    lse: &mut [T],
    scratch: &mut TileScratch<T>,
) {
    let d = sh.head_dim;
    let scale = T::from_f64(sh.scale);
    let (qrs, krs, vrs) = (
        q.layout.row_stride,
        k.layout.row_stride,
        v.layout.row_stride,
    );
    let qb = q.layout.row(heads, bh, i0);
    let kb0 = k.layout.row(heads, bh, 0);
    let vb0 = v.layout.row(heads, bh, 0);
    let TileScratch { kt, s, o, .. } = scratch;
    let mut m = [T::NEG_INFINITY; BLOCK_Q];
    let mut l = [T::ZERO; BLOCK_Q];
    o[..rows * d].fill(T::ZERO);
    let mut kmax = sh.key_limit(i0 + rows - 1);
    if MASKED {
        kmax = kmax.min(hm.key_end);
    }
    let mut kb = 0;
    while kb < kmax {
        let n = (kb + BLOCK_K).min(kmax) - kb;
        transpose_tile(k.data, kb0 + kb * krs, krs, d, n, kt);
        // S = Q Kᵀ for the tile.
        gemm_tile(
            rows,
            n,
            d,
            &q.data[qb..],
            qrs,
            1,
            kt,
            BLOCK_K,
            s,
            BLOCK_K,
            false,
        );
        for r in 0..rows {
            let lim = sh.key_limit(i0 + r).saturating_sub(kb).min(n);
            let srow = &mut s[r * BLOCK_K..r * BLOCK_K + n];
            if lim == 0 {
                srow.fill(T::ZERO);
                continue;
            }
            for x in srow[..lim].iter_mut() {
                *x *= scale;
            }
            if MASKED {
                hm.apply(i0 + r, kb, &mut srow[..lim]);
            }
            let bmax = vmax(&srow[..lim]);
            if MASKED && bmax == T::NEG_INFINITY {
                // Every key of this tile is masked for this row: nothing to add.
                srow.fill(T::ZERO);
                continue;
            }
            let m_old = m[r];
            let m_new = if bmax > m_old { bmax } else { m_old };
            if m_new > m_old && m_old != T::NEG_INFINITY {
                let corr = exp(m_old - m_new);
                l[r] *= corr;
                for x in o[r * d..(r + 1) * d].iter_mut() {
                    *x *= corr;
                }
            }
            m[r] = m_new;
            for x in srow[..lim].iter_mut() {
                *x = exp(*x - m_new);
            }
            srow[lim..].fill(T::ZERO);
            l[r] += sum(srow);
        }
        // O += P V for the tile.
        gemm_tile(
            rows,
            d,
            n,
            s,
            BLOCK_K,
            1,
            &v.data[vb0 + kb * vrs..],
            vrs,
            o,
            d,
            true,
        );
        kb += n;
    }
    for r in 0..rows {
        let orow = &mut out[r * d..(r + 1) * d];
        if l[r] > T::ZERO {
            let inv = T::ONE / l[r];
            for (y, &x) in orow.iter_mut().zip(&o[r * d..(r + 1) * d]) {
                *y = x * inv;
            }
            lse[r] = m[r] + l[r].ln();
        } else {
            // No visible key (seq_k == 0, or all masked): output 0, lse -inf.
            orow.fill(T::ZERO);
            lse[r] = T::NEG_INFINITY;
        }
    }
}

/// `out = softmax(scale · q kᵀ + bias + mask) v` (causal mask from `shape`, padding and bias
/// from `mask`, see [`ScoreMask`]); also writes `lse` (`[batch_heads, seq_q]`), the log-sum-exp
/// of each row of softmax inputs, for the backward pass. All operands contiguous.
///
/// A row that sees no key (`seq_k == 0`, every key masked) gets `out` 0 and `lse` `-inf`.
pub fn attention_forward<T: Float>(
    shape: AttentionShape,
    mask: &ScoreMask<'_, T>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [T],
) {
    let (sq, sk, d) = (shape.seq_q, shape.seq_k, shape.head_dim);
    for (what, buf, len) in [
        ("q", q.len(), shape.batch_heads * sq * d),
        ("k", k.len(), shape.batch_heads * sk * d),
        ("v", v.len(), shape.batch_heads * sk * d),
        ("out", out.len(), shape.batch_heads * sq * d),
    ] {
        assert_eq!(
            buf, len,
            "attention_forward: {what} has {buf} elements, expected {len}"
        );
    }
    let (lq, lk) = (HeadLayout::contiguous(sq, d), HeadLayout::contiguous(sk, d));
    attention_forward_strided(shape, mask, 1, q, lq, k, lk, v, lk, out, lq, lse);
}

/// [`attention_forward`] over operands with any [`HeadLayout`]s (`heads` heads per batch entry;
/// `shape.batch_heads` must be a multiple of it). `lse` is contiguous `[batch_heads, seq_q]`.
/// Panics if a layout leaves its buffer or if rows of `out` overlap each other.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_strided<T: Float>(
    shape: AttentionShape,
    mask: &ScoreMask<'_, T>,
    heads: usize,
    q: &[T],
    ql: HeadLayout,
    k: &[T],
    kl: HeadLayout,
    v: &[T],
    vl: HeadLayout,
    out: &mut [T],
    ol: HeadLayout,
    lse: &mut [T],
) {
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        seq_k,
        head_dim: d,
        ..
    } = shape;
    check_operands(
        &shape,
        heads,
        &[
            ("q", seq_q, ql, q.len()),
            ("k", seq_k, kl, k.len()),
            ("v", seq_k, vl, v.len()),
            ("out", seq_q, ol, out.len()),
        ],
    );
    assert_eq!(
        lse.len(),
        bh * seq_q,
        "attention_forward: lse has {} elements, expected [{bh}, {seq_q}]",
        lse.len()
    );
    mask.check(&shape);
    if bh == 0 || seq_q == 0 {
        return;
    }
    if d == 0 {
        // Every product is 0; out has no elements.
        if mask.is_none() {
            // lse = ln(number of visible keys).
            for (idx, l) in lse.iter_mut().enumerate() {
                let n = shape.key_limit(idx % seq_q);
                *l = if n == 0 {
                    T::NEG_INFINITY
                } else {
                    T::from_f64(n as f64).ln()
                };
            }
        } else {
            // lse = log-sum-exp of the visible keys' bias.
            let mut row = Vec::new();
            for (idx, l) in lse.iter_mut().enumerate() {
                let (b, i) = (idx / seq_q, idx % seq_q);
                let hm = mask.head(&shape, b);
                row.clear();
                row.resize(shape.key_limit(i).min(hm.key_end), T::ZERO);
                hm.apply(i, 0, &mut row);
                let mx = vmax(&row);
                *l = if mx == T::NEG_INFINITY {
                    T::NEG_INFINITY
                } else {
                    mx + row.iter().map(|&x| (x - mx).exp()).sum::<T>().ln()
                };
            }
        }
        return;
    }
    check_disjoint(heads, bh, d, out.len(), &[("out", ol, seq_q)]);
    let (q, k, v) = (
        Operand {
            data: q,
            layout: ql,
        },
        Operand {
            data: k,
            layout: kl,
        },
        Operand {
            data: v,
            layout: vl,
        },
    );
    if mask.is_none() {
        forward_tasks::<T, false>(shape, mask, heads, q, k, v, out, ol, lse);
    } else {
        forward_tasks::<T, true>(shape, mask, heads, q, k, v, out, ol, lse);
    }
}

/// Runs the forward tasks of a checked call (see [`forward_tile`] for `MASKED`).
#[allow(clippy::too_many_arguments)]
fn forward_tasks<T: Float, const MASKED: bool>(
    shape: AttentionShape,
    mask: &ScoreMask<'_, T>,
    heads: usize,
    q: Operand<'_, T>,
    k: Operand<'_, T>,
    v: Operand<'_, T>,
    out: &mut [T],
    ol: HeadLayout,
    lse: &mut [T],
) {
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        head_dim: d,
        ..
    } = shape;
    let tiles = seq_q.div_ceil(BLOCK_Q);
    let out_len = out.len();
    let out_ptr = SendPtr(out.as_mut_ptr());
    let lse_ptr = SendPtr(lse.as_mut_ptr());
    let task = |t: usize, scratch: &mut TileScratch<T>, buf: &mut Vec<T>| {
        let (b, qt) = (t / tiles, t % tiles);
        let i0 = qt * BLOCK_Q;
        let rows = BLOCK_Q.min(seq_q - i0);
        buf.resize(rows * d, T::ZERO);
        // SAFETY: each task owns lse elements b*seq_q + i0 .. + rows (distinct per task, inside
        // the [bh, seq_q] buffer checked above).
        let lse_t =
            unsafe { std::slice::from_raw_parts_mut(lse_ptr.get().add(b * seq_q + i0), rows) };
        let hm = if MASKED {
            mask.head(&shape, b)
        } else {
            HeadMask::unmasked(shape.seq_k)
        };
        simd(
            #[inline(always)]
            || {
                forward_tile::<T, MASKED>(
                    &shape, heads, b, &hm, q, k, v, i0, rows, buf, lse_t, scratch,
                )
            },
        );
        for r in 0..rows {
            let at = ol.row(heads, b, i0 + r);
            debug_assert!(at + d <= out_len);
            // SAFETY: `at .. at + d` is row i0 + r of batch-head b of `out`: inside the buffer
            // (extent checked) and disjoint from every other row (checked by check_disjoint),
            // and each row belongs to exactly one task.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), d) };
            dst.copy_from_slice(&buf[r * d..(r + 1) * d]);
        }
    };
    let ntasks = bh * tiles;
    if shape.work() < PAR_WORK {
        let mut scratch = TileScratch::new(d, false);
        let mut buf = Vec::new();
        for t in 0..ntasks {
            task(t, &mut scratch, &mut buf);
        }
    } else {
        (0..ntasks).into_par_iter().for_each_init(
            || (TileScratch::new(d, false), Vec::new()),
            |(scratch, buf), t| task(t, scratch, buf),
        );
    }
}
