//! The backward pass of fused attention (see the parent module for the algorithm).

use rayon::prelude::*;

use super::mask::HeadMask;
use super::{
    check_disjoint, check_operands, transpose_tile, AttentionShape, HeadLayout, Operand, ScoreMask,
    TileScratch, BLOCK_K, BLOCK_Q, PAR_WORK,
};
use crate::cpu::fastmath::exp;
use crate::cpu::tile_gemm::gemm_tile;
use crate::cpu::vecops::{dot, simd, SendPtr};
use crate::Float;

/// Backward for one batch-head `bh`; `dq_loc` (`[seq_q, d]`), `dk_loc`, `dv_loc` (`[seq_k, d]`)
/// are the task's contiguous results, `dz_loc` (`[seq_q, seq_k]`, when wanted) the gradient of
/// the batch-head's softmax inputs (0 where masked).
///
/// `MASKED` instances apply `hm` and write `dz_loc`; the unmasked instance never looks at
/// either.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_head<T: Float, const MASKED: bool>(
    sh: &AttentionShape,
    heads: usize,
    bh: usize,
    hm: &HeadMask<'_, T>,
    q: Operand<'_, T>,
    k: Operand<'_, T>,
    v: Operand<'_, T>,
    out: Operand<'_, T>,
    dout: Operand<'_, T>,
    lse: &[T],
    dq_loc: &mut [T],
    dk_loc: &mut [T],
    dv_loc: &mut [T],
    mut dz_loc: Option<&mut [T]>,
    dvec: &mut Vec<T>,
    scratch: &mut TileScratch<T>,
) {
    let d = sh.head_dim;
    let (seq_q, seq_k) = (sh.seq_q, sh.seq_k);
    let scale = T::from_f64(sh.scale);
    dq_loc.fill(T::ZERO);
    dk_loc.fill(T::ZERO);
    dv_loc.fill(T::ZERO);
    if let Some(dz) = dz_loc.as_deref_mut() {
        dz.fill(T::ZERO);
    }
    if seq_q == 0 {
        return;
    }
    let (qrs, krs, vrs, dors) = (
        q.layout.row_stride,
        k.layout.row_stride,
        v.layout.row_stride,
        dout.layout.row_stride,
    );
    let qb0 = q.layout.row(heads, bh, 0);
    let kb0 = k.layout.row(heads, bh, 0);
    let vb0 = v.layout.row(heads, bh, 0);
    let dob0 = dout.layout.row(heads, bh, 0);
    // D_i = dout_i · out_i
    dvec.clear();
    dvec.extend((0..seq_q).map(|i| {
        let o = out.layout.row(heads, bh, i);
        let g = dob0 + i * dors;
        dot(&dout.data[g..g + d], &out.data[o..o + d])
    }));
    let TileScratch { kt, vt, s, dp, .. } = scratch;
    let mut kmax_all = sh.key_limit(seq_q - 1);
    if MASKED {
        kmax_all = kmax_all.min(hm.key_end);
    }
    let mut kb = 0;
    while kb < kmax_all {
        let n = (kb + BLOCK_K).min(kmax_all) - kb;
        transpose_tile(k.data, kb0 + kb * krs, krs, d, n, kt);
        transpose_tile(v.data, vb0 + kb * vrs, vrs, d, n, vt);
        let mut i0 = sh.first_row_seeing(kb);
        while i0 < seq_q {
            let rows = BLOCK_Q.min(seq_q - i0);
            let qi = qb0 + i0 * qrs;
            let gi = dob0 + i0 * dors;
            // S = Q Kᵀ and dP = dO Vᵀ for the tile.
            gemm_tile(
                rows,
                n,
                d,
                &q.data[qi..],
                qrs,
                1,
                kt,
                BLOCK_K,
                s,
                BLOCK_K,
                false,
            );
            gemm_tile(
                rows,
                n,
                d,
                &dout.data[gi..],
                dors,
                1,
                vt,
                BLOCK_K,
                dp,
                BLOCK_K,
                false,
            );
            for r in 0..rows {
                let i = i0 + r;
                let mut lim = sh.key_limit(i).saturating_sub(kb).min(n);
                let (lse_i, d_i) = (lse[i], dvec[i]);
                let prow = &mut s[r * BLOCK_K..r * BLOCK_K + n];
                let dsrow = &mut dp[r * BLOCK_K..r * BLOCK_K + n];
                if !MASKED {
                    for (p, ds) in prow[..lim].iter_mut().zip(dsrow[..lim].iter_mut()) {
                        let pv = exp(scale * *p - lse_i);
                        *p = pv;
                        *ds = scale * (pv * (*ds - d_i));
                    }
                } else {
                    if lse_i == T::NEG_INFINITY {
                        // The row saw no key: no probability, no gradient.
                        lim = 0;
                    }
                    for p in prow[..lim].iter_mut() {
                        *p *= scale;
                    }
                    hm.apply(i, kb, &mut prow[..lim]);
                    let mut dz_row = dz_loc
                        .as_deref_mut()
                        .map(|dz| &mut dz[i * seq_k + kb..i * seq_k + kb + lim]);
                    for (j, (p, ds)) in prow[..lim]
                        .iter_mut()
                        .zip(dsrow[..lim].iter_mut())
                        .enumerate()
                    {
                        let pv = exp(*p - lse_i);
                        *p = pv;
                        let dz = pv * (*ds - d_i);
                        if let Some(row) = dz_row.as_deref_mut() {
                            row[j] = dz;
                        }
                        *ds = scale * dz;
                    }
                }
                prow[lim..].fill(T::ZERO);
                dsrow[lim..].fill(T::ZERO);
            }
            // dV += Pᵀ dO, dK += dSᵀ Q (over this block's rows, in increasing order).
            gemm_tile(
                n,
                d,
                rows,
                s,
                1,
                BLOCK_K,
                &dout.data[gi..],
                dors,
                dv_loc[kb * d..].as_mut(),
                d,
                true,
            );
            gemm_tile(
                n,
                d,
                rows,
                dp,
                1,
                BLOCK_K,
                &q.data[qi..],
                qrs,
                dk_loc[kb * d..].as_mut(),
                d,
                true,
            );
            // dQ += dS K (over this tile's keys, in increasing order).
            gemm_tile(
                rows,
                d,
                n,
                dp,
                BLOCK_K,
                1,
                &k.data[kb0 + kb * krs..],
                krs,
                dq_loc[i0 * d..].as_mut(),
                d,
                true,
            );
            i0 += rows;
        }
        kb += n;
    }
}

