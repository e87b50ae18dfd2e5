//! Tests of fused attention against a naive f64 reference and finite differences.
#![allow(clippy::needless_range_loop)]

use super::*;
use crate::cpu::testutil::{assert_close, dot64, to_f32, to_f64, Rng};
use crate::ops::BiasLayout;

/// Naive f64 attention without padding or bias (the masked reference with nothing masked but
/// the causal limit). Returns (out, lse, P) with `P` the full `[bh, seq_q, seq_k]` probability
/// tensor (0 where masked).
fn forward_ref(
    sh: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    masked_forward_ref(sh, &Mods::plain(), q, k, v)
}

/// Naive f64 backward through the explicit softmax Jacobian (no lse / D shortcuts), without
/// padding or bias.
fn backward_ref(
    sh: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (dq, dk, dv, _) = masked_backward_ref(sh, &Mods::plain(), q, k, v, dout);
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

/// Rounds each of `xs` to f32.
fn round<const N: usize>(xs: [&[f64]; N]) -> [Vec<f32>; N] {
    xs.map(to_f32)
}

/// Widens each of `xs` to f64.
fn widen<const N: usize>(xs: [&[f32]; N]) -> [Vec<f64>; N] {
    xs.map(to_f64)
}

/// Runs the forward kernel into `out` and `lse` buffers pre-filled with `fill`: (out, lse).
fn forward<T: Float>(
    sh: AttentionShape,
    mask: &ScoreMask<'_, T>,
    q: &[T],
    k: &[T],
    v: &[T],
    fill: T,
) -> (Vec<T>, Vec<T>) {
    let mut out = vec![fill; q.len()];
    let mut lse = vec![fill; sh.batch_heads * sh.seq_q];
    attention_forward(sh, mask, q, k, v, &mut out, &mut lse);
    (out, lse)
}

/// (dq, dk, dv, dz) of one backward run, `dz` only where it was asked for.
type Grads<T> = (Vec<T>, Vec<T>, Vec<T>, Option<Vec<T>>);

/// Runs the backward kernel into dq, dk, dv buffers pre-filled with `fill` and, where `dz_fill`
/// is given, a dbias buffer pre-filled with it.
#[allow(clippy::too_many_arguments)]
fn backward<T: Float>(
    sh: AttentionShape,
    mask: &ScoreMask<'_, T>,
    q: &[T],
    k: &[T],
    v: &[T],
    (out, lse): (&[T], &[T]),
    dout: &[T],
    fill: T,
    dz_fill: Option<T>,
) -> Grads<T> {
    let (mut dq, mut dk, mut dv) = (
        vec![fill; q.len()],
        vec![fill; k.len()],
        vec![fill; v.len()],
    );
    let mut dz = dz_fill.map(|f| vec![f; sh.batch_heads * sh.seq_q * sh.seq_k]);
    attention_backward(
        sh,
        mask,
        q,
        k,
        v,
        out,
        lse,
        dout,
        &mut dq,
        &mut dk,
        &mut dv,
        dz.as_deref_mut(),
    );
    (dq, dk, dv, dz)
}

/// `assert_close` on each of `got` against `want`, labelled `{what} {name}{suffix}` with the
/// names dq, dk, dv, dz in that order.
#[track_caller]
fn assert_grads_close(
    what: &str,
    suffix: &str,
    got: &[&[f64]],
    want: &[&[f64]],
    rtol: f64,
    atol: f64,
) {
    assert_eq!(got.len(), want.len());
    for ((name, g), w) in ["dq", "dk", "dv", "dz"].iter().zip(got).zip(want) {
        assert_close(&format!("{what} {name}{suffix}"), g, w, rtol, atol);
    }
}

#[test]
fn forward_matches_reference() {
    let mut rng = Rng(0xa77e);
    for sh in cases() {
        let (q, k, v) = inputs(&mut rng, &sh);
        let (ow, lw, _) = forward_ref(&sh, &q, &k, &v);
        let (out, lse) = forward(sh, &ScoreMask::none(), &q, &k, &v, f64::NAN);
        assert_close(&format!("attn out f64 {sh:?}"), &out, &ow, 1e-10, 1e-12);
        assert_close(&format!("attn lse f64 {sh:?}"), &lse, &lw, 1e-12, 1e-12);

        let [q32, k32, v32] = round([&q, &k, &v]);
        let [qr, kr, vr] = widen([&q32, &k32, &v32]);
        let (ow, lw, _) = forward_ref(&sh, &qr, &kr, &vr);
        let (out32, lse32) = forward(sh, &ScoreMask::none(), &q32, &k32, &v32, f32::NAN);
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
    attention_forward(sh, &ScoreMask::none(), &q, &k, &v, &mut out, &mut lse);
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
        let none = ScoreMask::none();
        let (out, lse) = forward(sh, &none, &q, &k, &v, 0.0);
        let (dq, dk, dv, _) = backward(sh, &none, &q, &k, &v, (&out, &lse), &dout, f64::NAN, None);
        let (dqw, dkw, dvw) = backward_ref(&sh, &q, &k, &v, &dout);
        let suffix = format!(" {sh:?}");
        assert_grads_close(
            "attn",
            &suffix,
            &[&dq, &dk, &dv],
            &[&dqw, &dkw, &dvw],
            1e-9,
            1e-11,
        );

        // Central finite differences of L = Σ dout · out (f64 forward kernel).
        let loss = |q: &[f64], k: &[f64], v: &[f64]| {
            let mut o = vec![0.0; q.len()];
            let mut l = vec![0.0; sh.batch_heads * sh.seq_q];
            attention_forward(sh, &ScoreMask::none(), q, k, v, &mut o, &mut l);
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
        let [q32, k32, v32, do32] = round([&q, &k, &v, &dout]);
        let none = ScoreMask::none();
        let (out32, lse32) = forward(sh, &none, &q32, &k32, &v32, 0f32);
        let fwd32 = (&out32[..], &lse32[..]);
        let (dq32, dk32, dv32, _) = backward(sh, &none, &q32, &k32, &v32, fwd32, &do32, 0f32, None);
        let [qr, kr, vr, dr] = widen([&q32, &k32, &v32, &do32]);
        let (dqw, dkw, dvw) = backward_ref(&sh, &qr, &kr, &vr, &dr);
        let atol = 2e-5 * (sh.seq_q.max(sh.seq_k) as f64).sqrt();
        let [dq64, dk64, dv64] = widen([&dq32, &dk32, &dv32]);
        let suffix = format!(" f32 {sh:?}");
        let (got, want) = ([&dq64[..], &dk64, &dv64], [&dqw[..], &dkw, &dvw]);
        assert_grads_close("attn", &suffix, &got, &want, 1e-3, atol);
    }
}

#[test]
fn empty_and_degenerate_shapes() {
    // seq_k == 0: out 0, lse -inf, gradients 0.
    let sh = shape(2, 3, 0, 4, false);
    let q = vec![1.0f32; 24];
    let mut out = vec![f32::NAN; 24];
    let mut lse = vec![0f32; 6];
    attention_forward(sh, &ScoreMask::none(), &q, &[], &[], &mut out, &mut lse);
    assert!(out.iter().all(|&v| v == 0.0));
    assert!(lse.iter().all(|&v| v == f32::NEG_INFINITY));
    let mut dq = vec![f32::NAN; 24];
    attention_backward(
        sh,
        &ScoreMask::none(),
        &q,
        &[],
        &[],
        &out,
        &lse,
        &q,
        &mut dq,
        &mut [],
        &mut [],
        None,
    );
    assert!(dq.iter().all(|&v| v == 0.0));
    // seq_q == 0.
    let sh = shape(2, 0, 5, 4, true);
    let kv = vec![1.0f32; 40];
    let (mut dk, mut dv) = (vec![f32::NAN; 40], vec![f32::NAN; 40]);
    attention_forward(sh, &ScoreMask::none(), &[], &kv, &kv, &mut [], &mut []);
    attention_backward(
        sh,
        &ScoreMask::none(),
        &[],
        &kv,
        &kv,
        &[],
        &[],
        &[],
        &mut [],
        &mut dk,
        &mut dv,
        None,
    );
    assert!(dk.iter().chain(&dv).all(|&v| v == 0.0));
}

#[test]
fn backward_is_deterministic_across_thread_counts() {
    let sh = shape(4, 96, 96, 32, true);
    let mut rng = Rng(1);
    let (q, k, v) = inputs(&mut rng, &sh);
    let [q, k, v] = round([&q, &k, &v]);
    let dout = to_f32(&rng.vec(q.len(), -1.0, 1.0));
    let run = || {
        let none = ScoreMask::none();
        let (out, lse) = forward(sh, &none, &q, &k, &v, 0f32);
        let grads = backward(sh, &none, &q, &k, &v, (&out, &lse), &dout, 0f32, None);
        (out, lse, grads)
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
fn gather(buf: &[f64], l: HeadLayout, heads: usize, bh: usize, seq: usize, d: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(bh * seq * d);
    for b in 0..bh {
        for t in 0..seq {
            let at = l.row(heads, b, t);
            out.extend_from_slice(&buf[at..at + d]);
        }
    }
    out
}

/// q, k and v read from one fused `[B, T, 3C]` buffer (`C = heads·d`), the output written to
/// a `[B, T, C]` one.
struct Fused {
    heads: usize,
    bh: usize,
    t: usize,
    d: usize,
    qkv: [HeadLayout; 3],
    out: HeadLayout,
}

impl Fused {
    fn new(heads: usize, bh: usize, t: usize, d: usize) -> Fused {
        let c = heads * d;
        let at = |offset| HeadLayout {
            offset,
            batch_stride: t * 3 * c,
            head_stride: d,
            row_stride: 3 * c,
        };
        let out = HeadLayout {
            offset: 0,
            batch_stride: t * c,
            head_stride: d,
            row_stride: c,
        };
        Fused {
            heads,
            bh,
            t,
            d,
            qkv: [at(0), at(c), at(2 * c)],
            out,
        }
    }

    /// `buf`'s rows under layout `l`, gathered contiguous.
    fn gather(&self, buf: &[f64], l: HeadLayout) -> Vec<f64> {
        gather(buf, l, self.heads, self.bh, self.t, self.d)
    }

    /// q, k and v (or dq, dk and dv) of a fused buffer, gathered contiguous.
    fn gather3(&self, buf: &[f64]) -> [Vec<f64>; 3] {
        self.qkv.map(|l| self.gather(buf, l))
    }

    /// Runs the strided forward kernel on the fused buffer `qkv` into `out` and `lse` buffers
    /// pre-filled with `fill`: (out, lse).
    fn forward<T: Float>(
        &self,
        sh: AttentionShape,
        mask: &ScoreMask<'_, T>,
        qkv: &[T],
        fill: T,
    ) -> (Vec<T>, Vec<T>) {
        let [ql, kl, vl] = self.qkv;
        let mut out = vec![fill; self.bh * self.t * self.d];
        let mut lse = vec![fill; self.bh * self.t];
        attention_forward_strided(
            sh, mask, self.heads, qkv, ql, qkv, kl, qkv, vl, &mut out, self.out, &mut lse,
        );
        (out, lse)
    }

    /// Runs the strided backward kernel into one fused gradient buffer pre-filled with `fill`
    /// and, where `dz_fill` is given, a dbias buffer pre-filled with it: (gradient, dz).
    #[allow(clippy::too_many_arguments)]
    fn backward<T: Float>(
        &self,
        sh: AttentionShape,
        mask: &ScoreMask<'_, T>,
        qkv: &[T],
        (out, lse): (&[T], &[T]),
        dout: &[T],
        fill: T,
        dz_fill: Option<T>,
    ) -> (Vec<T>, Option<Vec<T>>) {
        let [ql, kl, vl] = self.qkv;
        let mut g = vec![fill; qkv.len()];
        let mut dz = dz_fill.map(|f| vec![f; self.bh * self.t * self.t]);
        attention_backward_strided(
            sh,
            mask,
            self.heads,
            qkv,
            ql,
            qkv,
            kl,
            qkv,
            vl,
            out,
            self.out,
            lse,
            dout,
            self.out,
            &mut g,
            self.qkv,
            dz.as_deref_mut(),
        );
        (g, dz)
    }
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
        let f = Fused::new(heads, bh, t, d);
        let none = ScoreMask::none();
        let qkv = rng.vec(b * t * 3 * c, -2.0, 2.0);
        let dout = rng.vec(b * t * c, -1.0, 1.0);
        let [q, k, v] = f.gather3(&qkv);
        let (ow, lw, _) = forward_ref(&sh, &q, &k, &v);
        let (out, lse) = f.forward(sh, &none, &qkv, f64::NAN);
        let og = f.gather(&out, f.out);
        assert_close(&format!("strided out {sh:?}"), &og, &ow, 1e-10, 1e-12);
        assert_close(&format!("strided lse {sh:?}"), &lse, &lw, 1e-12, 1e-12);

        let dog = f.gather(&dout, f.out);
        let (dqw, dkw, dvw) = backward_ref(&sh, &q, &k, &v, &dog);
        let (g, _) = f.backward(sh, &none, &qkv, (&out, &lse), &dout, f64::NAN, None);
        let [gq, gk, gv] = f.gather3(&g);
        let (got, want) = ([&gq[..], &gk, &gv], [&dqw[..], &dkw, &dvw]);
        assert_grads_close("strided", "", &got, &want, 1e-9, 1e-11);

        // f32 through the same layouts.
        let q32 = to_f32(&qkv);
        let d32 = to_f32(&dout);
        let (q64, d64) = (to_f64(&q32), to_f64(&d32));
        let [qr, kr, vr] = f.gather3(&q64);
        let (ow, _, _) = forward_ref(&sh, &qr, &kr, &vr);
        let (out32, lse32) = f.forward(sh, &ScoreMask::none(), &q32, 0f32);
        let o64 = to_f64(&out32);
        assert_close("strided out f32", &f.gather(&o64, f.out), &ow, 1e-4, 1e-5);
        let (dqw, dkw, dvw) = backward_ref(&sh, &qr, &kr, &vr, &f.gather(&d64, f.out));
        let (g32, _) = f.backward(
            sh,
            &ScoreMask::none(),
            &q32,
            (&out32, &lse32),
            &d32,
            0f32,
            None,
        );
        let g64 = to_f64(&g32);
        let atol = 2e-5 * (t as f64).sqrt();
        let [gq, gk, gv] = f.gather3(&g64);
        let (got, want) = ([&gq[..], &gk, &gv], [&dqw[..], &dkw, &dvw]);
        assert_grads_close("strided", " f32", &got, &want, 1e-3, atol);
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
        &ScoreMask::none(),
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
        None,
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
    attention_forward_strided(
        sh,
        &ScoreMask::none(),
        1,
        &x,
        wide,
        &x,
        l,
        &x,
        l,
        &mut out,
        l,
        &mut lse,
    );
}

// ---- Key padding and additive bias -------------------------------------------------------

/// A padding mask and bias for the masked tests, owned.
struct Mods {
    heads: usize,
    pad: Option<Vec<u8>>,
    bias: Option<(Vec<f64>, BiasLayout)>,
}

impl Mods {
    /// Nothing masked beyond the causal limit.
    fn plain() -> Mods {
        Mods {
            heads: 1,
            pad: None,
            bias: None,
        }
    }

    fn mask(&self) -> ScoreMask<'_, f64> {
        ScoreMask {
            heads: self.heads,
            key_padding: self.pad.as_deref(),
            bias: self.bias.as_ref().map(|(d, l)| (&d[..], *l)),
        }
    }

    fn bias32(&self) -> Option<(Vec<f32>, BiasLayout)> {
        self.bias.as_ref().map(|(d, l)| (to_f32(d), *l))
    }

    /// The f64 mask of the f32-rounded bias (for comparing f32 runs).
    fn rounded(&self) -> Mods {
        Mods {
            heads: self.heads,
            pad: self.pad.clone(),
            bias: self.bias.as_ref().map(|(d, l)| (to_f64(&to_f32(d)), *l)),
        }
    }

    /// The softmax input of query `i`, key `j` of batch-head `bh` given the scaled product `s`
    /// (`None` when masked), read straight from the definitions.
    fn score(&self, sh: &AttentionShape, bh: usize, i: usize, j: usize, s: f64) -> Option<f64> {
        let (b, h) = (bh / self.heads, bh % self.heads);
        if sh.causal && j + sh.seq_q > i + sh.seq_k {
            return None;
        }
        if let Some(p) = &self.pad {
            if p[b * sh.seq_k + j] == 0 {
                return None;
            }
        }
        let bias = self.bias.as_ref().map_or(0.0, |(d, l)| {
            d[l.offset
                + b * l.batch_stride
                + h * l.head_stride
                + i * l.row_stride
                + j * l.col_stride]
        });
        Some(s + bias)
    }
}

/// Naive f64 masked attention: (out, lse, P) with `P` `[bh, seq_q, seq_k]`, explicit softmax
/// over the unmasked scores of each row; a row without any finite score gets out 0, lse -inf.
fn masked_forward_ref(
    sh: &AttentionShape,
    m: &Mods,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (bh, sq, sk, d) = (sh.batch_heads, sh.seq_q, sh.seq_k, sh.head_dim);
    let mut out = vec![0.0; bh * sq * d];
    let mut lse = vec![f64::NEG_INFINITY; bh * sq];
    let mut probs = vec![0.0; bh * sq * sk];
    for b in 0..bh {
        for i in 0..sq {
            let z: Vec<Option<f64>> = (0..sk)
                .map(|j| {
                    let s: f64 = (0..d)
                        .map(|c| q[(b * sq + i) * d + c] * k[(b * sk + j) * d + c])
                        .sum();
                    m.score(sh, b, i, j, sh.scale * s)
                })
                .collect();
            let mx = z
                .iter()
                .flatten()
                .cloned()
                .fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let tot: f64 = z.iter().flatten().map(|s| (s - mx).exp()).sum();
            lse[b * sq + i] = mx + tot.ln();
            for (j, zj) in z.iter().enumerate() {
                if let Some(zj) = zj {
                    let p = (zj - mx).exp() / tot;
                    probs[(b * sq + i) * sk + j] = p;
                    for c in 0..d {
                        out[(b * sq + i) * d + c] += p * v[(b * sk + j) * d + c];
                    }
                }
            }
        }
    }
    (out, lse, probs)
}

/// Naive f64 masked backward through the explicit softmax Jacobian: (dq, dk, dv, dz) with `dz`
/// the `[bh, seq_q, seq_k]` gradient of the softmax inputs.
#[allow(clippy::type_complexity)]
fn masked_backward_ref(
    sh: &AttentionShape,
    m: &Mods,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (bh, sq, sk, d, scale) = (sh.batch_heads, sh.seq_q, sh.seq_k, sh.head_dim, sh.scale);
    let (_, _, p) = masked_forward_ref(sh, m, q, k, v);
    let mut dq = vec![0.0; bh * sq * d];
    let mut dk = vec![0.0; bh * sk * d];
    let mut dv = vec![0.0; bh * sk * d];
    let mut dz = vec![0.0; bh * sq * sk];
    for b in 0..bh {
        for i in 0..sq {
            let prow = &p[(b * sq + i) * sk..(b * sq + i + 1) * sk];
            let dp: Vec<f64> = (0..sk)
                .map(|j| {
                    (0..d)
                        .map(|c| dout[(b * sq + i) * d + c] * v[(b * sk + j) * d + c])
                        .sum()
                })
                .collect();
            for j in 0..sk {
                let mut g = 0.0;
                for jp in 0..sk {
                    let delta = if j == jp { 1.0 } else { 0.0 };
                    g += dp[jp] * prow[jp] * (delta - prow[j]);
                }
                dz[(b * sq + i) * sk + j] = g;
                for c in 0..d {
                    dv[(b * sk + j) * d + c] += prow[j] * dout[(b * sq + i) * d + c];
                    dq[(b * sq + i) * d + c] += scale * g * k[(b * sk + j) * d + c];
                    dk[(b * sk + j) * d + c] += scale * g * q[(b * sq + i) * d + c];
                }
            }
        }
    }
    (dq, dk, dv, dz)
}

/// A padding mask for `batch` entries of `seq_k` keys: entry 0 pads a tail, entry 1 (if any)
/// pads every third key, entry 2 (if any) pads everything, later ones pad nothing.
fn padding(batch: usize, seq_k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut p = vec![1u8; batch * seq_k];
    for b in 0..batch {
        let row = &mut p[b * seq_k..(b + 1) * seq_k];
        match b {
            0 => {
                let keep = 1 + rng.below(seq_k.max(1));
                row[keep.min(seq_k)..].fill(0);
            }
            1 => row.iter_mut().step_by(3).for_each(|m| *m = 0),
            2 => row.fill(0),
            _ => {}
        }
    }
    p
}

/// A bias of shape `dims` (`[B or 1, H or 1, Tq or 1, Tk or 1]`) with its broadcasting layout.
fn bias(dims: [usize; 4], rng: &mut Rng, neg_inf: bool) -> (Vec<f64>, BiasLayout) {
    let n: usize = dims.iter().product();
    let mut data = rng.vec(n, -2.0, 2.0);
    if neg_inf {
        for (idx, x) in data.iter_mut().enumerate() {
            if idx % 5 == 1 {
                *x = f64::NEG_INFINITY;
            }
        }
    }
    let st = |i: usize| -> usize {
        if dims[i] == 1 {
            0
        } else {
            dims[i + 1..].iter().product()
        }
    };
    let l = BiasLayout {
        offset: 0,
        batch_stride: st(0),
        head_stride: st(1),
        row_stride: st(2),
        col_stride: st(3),
    };
    (data, l)
}

/// Runs the masked kernel (f64) and checks forward and backward against the references, the
/// gradients also against finite differences, and the f32 kernel against the reference on
/// rounded inputs.
fn check_masked(what: &str, sh: AttentionShape, m: &Mods, rng: &mut Rng) {
    let (q, k, v) = inputs(rng, &sh);
    let dout = rng.vec(q.len(), -1.0, 1.0);
    let mask = m.mask();
    let (ow, lw, _) = masked_forward_ref(&sh, m, &q, &k, &v);
    let (out, lse) = forward(sh, &mask, &q, &k, &v, f64::NAN);
    assert_close(&format!("{what} out {sh:?}"), &out, &ow, 1e-10, 1e-12);
    assert_close(&format!("{what} lse {sh:?}"), &lse, &lw, 1e-12, 1e-12);

    let fwd = (&out[..], &lse[..]);
    let (dq, dk, dv, dz) = backward(sh, &mask, &q, &k, &v, fwd, &dout, f64::NAN, Some(f64::NAN));
    let dz = dz.unwrap();
    let (dqw, dkw, dvw, dzw) = masked_backward_ref(&sh, m, &q, &k, &v, &dout);
    let (got, want) = ([&dq[..], &dk, &dv, &dz], [&dqw[..], &dkw, &dvw, &dzw]);
    assert_grads_close(what, &format!(" {sh:?}"), &got, &want, 1e-9, 1e-11);
    // Without dbias the other gradients are the same bits.
    let (dq2, dk2, dv2, _) = backward(sh, &mask, &q, &k, &v, fwd, &dout, 0.0, None);
    assert!(
        dq2 == dq && dk2 == dk && dv2 == dv,
        "{what}: dbias changed dq/dk/dv"
    );

    // Finite differences of L = Σ dout · out on a few elements of q, k, v and the bias.
    let loss = |q: &[f64], k: &[f64], v: &[f64], m: &Mods| {
        let mut o = vec![0.0; q.len()];
        let mut l = vec![0.0; sh.batch_heads * sh.seq_q];
        attention_forward(sh, &m.mask(), q, k, v, &mut o, &mut l);
        dot64(&dout, &o)
    };
    let h = 1e-5;
    for which in 0..3 {
        for _ in 0..3 {
            let (mut qp, mut kp, mut vp) = (q.clone(), k.clone(), v.clone());
            let (mut qm, mut km, mut vm) = (q.clone(), k.clone(), v.clone());
            let (bufs, grads): ([&mut Vec<f64>; 2], &[f64]) = match which {
                0 => ([&mut qp, &mut qm], &dq),
                1 => ([&mut kp, &mut km], &dk),
                _ => ([&mut vp, &mut vm], &dv),
            };
            let i = rng.below(grads.len());
            let [p, mm] = bufs;
            p[i] += h;
            mm[i] -= h;
            let fd = (loss(&qp, &kp, &vp, m) - loss(&qm, &km, &vm, m)) / (2.0 * h);
            assert!(
                (fd - grads[i]).abs() <= 1e-6 * (1.0 + fd.abs()),
                "{what} fd {sh:?} tensor {which} element {i}: fd {fd} analytic {}",
                grads[i]
            );
        }
    }
    if let Some((bd, bl)) = &m.bias {
        // dL/dbias[e] = Σ of dz over the score positions that read element e.
        let heads = m.heads;
        for _ in 0..4 {
            let e = rng.below(bd.len());
            if !bd[e].is_finite() {
                continue;
            }
            let mut analytic = 0.0;
            for b in 0..sh.batch_heads {
                for i in 0..sh.seq_q {
                    for j in 0..sh.seq_k {
                        let at = bl.offset
                            + (b / heads) * bl.batch_stride
                            + (b % heads) * bl.head_stride
                            + i * bl.row_stride
                            + j * bl.col_stride;
                        if at == e {
                            analytic += dz[(b * sh.seq_q + i) * sh.seq_k + j];
                        }
                    }
                }
            }
            let shift = |delta: f64| {
                let mut bb = bd.clone();
                bb[e] += delta;
                let mm = Mods {
                    heads,
                    pad: m.pad.clone(),
                    bias: Some((bb, *bl)),
                };
                loss(&q, &k, &v, &mm)
            };
            let fd = (shift(h) - shift(-h)) / (2.0 * h);
            assert!(
                (fd - analytic).abs() <= 1e-6 * (1.0 + fd.abs()),
                "{what} fd {sh:?} bias element {e}: fd {fd} analytic {analytic}"
            );
        }
    }

    // f32 kernel against the reference on rounded inputs.
    let [q32, k32, v32, do32] = round([&q, &k, &v, &dout]);
    let b32 = m.bias32();
    let mask32 = ScoreMask {
        heads: m.heads,
        key_padding: m.pad.as_deref(),
        bias: b32.as_ref().map(|(d, l)| (&d[..], *l)),
    };
    let mr = m.rounded();
    let [qr, kr, vr, dr] = widen([&q32, &k32, &v32, &do32]);
    let (ow, _, _) = masked_forward_ref(&sh, &mr, &qr, &kr, &vr);
    let (out32, lse32) = forward(sh, &mask32, &q32, &k32, &v32, f32::NAN);
    assert_close(
        &format!("{what} out f32 {sh:?}"),
        &to_f64(&out32),
        &ow,
        1e-4,
        1e-5,
    );
    let fwd32 = (&out32[..], &lse32[..]);
    let (dq32, dk32, dv32, dz32) = backward(
        sh,
        &mask32,
        &q32,
        &k32,
        &v32,
        fwd32,
        &do32,
        0f32,
        Some(f32::NAN),
    );
    let dz32 = dz32.unwrap();
    let (dqw, dkw, dvw, dzw) = masked_backward_ref(&sh, &mr, &qr, &kr, &vr, &dr);
    let atol = 2e-5 * (sh.seq_q.max(sh.seq_k) as f64).sqrt();
    let [dq64, dk64, dv64, dz64] = widen([&dq32, &dk32, &dv32, &dz32]);
    let (got, want) = (
        [&dq64[..], &dk64, &dv64, &dz64],
        [&dqw[..], &dkw, &dvw, &dzw],
    );
    assert_grads_close(what, " f32", &got, &want, 1e-3, atol);
    for x in out32
        .iter()
        .chain(&dq32)
        .chain(&dk32)
        .chain(&dv32)
        .chain(&dz32)
    {
        assert!(!x.is_nan(), "{what}: NaN in an f32 result");
    }
}

/// `(batch, heads, seq_q, seq_k, head_dim)` of the masked cases (key counts crossing tiles).
const MASKED_SIZES: &[(usize, usize, usize, usize, usize)] = &[
    (1, 1, 1, 1, 1),
    (2, 2, 5, 5, 8),
    (3, 2, 7, 13, 16),
    (3, 1, 33, 70, 24),
    (4, 2, 40, 130, 32),
    (1, 3, 65, 65, 8),
];

fn masked_shape(
    b: usize,
    h: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
) -> AttentionShape {
    shape(b * h, sq, sk, d, causal)
}

#[test]
fn key_padding_matches_the_reference() {
    let mut rng = Rng(0x9ad);
    for &(b, h, sq, sk, d) in MASKED_SIZES {
        let m = Mods {
            heads: h,
            pad: Some(padding(b, sk, &mut rng)),
            bias: None,
        };
        check_masked(
            "padding",
            masked_shape(b, h, sq, sk, d, false),
            &m,
            &mut rng,
        );
    }
}

#[test]
fn bias_matches_the_reference_for_every_broadcast() {
    let mut rng = Rng(0xb1a5);
    for &(b, h, sq, sk, d) in MASKED_SIZES {
        for (dims, neg_inf) in [
            ([b, h, sq, sk], false),
            ([1, h, sq, sk], true),
            ([b, 1, 1, sk], false),
            ([1, 1, sq, sk], false),
            ([b, h, sq, 1], false),
        ] {
            let m = Mods {
                heads: h,
                pad: None,
                bias: Some(bias(dims, &mut rng, neg_inf)),
            };
            check_masked(
                &format!("bias {dims:?}"),
                masked_shape(b, h, sq, sk, d, false),
                &m,
                &mut rng,
            );
        }
    }
}

#[test]
fn causal_padding_and_bias_combine() {
    let mut rng = Rng(0xc0b);
    for &(b, h, sq, sk, d) in MASKED_SIZES {
        let m = Mods {
            heads: h,
            pad: Some(padding(b, sk, &mut rng)),
            bias: Some(bias([1, h, sq, sk], &mut rng, true)),
        };
        check_masked(
            "causal+padding+bias",
            masked_shape(b, h, sq, sk, d, true),
            &m,
            &mut rng,
        );
    }
}

#[test]
fn fully_masked_rows_give_zeros_not_nan() {
    // Batch entry 0 pads every key; in batch entry 1 query row 2 has a bias of -inf everywhere.
    let (b, h, sq, sk, d) = (2, 2, 4, 70, 8);
    let sh = masked_shape(b, h, sq, sk, d, false);
    let mut rng = Rng(0xf11);
    let mut pad = vec![1u8; b * sk];
    pad[..sk].fill(0);
    let (mut bias_v, bl) = bias([1, 1, sq, sk], &mut rng, false);
    bias_v[2 * sk..3 * sk].fill(f64::NEG_INFINITY);
    let m = Mods {
        heads: h,
        pad: Some(pad),
        bias: Some((bias_v, bl)),
    };
    check_masked("fully masked", sh, &m, &mut rng);
    let (q, k, v) = inputs(&mut rng, &sh);
    let dout = rng.vec(q.len(), -1.0, 1.0);
    let (out, lse) = forward(sh, &m.mask(), &q, &k, &v, f64::NAN);
    let fwd = (&out[..], &lse[..]);
    let (dq, dk, dv, dz) = backward(sh, &m.mask(), &q, &k, &v, fwd, &dout, 1.0, Some(1.0));
    let dz = dz.unwrap();
    let dead_row = |bh: usize, i: usize| bh < h || i == 2;
    for bh in 0..b * h {
        for i in 0..sq {
            if dead_row(bh, i) {
                let r = (bh * sq + i) * d;
                assert!(out[r..r + d].iter().all(|&x| x == 0.0), "out row {bh} {i}");
                assert!(dq[r..r + d].iter().all(|&x| x == 0.0), "dq row {bh} {i}");
                let z = (bh * sq + i) * sk;
                assert!(dz[z..z + sk].iter().all(|&x| x == 0.0), "dz row {bh} {i}");
                assert_eq!(lse[bh * sq + i], f64::NEG_INFINITY);
            }
        }
    }
    // Batch entry 0 has no live row at all: its keys get no gradient.
    assert!(dk[..h * sk * d]
        .iter()
        .chain(&dv[..h * sk * d])
        .all(|&x| x == 0.0));
}

#[test]
fn an_all_ones_padding_mask_gives_the_unmasked_bits() {
    // The masked instances do the same arithmetic as the unmasked ones when nothing is masked.
    let mut rng = Rng(0x5a3e);
    for causal in [false, true] {
        let sh = shape(4, 70, 130, 32, causal);
        let (q, k, v) = inputs(&mut rng, &sh);
        let [q, k, v] = round([&q, &k, &v]);
        let dout = to_f32(&rng.vec(q.len(), -1.0, 1.0));
        let ones = vec![1u8; 2 * sh.seq_k];
        let zero_bias = vec![0f32; sh.seq_k];
        let run = |mask: &ScoreMask<'_, f32>| {
            let (out, lse) = forward(sh, mask, &q, &k, &v, 0f32);
            let grads = backward(sh, mask, &q, &k, &v, (&out, &lse), &dout, 0f32, None);
            (out, lse, grads)
        };
        let plain = run(&ScoreMask::none());
        let padded = run(&ScoreMask {
            heads: 2,
            key_padding: Some(&ones),
            bias: None,
        });
        let biased = run(&ScoreMask {
            heads: 2,
            key_padding: None,
            bias: Some((
                &zero_bias,
                BiasLayout {
                    offset: 0,
                    batch_stride: 0,
                    head_stride: 0,
                    row_stride: 0,
                    col_stride: 1,
                },
            )),
        });
        assert!(
            plain == padded,
            "all-ones padding differs (causal={causal})"
        );
        assert!(plain == biased, "zero bias differs (causal={causal})");
    }
}

#[test]
fn masked_strided_qkv_layouts_match_the_reference() {
    let mut rng = Rng(0x57d);
    for &(b, heads, t, d, causal) in &[
        (3usize, 2usize, 37usize, 16usize, true),
        (3, 3, 70, 8, false),
    ] {
        let c = heads * d;
        let bh = b * heads;
        let sh = shape(bh, t, t, d, causal);
        let f = Fused::new(heads, bh, t, d);
        let m = Mods {
            heads,
            pad: Some(padding(b, t, &mut rng)),
            bias: Some(bias([b, 1, 1, t], &mut rng, false)),
        };
        let mask = m.mask();
        let qkv = rng.vec(b * t * 3 * c, -2.0, 2.0);
        let dout = rng.vec(b * t * c, -1.0, 1.0);
        let [q, k, v] = f.gather3(&qkv);
        let (ow, lw, _) = masked_forward_ref(&sh, &m, &q, &k, &v);
        let (out, lse) = f.forward(sh, &mask, &qkv, f64::NAN);
        let og = f.gather(&out, f.out);
        assert_close("masked strided out", &og, &ow, 1e-10, 1e-12);
        assert_close("masked strided lse", &lse, &lw, 1e-12, 1e-12);
        let dog = f.gather(&dout, f.out);
        let (dqw, dkw, dvw, dzw) = masked_backward_ref(&sh, &m, &q, &k, &v, &dog);
        let fwd = (&out[..], &lse[..]);
        let (g, dz) = f.backward(sh, &mask, &qkv, fwd, &dout, f64::NAN, Some(f64::NAN));
        let dz = dz.unwrap();
        let [gq, gk, gv] = f.gather3(&g);
        let (got, want) = ([&gq[..], &gk, &gv, &dz], [&dqw[..], &dkw, &dvw, &dzw]);
        assert_grads_close("masked strided", "", &got, &want, 1e-9, 1e-11);
    }
}

#[test]
fn masked_backward_is_deterministic_across_thread_counts() {
    let (b, h) = (2, 3);
    let sh = shape(b * h, 96, 96, 32, true);
    let mut rng = Rng(3);
    let (q, k, v) = inputs(&mut rng, &sh);
    let [q, k, v] = round([&q, &k, &v]);
    let dout = to_f32(&rng.vec(q.len(), -1.0, 1.0));
    let pad = padding(b, sh.seq_k, &mut rng);
    let (bias_v, bl) = bias([1, h, sh.seq_q, sh.seq_k], &mut rng, true);
    let bias_v = to_f32(&bias_v);
    let mask = ScoreMask {
        heads: h,
        key_padding: Some(&pad),
        bias: Some((&bias_v, bl)),
    };
    let run = || {
        let (out, lse) = forward(sh, &mask, &q, &k, &v, 0f32);
        let grads = backward(sh, &mask, &q, &k, &v, (&out, &lse), &dout, 0f32, Some(0f32));
        (out, lse, grads)
    };
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    assert!(pool(1).install(run) == pool(3).install(run));
}

#[test]
fn masked_head_dim_zero() {
    // d == 0: lse is the log-sum-exp of the visible keys' bias, dz is 0.
    let (b, h, sq, sk) = (2, 1, 3, 5);
    let sh = shape(b * h, sq, sk, 0, false);
    let mut rng = Rng(9);
    let m = Mods {
        heads: h,
        pad: Some(padding(b, sk, &mut rng)),
        bias: Some(bias([1, 1, sq, sk], &mut rng, false)),
    };
    let (_, lw, _) = masked_forward_ref(&sh, &m, &[], &[], &[]);
    let mut lse = vec![f64::NAN; b * sq];
    attention_forward(sh, &m.mask(), &[], &[], &[], &mut [], &mut lse);
    assert_close("d=0 lse", &lse, &lw, 1e-12, 1e-12);
    let mut dz = vec![f64::NAN; b * sq * sk];
    attention_backward(
        sh,
        &m.mask(),
        &[],
        &[],
        &[],
        &[],
        &lse,
        &[],
        &mut [],
        &mut [],
        &mut [],
        Some(&mut dz),
    );
    assert!(dz.iter().all(|&x| x == 0.0));
}

#[test]
#[should_panic(expected = "key padding has")]
fn a_padding_mask_of_the_wrong_size_panics() {
    let sh = shape(4, 3, 5, 2, false);
    let x = vec![0.5f32; 4 * 5 * 2];
    let pad = vec![1u8; 5];
    let mask = ScoreMask {
        heads: 2,
        key_padding: Some(&pad),
        bias: None,
    };
    let mut out = vec![0f32; 4 * 3 * 2];
    let mut lse = vec![0f32; 12];
    attention_forward(sh, &mask, &x[..24], &x, &x, &mut out, &mut lse);
}

#[test]
#[should_panic(expected = "bias layout")]
fn a_bias_outside_its_buffer_panics() {
    let sh = shape(2, 3, 5, 2, false);
    let x = vec![0.5f32; 2 * 5 * 2];
    let b = vec![0f32; 14];
    let mask = ScoreMask {
        heads: 1,
        key_padding: None,
        bias: Some((&b, BiasLayout::contiguous(1, 3, 5))),
    };
    let mut out = vec![0f32; 12];
    let mut lse = vec![0f32; 6];
    attention_forward(sh, &mask, &x[..12], &x, &x, &mut out, &mut lse);
}
