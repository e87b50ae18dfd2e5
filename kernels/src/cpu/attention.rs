//! Fused scaled dot-product attention (flash-attention style: online softmax, no score matrix
//! kept), forward and backward.
//!
//! Both passes work on tiles of [`BLOCK_K`] keys (the forward also on tiles of [`BLOCK_Q`] query
//! rows) so that a key/value tile is reused from cache by every query row. Each key (and, in the
//! backward, value) tile is transposed once into a `[head_dim, BLOCK_K]` scratch so that a row's
//! scores for the whole tile come from `head_dim` vectorised axpys, with no horizontal sums. Key
//! tiles wholly past the causal limit are never visited, and within a tile each row stops at its
//! own limit.
//!
//! Forward: tasks are (batch-head, query tile) pairs, run in parallel when the problem is large.
//! Per row, the online softmax keeps a running max `m`, running sum `l` and an unnormalised
//! accumulator (kept in `out`), rescaled by `exp(m_old - m_new)` when the max grows.
//!
//! Backward: one task per batch-head (each writes only its own slices of `dq`, `dk`, `dv`), so
//! every gradient element is accumulated in a fixed order (query rows increasing for `dk`/`dv`,
//! keys increasing for `dq`) whatever the thread count. Probabilities are recomputed as
//! `P = exp(scale q·k - lse)`; with `D_i = dout_i · out_i`, `dS = P (dout·v - D_i)`, and
//! `dv += Pᵀ dout`, `dq += scale dS k`, `dk += scale dSᵀ q`.
//!
//! All arithmetic is in `T` (f32 uses the crate's vectorised `exp`). Scores `q·k` and `dout·v`
//! are summed over the head dimension in increasing order, `D_i` and the running sum `l` in the
//! crate's fixed lane order; nothing depends on the thread count.

use rayon::prelude::*;

use super::fastmath::exp;
use super::vecops::{axpy, dot, scale as scale_slice, simd, sum};
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

    fn check<T>(&self, q: &[T], k: &[T], v: &[T]) {
        let AttentionShape {
            batch_heads: bh,
            seq_q,
            seq_k,
            head_dim: d,
            ..
        } = *self;
        assert!(
            !self.causal || seq_k >= seq_q,
            "attention: causal masking needs seq_k >= seq_q, got seq_q {seq_q}, seq_k {seq_k}"
        );
        assert_eq!(
            q.len(),
            bh * seq_q * d,
            "attention: q has {} elements, expected [{bh}, {seq_q}, {d}]",
            q.len()
        );
        assert_eq!(
            k.len(),
            bh * seq_k * d,
            "attention: k has {} elements, expected [{bh}, {seq_k}, {d}]",
            k.len()
        );
        assert_eq!(
            v.len(),
            bh * seq_k * d,
            "attention: v has {} elements, expected [{bh}, {seq_k}, {d}]",
            v.len()
        );
    }

    fn work(&self) -> usize {
        self.batch_heads
            .saturating_mul(self.seq_q)
            .saturating_mul(self.seq_k)
            .saturating_mul(self.head_dim)
    }
}

/// Copies rows `kb .. kb + n` of the `[*, d]` matrix `src` transposed into `dst` as a
/// `[d, BLOCK_K]` tile: `dst[c * BLOCK_K + jj] = src[(kb + jj) * d + c]`.
#[inline(always)]
fn transpose_tile<T: Float>(src: &[T], d: usize, kb: usize, n: usize, dst: &mut [T]) {
    for jj in 0..n {
        let row = &src[(kb + jj) * d..(kb + jj + 1) * d];
        for (c, &x) in row.iter().enumerate() {
            dst[c * BLOCK_K + jj] = x;
        }
    }
}

/// `s[jj] = Σ_c x[c] · tile[c][jj]` for `jj < s.len()`, summed over `c` in increasing order
/// (one vectorised axpy per `c`); `tile` is a `[d, BLOCK_K]` transposed tile.
#[inline(always)]
fn tile_scores<T: Float>(x: &[T], tile: &[T], s: &mut [T]) {
    let n = s.len();
    for (c, &xc) in x.iter().enumerate() {
        let t = &tile[c * BLOCK_K..c * BLOCK_K + n];
        if c == 0 {
            for (o, &tv) in s.iter_mut().zip(t) {
                *o = xc * tv;
            }
        } else {
            axpy(s, xc, t);
        }
    }
}