/// Backward of [`attention_forward`](super::attention_forward) from `dout` (with the same
/// `mask`), recomputing probabilities from `lse`; overwrites `dq`, `dk`, `dv`, and `dbias` when
/// given: the gradient of the softmax inputs (`[batch_heads, seq_q, seq_k]`, contiguous; 0
/// where masked), which a caller sums over the dimensions its bias was broadcast along. All
/// operands contiguous.
///
/// Gradients are accumulated in a fixed order for any thread count (see the module
/// documentation).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    shape: AttentionShape,
    mask: &ScoreMask<'_, T>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    lse: &[T],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    dbias: Option<&mut [T]>,
) {
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        seq_k,
        head_dim: d,
        ..
    } = shape;
    for (what, buf, len) in [
        ("q", q.len(), bh * seq_q * d),
        ("k", k.len(), bh * seq_k * d),
        ("v", v.len(), bh * seq_k * d),
        ("out", out.len(), bh * seq_q * d),
        ("dout", dout.len(), bh * seq_q * d),
        ("lse", lse.len(), bh * seq_q),
        ("dq", dq.len(), bh * seq_q * d),
        ("dk", dk.len(), bh * seq_k * d),
        ("dv", dv.len(), bh * seq_k * d),
    ] {
        assert_eq!(
            buf, len,
            "attention_backward: {what} has {buf} elements, expected {len}"
        );
    }
    let (lq, lk) = (
        HeadLayout::contiguous(seq_q, d),
        HeadLayout::contiguous(seq_k, d),
    );
    // The three gradients go to one buffer through the strided entry point.
    let nq = bh * seq_q * d;
    let nk = bh * seq_k * d;
    let mut g = vec![T::ZERO; nq + 2 * nk];
    let at = |off: usize, l: HeadLayout| HeadLayout { offset: off, ..l };
    attention_backward_strided(
        shape,
        mask,
        1,
        q,
        lq,
        k,
        lk,
        v,
        lk,
        out,
        lq,
        lse,
        dout,
        lq,
        &mut g,
        [at(0, lq), at(nq, lk), at(nq + nk, lk)],
        dbias,
    );
    dq.copy_from_slice(&g[..nq]);
    dk.copy_from_slice(&g[nq..nq + nk]);
    dv.copy_from_slice(&g[nq + nk..]);
}

