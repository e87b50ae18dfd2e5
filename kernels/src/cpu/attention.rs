//! Fused scaled dot-product attention (flash-attention style: online softmax, no score matrix
//! kept), forward and backward, over operands laid out with arbitrary head and row strides (so
//! q, k and v can be read straight out of a fused `[B, T, 3C]` qkv projection and the output
//! written straight into `[B, T, C]`).
//!
//! Both passes work on tiles of [`BLOCK_Q`] query rows by [`BLOCK_K`] keys. Every product inside
//! a tile (`S = Q Kᵀ`, `O += P V`, and in the backward `dP = dO Vᵀ`, `dV += Pᵀ dO`,
//! `dK += dSᵀ Q`, `dQ += dS K`) is a small register-blocked matrix product ([`gemm_tile`]) whose
//! every output element sums its terms in increasing index order with fused multiply-adds. Key
//! tiles wholly past the causal limit are never visited; inside a tile masked scores are
//! computed and then discarded.
//!
//! Forward: tasks are (batch-head, query tile) pairs, run in parallel when the problem is large.
//! Per row, the online softmax keeps a running max `m`, running sum `l` and an unnormalised
//! accumulator, rescaled by `exp(m_old - m_new)` when the max grows.
//!
//! Backward: one task per batch-head (each writes only its own rows of `dq`, `dk`, `dv`), so
//! every gradient element is accumulated in a fixed order (query rows increasing for `dk`/`dv`,
//! keys increasing for `dq`) whatever the thread count. Probabilities are recomputed as
//! `P = exp(scale q·k - lse)`; with `D_i = dout_i · out_i`, `dS = scale P (dout·v - D_i)`, and
//! `dv += Pᵀ dout`, `dq += dS k`, `dk += dSᵀ q`.
//!
//! All arithmetic is in `T` (f32 uses the crate's vectorised `exp`); nothing depends on the
//! thread count or on which instance (AVX2+FMA or portable) of the loops runs.

use rayon::prelude::*;

use super::fastmath::exp;
use super::vecops::{dot, max as vmax, simd, sum, SendPtr};
use crate::Float;

/// Sizes of one attention call. `q` is `[batch_heads, seq_q, head_dim]`, `k` and `v` are
/// `[batch_heads, seq_k, head_dim]` (contiguous for [`attention_forward`] and
/// [`attention_backward`]; any [`HeadLayout`] for the `_strided` versions).
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

/// Rows of the register block of [`gemm_tile`].
const MR: usize = 4;
/// Columns of the register block of [`gemm_tile`].
const NR: usize = 16;

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

/// `C (+)= A B` for one small tile: `A(i, p) = a[i * ars + p * acs]` (`m × k`),
/// `B(p, j) = b[p * brs + j]` (`k × n`), `C(i, j) = c[i * crs + j]` (`m × n`). Each element of C
/// starts from its old value when `accumulate` (else 0) and adds its `k` products in increasing
/// `p` with fused multiply-adds, so its value does not depend on where the register blocks fall.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gemm_tile<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ars: usize,
    acs: usize,
    b: &[T],
    brs: usize,
    c: &mut [T],
    crs: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * crs + n <= c.len(), "gemm_tile: C out of bounds");
    if k > 0 {
        assert!(
            (m - 1) * ars + (k - 1) * acs < a.len(),
            "gemm_tile: A out of bounds"
        );
        assert!((k - 1) * brs + n <= b.len(), "gemm_tile: B out of bounds");
    }
    let mut i = 0;
    while i + MR <= m {
        // SAFETY: rows i..i+MR < m and all columns < n: in bounds by the asserts above.
        unsafe { block_rows::<T, MR>(i, n, k, a, ars, acs, b, brs, c, crs, accumulate) };
        i += MR;
    }
    while i < m {
        // SAFETY: as above for the single row i < m.
        unsafe { block_rows::<T, 1>(i, n, k, a, ars, acs, b, brs, c, crs, accumulate) };
        i += 1;
    }
}