/// Forward over one query tile of one batch-head: rows `i0 .. i0 + lse.len()`; `q`, `k`, `v`
/// are the batch-head's slices, `out` / `lse` the tile's rows.
///
/// Scores are `scale * (Σ_c q_c k_c)` with the sum over `c` in increasing order; the running
/// sum `l` adds each key tile's probabilities in the crate's lane order.
#[inline(always)]
fn forward_tile<T: Float>(
    sh: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    i0: usize,
    out: &mut [T],
    lse: &mut [T],
) {
    let d = sh.head_dim;
    let rows = lse.len();
    let scale = T::from_f64(sh.scale);
    let mut m = [T::NEG_INFINITY; BLOCK_Q];
    let mut l = [T::ZERO; BLOCK_Q];
    let mut s = [T::ZERO; BLOCK_K];
    let mut kt = vec![T::ZERO; d * BLOCK_K];
    out.fill(T::ZERO);
    let kmax = sh.key_limit(i0 + rows - 1);
    let mut kb = 0;
    while kb < kmax {
        let kend = (kb + BLOCK_K).min(kmax);
        transpose_tile(k, d, kb, kend - kb, &mut kt);
        for r in 0..rows {
            let lim = sh.key_limit(i0 + r).min(kend);
            if lim <= kb {
                continue;
            }
            let n = lim - kb;
            let qi = &q[(i0 + r) * d..(i0 + r + 1) * d];
            let s = &mut s[..n];
            tile_scores(qi, &kt, s);
            let mut block_max = T::NEG_INFINITY;
            for sj in s.iter_mut() {
                *sj *= scale;
                block_max = if *sj > block_max { *sj } else { block_max };
            }
            let acc = &mut out[r * d..(r + 1) * d];
            let m_old = m[r];
            if block_max > m_old {
                if m_old != T::NEG_INFINITY {
                    let corr = exp(m_old - block_max);
                    l[r] *= corr;
                    scale_slice(acc, corr);
                }
                m[r] = block_max;
            }
            let m_new = m[r];
            for sj in s.iter_mut() {
                *sj = exp(*sj - m_new);
            }
            l[r] += sum(s);
            for (jj, &p) in s.iter().enumerate() {
                let j = kb + jj;
                axpy(acc, p, &v[j * d..(j + 1) * d]);
            }
        }
        kb = kend;
    }
    for r in 0..rows {
        if l[r] > T::ZERO {
            scale_slice(&mut out[r * d..(r + 1) * d], T::ONE / l[r]);
            lse[r] = m[r] + l[r].ln();
        } else {
            // No visible key (seq_k == 0): output 0, lse -inf.
            lse[r] = T::NEG_INFINITY;
        }
    }
}