/// [`attention_backward`] over operands with any [`HeadLayout`]s (`heads` heads per batch
/// entry). The three gradients are written (overwritten) into one buffer `grads` at the layouts
/// `grad_layouts = [dq, dk, dv]`, which must not overlap (checked: it panics otherwise); a fused
/// `[B, T, 3C]` qkv gradient is one such buffer. `lse` is contiguous `[batch_heads, seq_q]`;
/// `dbias` as for [`attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_strided<T: Float>(
    shape: AttentionShape,
    mask: &ScoreMask<'_, T>,
    heads: usize,
    q: &[T],
    ql: HeadLayout,
    k: &[T],
    kl: HeadLayout,
    v: &[T],
    vl: HeadLayout,
    out: &[T],
    ol: HeadLayout,
    lse: &[T],
    dout: &[T],
    dol: HeadLayout,
    grads: &mut [T],
    grad_layouts: [HeadLayout; 3],
    mut dbias: Option<&mut [T]>,
) {
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        seq_k,
        head_dim: d,
        ..
    } = shape;
    let [dql, dkl, dvl] = grad_layouts;
    check_operands(
        &shape,
        heads,
        &[
            ("q", seq_q, ql, q.len()),
            ("k", seq_k, kl, k.len()),
            ("v", seq_k, vl, v.len()),
            ("out", seq_q, ol, out.len()),
            ("dout", seq_q, dol, dout.len()),
            ("dq", seq_q, dql, grads.len()),
            ("dk", seq_k, dkl, grads.len()),
            ("dv", seq_k, dvl, grads.len()),
        ],
    );
    assert_eq!(
        lse.len(),
        bh * seq_q,
        "attention_backward: lse has {} elements, expected {}",
        lse.len(),
        bh * seq_q
    );
    mask.check(&shape);
    if let Some(dz) = dbias.as_deref_mut() {
        assert_eq!(
            dz.len(),
            bh * seq_q * seq_k,
            "attention_backward: dbias has {} elements, expected [{bh}, {seq_q}, {seq_k}]",
            dz.len()
        );
        if d == 0 {
            // dP = 0 and D = 0, so every softmax-input gradient is 0.
            dz.fill(T::ZERO);
        }
    }
    if bh == 0 || d == 0 {
        return;
    }
    check_disjoint(
        heads,
        bh,
        d,
        grads.len(),
        &[("dq", dql, seq_q), ("dk", dkl, seq_k), ("dv", dvl, seq_k)],
    );
    let op = |data, layout| Operand { data, layout };
    let ops = [op(q, ql), op(k, kl), op(v, vl), op(out, ol), op(dout, dol)];
    if mask.is_none() && dbias.is_none() {
        backward_tasks::<T, false>(shape, mask, heads, ops, lse, grads, grad_layouts, None);
    } else {
        backward_tasks::<T, true>(shape, mask, heads, ops, lse, grads, grad_layouts, dbias);
    }
}

/// Runs the backward tasks of a checked call (see [`backward_head`] for `MASKED`); `ops` are
/// q, k, v, out and dout.
#[allow(clippy::too_many_arguments)]
fn backward_tasks<T: Float, const MASKED: bool>(
    shape: AttentionShape,
    mask: &ScoreMask<'_, T>,
    heads: usize,
    ops: [Operand<'_, T>; 5],
    lse: &[T],
    grads: &mut [T],
    grad_layouts: [HeadLayout; 3],
    dbias: Option<&mut [T]>,
) {
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        seq_k,
        head_dim: d,
        ..
    } = shape;
    let [dql, dkl, dvl] = grad_layouts;
    let [q, k, v, out, dout] = ops;
    let gptr = SendPtr(grads.as_mut_ptr());
    let dz_ptr = dbias.map(|dz| SendPtr(dz.as_mut_ptr()));
    let dz_len = seq_q * seq_k;
    struct Bufs<T> {
        dq: Vec<T>,
        dk: Vec<T>,
        dv: Vec<T>,
        dvec: Vec<T>,
        scratch: TileScratch<T>,
    }
    let new_bufs = || Bufs {
        dq: vec![T::ZERO; seq_q * d],
        dk: vec![T::ZERO; seq_k * d],
        dv: vec![T::ZERO; seq_k * d],
        dvec: Vec::new(),
        scratch: TileScratch::new(d, true),
    };
    let task = |b: usize, w: &mut Bufs<T>| {
        let hm = if MASKED {
            mask.head(&shape, b)
        } else {
            HeadMask::unmasked(seq_k)
        };
        // SAFETY: batch-head b's [seq_q, seq_k] block of the [bh, seq_q, seq_k] buffer (length
        // checked by the caller) belongs to this task alone.
        let dz = dz_ptr
            .map(|p| unsafe { std::slice::from_raw_parts_mut(p.get().add(b * dz_len), dz_len) });
        simd(
            #[inline(always)]
            || {
                backward_head::<T, MASKED>(
                    &shape,
                    heads,
                    b,
                    &hm,
                    q,
                    k,
                    v,
                    out,
                    dout,
                    &lse[b * seq_q..(b + 1) * seq_q],
                    &mut w.dq,
                    &mut w.dk,
                    &mut w.dv,
                    dz,
                    &mut w.dvec,
                    &mut w.scratch,
                )
            },
        );
        for (l, seq, src) in [
            (dql, seq_q, &w.dq),
            (dkl, seq_k, &w.dk),
            (dvl, seq_k, &w.dv),
        ] {
            for t in 0..seq {
                let at = l.row(heads, b, t);
                // SAFETY: `at .. at + d` is row t of batch-head b of one gradient: inside
                // `grads` (extents checked) and disjoint from every other written row (checked by
                // check_disjoint); each (gradient, batch-head) belongs to exactly one task.
                let dst = unsafe { std::slice::from_raw_parts_mut(gptr.get().add(at), d) };
                dst.copy_from_slice(&src[t * d..(t + 1) * d]);
            }
        }
    };
    if shape.work() < PAR_WORK || bh == 1 {
        let mut w = new_bufs();
        for b in 0..bh {
            task(b, &mut w);
        }
    } else {
        (0..bh)
            .into_par_iter()
            .for_each_init(new_bufs, |w, b| task(b, w));
    }
}
