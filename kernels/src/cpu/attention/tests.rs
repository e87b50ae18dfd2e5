//! Tests of fused attention against a naive f64 reference and finite differences.
#![allow(clippy::needless_range_loop)]

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
            let visible: Vec<usize> = (0..sk).filter(|&j| !causal || j + sq <= i + sk).collect();
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
        let (dqw, dkw, dvw) = backward_ref(&sh, &qr, &kr, &vr, &gather(&d64, ol, heads, bh, t, d));
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