/// `out = softmax(scale · q kᵀ + mask) v`; also writes `lse` (`[batch_heads, seq_q]`), the
/// log-sum-exp of each row of scaled scores, for the backward pass.
///
/// With `seq_k == 0` every row sees no key: `out` is 0 and `lse` is `-inf`.
pub fn attention_forward<T: Float>(
    shape: AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [T],
) {
    shape.check(q, k, v);
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        seq_k,
        head_dim: d,
        ..
    } = shape;
    assert_eq!(
        out.len(),
        bh * seq_q * d,
        "attention_forward: out has {} elements, expected [{bh}, {seq_q}, {d}]",
        out.len()
    );
    assert_eq!(
        lse.len(),
        bh * seq_q,
        "attention_forward: lse has {} elements, expected [{bh}, {seq_q}]",
        lse.len()
    );
    if bh == 0 || seq_q == 0 {
        return;
    }
    if d == 0 {
        // Every score is 0: lse = ln(number of visible keys); out has no elements.
        for (idx, l) in lse.iter_mut().enumerate() {
            let n = shape.key_limit(idx % seq_q);
            *l = if n == 0 {
                T::NEG_INFINITY
            } else {
                T::from_f64(n as f64).ln()
            };
        }
        return;
    }
    let per_head = |b: usize, out_h: &mut [T], lse_h: &mut [T], parallel: bool| {
        let qh = &q[b * seq_q * d..(b + 1) * seq_q * d];
        let kh = &k[b * seq_k * d..(b + 1) * seq_k * d];
        let vh = &v[b * seq_k * d..(b + 1) * seq_k * d];
        let tile = |t: usize, o: &mut [T], l: &mut [T]| {
            simd(
                #[inline(always)]
                || forward_tile(&shape, qh, kh, vh, t * BLOCK_Q, o, l),
            )
        };
        if parallel {
            out_h
                .par_chunks_mut(BLOCK_Q * d)
                .zip(lse_h.par_chunks_mut(BLOCK_Q))
                .enumerate()
                .for_each(|(t, (o, l))| tile(t, o, l));
        } else {
            for (t, (o, l)) in out_h
                .chunks_mut(BLOCK_Q * d)
                .zip(lse_h.chunks_mut(BLOCK_Q))
                .enumerate()
            {
                tile(t, o, l);
            }
        }
    };
    if shape.work() < PAR_WORK {
        for (b, (o, l)) in out
            .chunks_mut(seq_q * d)
            .zip(lse.chunks_mut(seq_q))
            .enumerate()
        {
            per_head(b, o, l, false);
        }
    } else {
        out.par_chunks_mut(seq_q * d)
            .zip(lse.par_chunks_mut(seq_q))
            .enumerate()
            .for_each(|(b, (o, l))| per_head(b, o, l, true));
    }
}

/// Backward for one batch-head; all slices are that batch-head's.
///
/// Scores and `dout · v` are recomputed per key tile from transposed tiles (sums over the head
/// dimension in increasing order); `dv_j`, `dk_j` accumulate over query rows in increasing
/// order, `dq_i` over keys in increasing order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_head<T: Float>(
    sh: &AttentionShape,
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
    let d = sh.head_dim;
    let seq_q = sh.seq_q;
    let scale = T::from_f64(sh.scale);
    dq.fill(T::ZERO);
    dk.fill(T::ZERO);
    dv.fill(T::ZERO);
    // D_i = dout_i · out_i
    let dvec: Vec<T> = (0..seq_q)
        .map(|i| dot(&dout[i * d..(i + 1) * d], &out[i * d..(i + 1) * d]))
        .collect();
    let mut kt = vec![T::ZERO; d * BLOCK_K];
    let mut vt = vec![T::ZERO; d * BLOCK_K];
    let mut p = [T::ZERO; BLOCK_K];
    let mut ds = [T::ZERO; BLOCK_K];
    let mut kb = 0;
    let kmax_all = sh.key_limit(seq_q.max(1) - 1);
    // Key tiles outer (each K/V tile is transposed once), query rows inner in increasing order.
    while kb < kmax_all && seq_q > 0 {
        let kend = (kb + BLOCK_K).min(kmax_all);
        transpose_tile(k, d, kb, kend - kb, &mut kt);
        transpose_tile(v, d, kb, kend - kb, &mut vt);
        for i in 0..seq_q {
            let lim = sh.key_limit(i).min(kend);
            if lim <= kb {
                continue;
            }
            let n = lim - kb;
            let qi = &q[i * d..(i + 1) * d];
            let doi = &dout[i * d..(i + 1) * d];
            let (lse_i, d_i) = (lse[i], dvec[i]);
            let (p, ds) = (&mut p[..n], &mut ds[..n]);
            tile_scores(qi, &kt, p);
            for pj in p.iter_mut() {
                *pj = exp(scale * *pj - lse_i);
            }
            tile_scores(doi, &vt, ds);
            for (dsj, &pj) in ds.iter_mut().zip(p.iter()) {
                *dsj = scale * (pj * (*dsj - d_i));
            }
            for (jj, (&pj, &dsj)) in p.iter().zip(ds.iter()).enumerate() {
                let j = kb + jj;
                axpy(&mut dv[j * d..(j + 1) * d], pj, doi);
                axpy(&mut dk[j * d..(j + 1) * d], dsj, qi);
            }
            let dqi = &mut dq[i * d..(i + 1) * d];
            for (jj, &dsj) in ds.iter().enumerate() {
                let j = kb + jj;
                axpy(dqi, dsj, &k[j * d..(j + 1) * d]);
            }
        }
        kb = kend;
    }
}