/// Rows `i0 .. i0 + R` of [`gemm_tile`]: register blocks of `R × NR`, then the leftover columns.
///
/// # Safety
/// Rows `i0 .. i0 + R` are below `m`, and the bounds asserted by [`gemm_tile`] hold.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block_rows<T: Float, const R: usize>(
    i0: usize,
    n: usize,
    k: usize,
    a: &[T],
    ars: usize,
    acs: usize,
    b: &[T],
    brs: usize,
    c: &mut [T],
    crs: usize,
    accumulate: bool,
) {
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    let mut j = 0;
    while j + NR <= n {
        let mut acc = [[T::ZERO; NR]; R];
        if accumulate {
            for (ii, row) in acc.iter_mut().enumerate() {
                for (jj, v) in row.iter_mut().enumerate() {
                    // SAFETY: row i0 + ii < m, column j + jj < n (caller's contract).
                    *v = unsafe { *cp.add((i0 + ii) * crs + j + jj) };
                }
            }
        }
        for p in 0..k {
            // SAFETY: p < k and j + NR <= n, so the NR elements of B's row p are in bounds.
            let brow: [T; NR] =
                unsafe { std::ptr::read_unaligned(bp.add(p * brs + j) as *const [T; NR]) };
            for (ii, row) in acc.iter_mut().enumerate() {
                // SAFETY: row i0 + ii < m and p < k.
                let av = unsafe { *ap.add((i0 + ii) * ars + p * acs) };
                for (v, &bv) in row.iter_mut().zip(&brow) {
                    *v = av.fma(bv, *v);
                }
            }
        }
        for (ii, row) in acc.iter().enumerate() {
            for (jj, &v) in row.iter().enumerate() {
                // SAFETY: row i0 + ii < m, column j + jj < n.
                unsafe { *cp.add((i0 + ii) * crs + j + jj) = v };
            }
        }
        j += NR;
    }
    for ii in 0..R {
        for jj in j..n {
            // SAFETY: row i0 + ii < m, column jj < n, p < k: all in bounds.
            unsafe {
                let dst = cp.add((i0 + ii) * crs + jj);
                let mut v = if accumulate { *dst } else { T::ZERO };
                for p in 0..k {
                    v = (*ap.add((i0 + ii) * ars + p * acs)).fma(*bp.add(p * brs + jj), v);
                }
                *dst = v;
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

/// Forward over query rows `i0 .. i0 + rows` of batch-head `bh`, writing those rows of `out`
/// (through `out_ptr`, laid out by `ol`) and of `lse` (`lse_bh`, the batch-head's `[seq_q]`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_tile<T: Float>(
    sh: &AttentionShape,
    heads: usize,
    bh: usize,
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
    let kmax = sh.key_limit(i0 + rows - 1);
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
            let bmax = vmax(&srow[..lim]);
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
            // No visible key (seq_k == 0): output 0, lse -inf.
            orow.fill(T::ZERO);
            lse[r] = T::NEG_INFINITY;
        }
    }
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

/// `out = softmax(scale · q kᵀ + mask) v`; also writes `lse` (`[batch_heads, seq_q]`), the
/// log-sum-exp of each row of scaled scores, for the backward pass. All operands contiguous.
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
    attention_forward_strided(shape, 1, q, lq, k, lk, v, lk, out, lq, lse);
}

/// [`attention_forward`] over operands with any [`HeadLayout`]s (`heads` heads per batch entry;
/// `shape.batch_heads` must be a multiple of it). `lse` is contiguous `[batch_heads, seq_q]`.
/// Panics if a layout leaves its buffer or if rows of `out` overlap each other.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_strided<T: Float>(
    shape: AttentionShape,
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
        simd(
            #[inline(always)]
            || forward_tile(&shape, heads, b, q, k, v, i0, rows, buf, lse_t, scratch),
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

/// Backward for one batch-head `bh`; `dq_loc` (`[seq_q, d]`), `dk_loc`, `dv_loc` (`[seq_k, d]`)
/// are the task's contiguous results.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_head<T: Float>(
    sh: &AttentionShape,
    heads: usize,
    bh: usize,
    q: Operand<'_, T>,
    k: Operand<'_, T>,
    v: Operand<'_, T>,
    out: Operand<'_, T>,
    dout: Operand<'_, T>,
    lse: &[T],
    dq_loc: &mut [T],
    dk_loc: &mut [T],
    dv_loc: &mut [T],
    dvec: &mut Vec<T>,
    scratch: &mut TileScratch<T>,
) {
    let d = sh.head_dim;
    let seq_q = sh.seq_q;
    let scale = T::from_f64(sh.scale);
    dq_loc.fill(T::ZERO);
    dk_loc.fill(T::ZERO);
    dv_loc.fill(T::ZERO);
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
    let kmax_all = sh.key_limit(seq_q - 1);
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
                let lim = sh.key_limit(i).saturating_sub(kb).min(n);
                let (lse_i, d_i) = (lse[i], dvec[i]);
                let prow = &mut s[r * BLOCK_K..r * BLOCK_K + n];
                let dsrow = &mut dp[r * BLOCK_K..r * BLOCK_K + n];
                for (p, ds) in prow[..lim].iter_mut().zip(dsrow[..lim].iter_mut()) {
                    let pv = exp(scale * *p - lse_i);
                    *p = pv;
                    *ds = scale * (pv * (*ds - d_i));
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

/// Backward of [`attention_forward`] from `dout`, recomputing probabilities from `lse`;
/// overwrites `dq`, `dk`, `dv`. All operands contiguous.
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
    );
    dq.copy_from_slice(&g[..nq]);
    dk.copy_from_slice(&g[nq..nq + nk]);
    dv.copy_from_slice(&g[nq + nk..]);
}

/// [`attention_backward`] over operands with any [`HeadLayout`]s (`heads` heads per batch
/// entry). The three gradients are written (overwritten) into one buffer `grads` at the layouts
/// `grad_layouts = [dq, dk, dv]`, which must not overlap (checked: it panics otherwise); a fused
/// `[B, T, 3C]` qkv gradient is one such buffer. `lse` is contiguous `[batch_heads, seq_q]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_strided<T: Float>(
    shape: AttentionShape,
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
    let (q, k, v, out, dout) = (op(q, ql), op(k, kl), op(v, vl), op(out, ol), op(dout, dol));
    let gptr = SendPtr(grads.as_mut_ptr());
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
        simd(
            #[inline(always)]
            || {
                backward_head(
                    &shape,
                    heads,
                    b,
                    q,
                    k,
                    v,
                    out,
                    dout,
                    &lse[b * seq_q..(b + 1) * seq_q],
                    &mut w.dq,
                    &mut w.dk,
                    &mut w.dv,
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

    /// Gathers batch-head `bh`'s rows of an operand with layout `l` into a contiguous
    /// `[batch_heads, seq, d]` f64 buffer.
    fn gather(
        buf: &[f64],
        l: HeadLayout,
        heads: usize,
        bh: usize,
        seq: usize,
        d: usize,
    ) -> Vec<f64> {
        let mut out = Vec::with_capacity(bh * seq * d);
        for b in 0..bh {
            for t in 0..seq {
                let at = l.row(heads, b, t);
                out.extend_from_slice(&buf[at..at + d]);
            }
        }
        out
    }

    #[test]
    fn strided_qkv_layouts_match_the_reference() {
        // q, k, v read from one fused [B, T, 3C] buffer, the output written to [B, T, C] and the
        // gradients to one [B, T, 3C] buffer: against the f64 reference on gathered copies.
        let mut rng = Rng(0x9c7);
        for &(b, heads, t, d, causal) in &[
            (2usize, 3usize, 37usize, 16usize, true),
            (1, 2, 130, 32, true),
            (2, 4, 64, 8, false),
            (1, 1, 5, 3, true),
        ] {
            let c = heads * d;
            let bh = b * heads;
            let sh = shape(bh, t, t, d, causal);
            let at = |offset| HeadLayout {
                offset,
                batch_stride: t * 3 * c,
                head_stride: d,
                row_stride: 3 * c,
            };
            let (ql, kl, vl) = (at(0), at(c), at(2 * c));
            let ol = HeadLayout {
                offset: 0,
                batch_stride: t * c,
                head_stride: d,
                row_stride: c,
            };
            let qkv = rng.vec(b * t * 3 * c, -2.0, 2.0);
            let dout = rng.vec(b * t * c, -1.0, 1.0);
            let (q, k, v) = (
                gather(&qkv, ql, heads, bh, t, d),
                gather(&qkv, kl, heads, bh, t, d),
                gather(&qkv, vl, heads, bh, t, d),
            );
            let (ow, lw, _) = forward_ref(&sh, &q, &k, &v);
            let mut out = vec![f64::NAN; b * t * c];
            let mut lse = vec![f64::NAN; bh * t];
            attention_forward_strided(
                sh, heads, &qkv, ql, &qkv, kl, &qkv, vl, &mut out, ol, &mut lse,
            );
            let og = gather(&out, ol, heads, bh, t, d);
            assert_close(&format!("strided out {sh:?}"), &og, &ow, 1e-10, 1e-12);
            assert_close(&format!("strided lse {sh:?}"), &lse, &lw, 1e-12, 1e-12);

            let dog = gather(&dout, ol, heads, bh, t, d);
            let (dqw, dkw, dvw) = backward_ref(&sh, &q, &k, &v, &dog);
            let mut g = vec![f64::NAN; qkv.len()];
            attention_backward_strided(
                sh,
                heads,
                &qkv,
                ql,
                &qkv,
                kl,
                &qkv,
                vl,
                &out,
                ol,
                &lse,
                &dout,
                ol,
                &mut g,
                [ql, kl, vl],
            );
            assert_close(
                "strided dq",
                &gather(&g, ql, heads, bh, t, d),
                &dqw,
                1e-9,
                1e-11,
            );
            assert_close(
                "strided dk",
                &gather(&g, kl, heads, bh, t, d),
                &dkw,
                1e-9,
                1e-11,
            );
            assert_close(
                "strided dv",
                &gather(&g, vl, heads, bh, t, d),
                &dvw,
                1e-9,
                1e-11,
            );

            // f32 through the same layouts.
            let q32 = to_f32(&qkv);
            let d32 = to_f32(&dout);
            let (q64, d64) = (to_f64(&q32), to_f64(&d32));
            let (qr, kr, vr) = (
                gather(&q64, ql, heads, bh, t, d),
                gather(&q64, kl, heads, bh, t, d),
                gather(&q64, vl, heads, bh, t, d),
            );
            let (ow, _, _) = forward_ref(&sh, &qr, &kr, &vr);
            let mut out32 = vec![0f32; out.len()];
            let mut lse32 = vec![0f32; lse.len()];
            attention_forward_strided(
                sh, heads, &q32, ql, &q32, kl, &q32, vl, &mut out32, ol, &mut lse32,
            );
            let o64 = to_f64(&out32);
            assert_close(
                "strided out f32",
                &gather(&o64, ol, heads, bh, t, d),
                &ow,
                1e-4,
                1e-5,
            );
            let (dqw, dkw, dvw) =
                backward_ref(&sh, &qr, &kr, &vr, &gather(&d64, ol, heads, bh, t, d));
            let mut g32 = vec![0f32; qkv.len()];
            attention_backward_strided(
                sh,
                heads,
                &q32,
                ql,
                &q32,
                kl,
                &q32,
                vl,
                &out32,
                ol,
                &lse32,
                &d32,
                ol,
                &mut g32,
                [ql, kl, vl],
            );
            let g64 = to_f64(&g32);
            let atol = 2e-5 * (t as f64).sqrt();
            assert_close(
                "strided dq f32",
                &gather(&g64, ql, heads, bh, t, d),
                &dqw,
                1e-3,
                atol,
            );
            assert_close(
                "strided dk f32",
                &gather(&g64, kl, heads, bh, t, d),
                &dkw,
                1e-3,
                atol,
            );
            assert_close(
                "strided dv f32",
                &gather(&g64, vl, heads, bh, t, d),
                &dvw,
                1e-3,
                atol,
            );
        }
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn overlapping_gradient_layouts_panic() {
        let sh = shape(2, 4, 4, 4, false);
        let x = vec![0.5f32; 2 * 4 * 4];
        let l = HeadLayout::contiguous(4, 4);
        let mut g = vec![0f32; 2 * 4 * 4];
        attention_backward_strided(
            sh,
            1,
            &x,
            l,
            &x,
            l,
            &x,
            l,
            &x,
            l,
            &[0.0; 8],
            &x,
            l,
            &mut g,
            [l, l, l],
        );
    }

    #[test]
    #[should_panic(expected = "needs")]
    fn out_of_bounds_layout_panics() {
        let sh = shape(2, 4, 4, 4, false);
        let x = vec![0.5f32; 2 * 4 * 4];
        let l = HeadLayout::contiguous(4, 4);
        let wide = HeadLayout { row_stride: 5, ..l };
        let mut out = vec![0f32; 32];
        let mut lse = vec![0f32; 8];
        attention_forward_strided(sh, 1, &x, wide, &x, l, &x, l, &mut out, l, &mut lse);
    }
}