/// Backward of [`attention_forward`] from `dout`, recomputing probabilities from `lse`;
/// overwrites `dq`, `dk`, `dv`.
///
/// Gradients are accumulated in a fixed order for any thread count (see the module
/// documentation).
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
    shape.check(q, k, v);
    let AttentionShape {
        batch_heads: bh,
        seq_q,
        seq_k,
        head_dim: d,
        ..
    } = shape;
    for (what, buf, len) in [
        ("out", out, bh * seq_q * d),
        ("dout", dout, bh * seq_q * d),
        ("lse", lse, bh * seq_q),
        ("dq", &*dq, bh * seq_q * d),
        ("dk", &*dk, bh * seq_k * d),
        ("dv", &*dv, bh * seq_k * d),
    ] {
        assert_eq!(
            buf.len(),
            len,
            "attention_backward: {what} has {} elements, expected {len}",
            buf.len()
        );
    }
    if bh == 0 || d == 0 {
        return;
    }
    let head = |b: usize, dq: &mut [T], dk: &mut [T], dv: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                let qs = b * seq_q * d..(b + 1) * seq_q * d;
                let ks = b * seq_k * d..(b + 1) * seq_k * d;
                backward_head(
                    &shape,
                    &q[qs.clone()],
                    &k[ks.clone()],
                    &v[ks],
                    &out[qs.clone()],
                    &lse[b * seq_q..(b + 1) * seq_q],
                    &dout[qs],
                    dq,
                    dk,
                    dv,
                );
            },
        )
    };
    // Below the threshold (which includes every empty sequence) run on this thread.
    if shape.work() < PAR_WORK || bh == 1 {
        for b in 0..bh {
            let (dq, dk, dv) = (
                &mut dq[b * seq_q * d..(b + 1) * seq_q * d],
                &mut dk[b * seq_k * d..(b + 1) * seq_k * d],
                &mut dv[b * seq_k * d..(b + 1) * seq_k * d],
            );
            head(b, dq, dk, dv);
        }
    } else {
        dq.par_chunks_mut(seq_q * d)
            .zip(
                dk.par_chunks_mut(seq_k * d)
                    .zip(dv.par_chunks_mut(seq_k * d)),
            )
            .enumerate()
            .for_each(|(b, (dq, (dk, dv)))| head(b, dq, dk, dv));
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, dot64, to_f32, to_f64, Rng};

    /// Naive f64 attention: explicit masked score rows, explicit softmax. Returns (out, lse, P)
    /// with `P` the full `[bh, seq_q, seq_k]` probability tensor (0 where masked).
    fn forward_ref(
        sh: &AttentionShape,
        q: &[f64],
        k: &[f64],
        v: &[f64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let AttentionShape {
            batch_heads: bh,
            seq_q: sq,
            seq_k: sk,
            head_dim: d,
            causal,
            scale,
        } = *sh;
        let mut out = vec![0.0; bh * sq * d];
        let mut lse = vec![0.0; bh * sq];
        let mut probs = vec![0.0; bh * sq * sk];
        for b in 0..bh {
            for i in 0..sq {
                let visible: Vec<usize> =
                    (0..sk).filter(|&j| !causal || j + sq <= i + sk).collect();
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        scale
                            * (0..d)
                                .map(|c| q[(b * sq + i) * d + c] * k[(b * sk + j) * d + c])
                                .sum::<f64>()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                lse[b * sq + i] = m + z.ln();
                for (&j, &s) in visible.iter().zip(&scores) {
                    let p = (s - m).exp() / z;
                    probs[(b * sq + i) * sk + j] = p;
                    for c in 0..d {
                        out[(b * sq + i) * d + c] += p * v[(b * sk + j) * d + c];
                    }
                }
            }
        }
        (out, lse, probs)
    }

    /// Naive f64 backward through the explicit softmax Jacobian (no lse / D shortcuts).
    fn backward_ref(
        sh: &AttentionShape,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        dout: &[f64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let AttentionShape {
            batch_heads: bh,
            seq_q: sq,
            seq_k: sk,
            head_dim: d,
            scale,
            ..
        } = *sh;
        let (_, _, p) = forward_ref(sh, q, k, v);
        let mut dq = vec![0.0; bh * sq * d];
        let mut dk = vec![0.0; bh * sk * d];
        let mut dv = vec![0.0; bh * sk * d];
        for b in 0..bh {
            for i in 0..sq {
                let prow = &p[(b * sq + i) * sk..(b * sq + i + 1) * sk];
                // dP_ij = dout_i · v_j
                let dp: Vec<f64> = (0..sk)
                    .map(|j| {
                        (0..d)
                            .map(|c| dout[(b * sq + i) * d + c] * v[(b * sk + j) * d + c])
                            .sum()
                    })
                    .collect();
                for j in 0..sk {
                    // dS_ij = Σ_j' dP_ij' · ∂P_ij'/∂S_ij = Σ_j' dP_ij' P_ij' (δ_jj' - P_ij)
                    let mut dsij = 0.0;
                    for jp in 0..sk {
                        let delta = if j == jp { 1.0 } else { 0.0 };
                        dsij += dp[jp] * prow[jp] * (delta - prow[j]);
                    }
                    for c in 0..d {
                        dv[(b * sk + j) * d + c] += prow[j] * dout[(b * sq + i) * d + c];
                        dq[(b * sq + i) * d + c] += scale * dsij * k[(b * sk + j) * d + c];
                        dk[(b * sk + j) * d + c] += scale * dsij * q[(b * sq + i) * d + c];
                    }
                }
            }
        }
        (dq, dk, dv)
    }

    fn shape(bh: usize, sq: usize, sk: usize, d: usize, causal: bool) -> AttentionShape {
        AttentionShape {
            batch_heads: bh,
            seq_q: sq,
            seq_k: sk,
            head_dim: d,
            causal,
            scale: 1.0 / (d.max(1) as f64).sqrt(),
        }
    }

    fn cases() -> Vec<AttentionShape> {
        let mut v = Vec::new();
        for causal in [false, true] {
            v.push(shape(1, 1, 1, 1, causal));
            v.push(shape(2, 5, 5, 8, causal));
            v.push(shape(3, 7, 13, 16, causal));
            v.push(shape(1, 1, 70, 32, causal));
            v.push(shape(2, 33, 65, 24, causal));
            v.push(shape(2, 70, 130, 32, causal));
            v.push(shape(3, 64, 64, 64, causal));
            v.push(shape(2, 100, 100, 64, causal));
        }
        v.push(shape(2, 40, 20, 16, false)); // seq_q > seq_k without mask
        v
    }

    fn inputs(rng: &mut Rng, sh: &AttentionShape) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let nq = sh.batch_heads * sh.seq_q * sh.head_dim;
        let nk = sh.batch_heads * sh.seq_k * sh.head_dim;
        // Larger q so the softmax is not flat and the running max changes across key tiles.
        (
            rng.vec(nq, -3.0, 3.0),
            rng.vec(nk, -1.5, 1.5),
            rng.vec(nk, -1.0, 1.0),
        )
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng(0xa77e);
        for sh in cases() {
            let (q, k, v) = inputs(&mut rng, &sh);
            let (ow, lw, _) = forward_ref(&sh, &q, &k, &v);
            let mut out = vec![f64::NAN; q.len()];
            let mut lse = vec![f64::NAN; sh.batch_heads * sh.seq_q];
            attention_forward(sh, &q, &k, &v, &mut out, &mut lse);
            assert_close(&format!("attn out f64 {sh:?}"), &out, &ow, 1e-10, 1e-12);
            assert_close(&format!("attn lse f64 {sh:?}"), &lse, &lw, 1e-12, 1e-12);

            let (q32, k32, v32) = (to_f32(&q), to_f32(&k), to_f32(&v));
            let (ow, lw, _) = forward_ref(&sh, &to_f64(&q32), &to_f64(&k32), &to_f64(&v32));
            let mut out32 = vec![f32::NAN; q.len()];
            let mut lse32 = vec![f32::NAN; sh.batch_heads * sh.seq_q];
            attention_forward(sh, &q32, &k32, &v32, &mut out32, &mut lse32);
            assert_close(
                &format!("attn out f32 {sh:?}"),
                &to_f64(&out32),
                &ow,
                1e-4,
                1e-5,
            );
            assert_close(
                &format!("attn lse f32 {sh:?}"),
                &to_f64(&lse32),
                &lw,
                1e-5,
                1e-5,
            );
        }
    }

    #[test]
    fn causal_first_row_sees_only_the_first_keys() {
        // seq_q < seq_k: row 0 sees keys 0..=seq_k-seq_q; with v = one-hot positions the output
        // shows exactly which keys contributed.
        let sh = shape(1, 3, 6, 6, true);
        let q = vec![0.0; 3 * 6];
        let k = vec![0.0; 6 * 6];
        let mut v = vec![0.0; 6 * 6];
        for j in 0..6 {
            v[j * 6 + j] = 1.0;
        }
        let mut out = vec![0.0; 18];
        let mut lse = vec![0.0; 3];
        attention_forward(sh, &q, &k, &v, &mut out, &mut lse);
        for i in 0..3 {
            let n = 4 + i;
            for j in 0..6 {
                let want = if j < n { 1.0 / n as f64 } else { 0.0 };
                assert!((out[i * 6 + j] - want).abs() < 1e-15, "row {i} key {j}");
            }
            assert!((lse[i] - (n as f64).ln()).abs() < 1e-15);
        }
    }

    #[test]
    fn backward_matches_reference_and_finite_differences() {
        let mut rng = Rng(0xbac4);
        for sh in cases() {
            let (q, k, v) = inputs(&mut rng, &sh);
            let dout = rng.vec(q.len(), -1.0, 1.0);
            let mut out = vec![0.0; q.len()];
            let mut lse = vec![0.0; sh.batch_heads * sh.seq_q];
            attention_forward(sh, &q, &k, &v, &mut out, &mut lse);
            let (mut dq, mut dk, mut dv) = (
                vec![f64::NAN; q.len()],
                vec![f64::NAN; k.len()],
                vec![f64::NAN; v.len()],
            );
            attention_backward(sh, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv);
            let (dqw, dkw, dvw) = backward_ref(&sh, &q, &k, &v, &dout);
            assert_close(&format!("attn dq {sh:?}"), &dq, &dqw, 1e-9, 1e-11);
            assert_close(&format!("attn dk {sh:?}"), &dk, &dkw, 1e-9, 1e-11);
            assert_close(&format!("attn dv {sh:?}"), &dv, &dvw, 1e-9, 1e-11);

            // Central finite differences of L = Σ dout · out (f64 forward kernel).
            let loss = |q: &[f64], k: &[f64], v: &[f64]| {
                let mut o = vec![0.0; q.len()];
                let mut l = vec![0.0; sh.batch_heads * sh.seq_q];
                attention_forward(sh, q, k, v, &mut o, &mut l);
                dot64(&dout, &o)
            };
            let h = 1e-5;
            for which in 0..3 {
                for _ in 0..4 {
                    let (mut qp, mut kp, mut vp) = (q.clone(), k.clone(), v.clone());
                    let (mut qm, mut km, mut vm) = (q.clone(), k.clone(), v.clone());
                    let (i, analytic) = match which {
                        0 => {
                            let i = rng.below(q.len());
                            qp[i] += h;
                            qm[i] -= h;
                            (i, dq[i])
                        }
                        1 => {
                            let i = rng.below(k.len());
                            kp[i] += h;
                            km[i] -= h;
                            (i, dk[i])
                        }
                        _ => {
                            let i = rng.below(v.len());
                            vp[i] += h;
                            vm[i] -= h;
                            (i, dv[i])
                        }
                    };
                    let fd = (loss(&qp, &kp, &vp) - loss(&qm, &km, &vm)) / (2.0 * h);
                    assert!(
                        (fd - analytic).abs() <= 1e-6 * (1.0 + fd.abs()),
                        "attn fd {sh:?} tensor {which} element {i}: fd {fd} analytic {analytic}"
                    );
                }
            }

            // f32 backward against the f64 reference on rounded inputs.
            let (q32, k32, v32, do32) = (to_f32(&q), to_f32(&k), to_f32(&v), to_f32(&dout));
            let mut out32 = vec![0f32; q.len()];
            let mut lse32 = vec![0f32; lse.len()];
            attention_forward(sh, &q32, &k32, &v32, &mut out32, &mut lse32);
            let (mut dq32, mut dk32, mut dv32) = (
                vec![0f32; q.len()],
                vec![0f32; k.len()],
                vec![0f32; v.len()],
            );
            attention_backward(
                sh, &q32, &k32, &v32, &out32, &lse32, &do32, &mut dq32, &mut dk32, &mut dv32,
            );
            let (dqw, dkw, dvw) = backward_ref(
                &sh,
                &to_f64(&q32),
                &to_f64(&k32),
                &to_f64(&v32),
                &to_f64(&do32),
            );
            let atol = 2e-5 * (sh.seq_q.max(sh.seq_k) as f64).sqrt();
            assert_close(
                &format!("attn dq f32 {sh:?}"),
                &to_f64(&dq32),
                &dqw,
                1e-3,
                atol,
            );
            assert_close(
                &format!("attn dk f32 {sh:?}"),
                &to_f64(&dk32),
                &dkw,
                1e-3,
                atol,
            );
            assert_close(
                &format!("attn dv f32 {sh:?}"),
                &to_f64(&dv32),
                &dvw,
                1e-3,
                atol,
            );
        }
    }

    #[test]
    fn empty_and_degenerate_shapes() {
        // seq_k == 0: out 0, lse -inf, gradients 0.
        let sh = shape(2, 3, 0, 4, false);
        let q = vec![1.0f32; 24];
        let mut out = vec![f32::NAN; 24];
        let mut lse = vec![0f32; 6];
        attention_forward(sh, &q, &[], &[], &mut out, &mut lse);
        assert!(out.iter().all(|&v| v == 0.0));
        assert!(lse.iter().all(|&v| v == f32::NEG_INFINITY));
        let mut dq = vec![f32::NAN; 24];
        attention_backward(sh, &q, &[], &[], &out, &lse, &q, &mut dq, &mut [], &mut []);
        assert!(dq.iter().all(|&v| v == 0.0));
        // seq_q == 0.
        let sh = shape(2, 0, 5, 4, true);
        let kv = vec![1.0f32; 40];
        let (mut dk, mut dv) = (vec![f32::NAN; 40], vec![f32::NAN; 40]);
        attention_forward(sh, &[], &kv, &kv, &mut [], &mut []);
        attention_backward(sh, &[], &kv, &kv, &[], &[], &[], &mut [], &mut dk, &mut dv);
        assert!(dk.iter().chain(&dv).all(|&v| v == 0.0));
    }

    #[test]
    fn backward_is_deterministic_across_thread_counts() {
        let sh = shape(4, 96, 96, 32, true);
        let mut rng = Rng(1);
        let (q, k, v) = inputs(&mut rng, &sh);
        let (q, k, v) = (to_f32(&q), to_f32(&k), to_f32(&v));
        let dout = to_f32(&rng.vec(q.len(), -1.0, 1.0));
        let run = || {
            let mut out = vec![0f32; q.len()];
            let mut lse = vec![0f32; sh.batch_heads * sh.seq_q];
            attention_forward(sh, &q, &k, &v, &mut out, &mut lse);
            let (mut dq, mut dk, mut dv) = (
                vec![0f32; q.len()],
                vec![0f32; k.len()],
                vec![0f32; v.len()],
            );
            attention_backward(sh, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv);
            (out, lse, dq, dk, dv)
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(run);
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap()
            .install(run);
        assert!(one == three, "results differ between 1 and 3 threads");
    }
}
