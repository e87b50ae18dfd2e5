//! The AVX2 and portable instances of the CPU kernels' loops must give bit-identical results
//! (the crate documents that results never depend on which instance runs). This file is its own
//! test process, so toggling the global switch cannot disturb other tests.

use meshgrad_kernels::cpu::adamw::adamw_step;
use meshgrad_kernels::cpu::attention::{attention_backward, attention_forward, ScoreMask};
use meshgrad_kernels::cpu::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use meshgrad_kernels::cpu::elementwise::{binary, gelu_backward, unary, View};
use meshgrad_kernels::cpu::layer_norm::{layer_norm_backward, layer_norm_forward};
use meshgrad_kernels::cpu::reduce::sum;
use meshgrad_kernels::cpu::set_simd_enabled;
use meshgrad_kernels::cpu::softmax::{
    log_softmax_backward, log_softmax_forward, softmax_backward, softmax_forward,
};
use meshgrad_kernels::ops::{AdamWStep, AttentionShape, BinaryOp, UnaryOp};
use meshgrad_kernels::rng::{fill_normal, fill_uniform};

fn rand(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    fill_uniform(seed, 0, -scale, scale, &mut v);
    v
}

/// Runs a selection of kernels and returns every output, as bits.
fn run_all() -> Vec<Vec<u32>> {
    let mut outs: Vec<Vec<f32>> = Vec::new();
    let n = 70_001;
    let x = rand(n, 1, 6.0);
    for op in [
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::GeluTanh,
        UnaryOp::GeluErf,
        UnaryOp::Log,
        UnaryOp::PowScalar(1.5),
        UnaryOp::Relu,
    ] {
        let mut y = vec![0f32; n];
        unary(op, &x, &mut y);
        outs.push(y);
    }
    let dy = rand(n, 2, 1.0);
    for tanh_form in [true, false] {
        let mut dx = vec![0f32; n];
        gelu_backward(tanh_form, &x, &dy, &mut dx);
        outs.push(dx);
    }
    let (rows, cols) = (301usize, 233usize);
    let a = rand(rows * cols, 3, 3.0);
    let b = rand(cols, 4, 3.0);
    let mut o = vec![0f32; rows * cols];
    binary(
        BinaryOp::Div,
        &[rows, cols],
        View {
            data: &a,
            offset: 0,
            strides: &[cols, 1],
        },
        View {
            data: &b,
            offset: 0,
            strides: &[0, 1],
        },
        &mut o,
    );
    outs.push(o);
    let g = rand(rows * cols, 5, 1.0);
    let mut y = vec![0f32; rows * cols];
    let mut dx = vec![0f32; rows * cols];
    softmax_forward(&a, rows, cols, &mut y);
    softmax_backward(&y, &g, rows, cols, &mut dx);
    outs.push(y.clone());
    outs.push(dx.clone());
    log_softmax_forward(&a, rows, cols, &mut y);
    log_softmax_backward(&y, &g, rows, cols, &mut dx);
    outs.push(y.clone());
    outs.push(dx.clone());
    let w = rand(cols, 6, 1.0);
    let (mut mean, mut rstd) = (vec![0f32; rows], vec![0f32; rows]);
    layer_norm_forward(
        &a,
        Some(&w),
        Some(&b),
        rows,
        cols,
        1e-5,
        &mut y,
        &mut mean,
        &mut rstd,
    );
    let (mut dw, mut db) = (vec![0f32; cols], vec![0f32; cols]);
    layer_norm_backward(
        &a,
        Some(&w),
        &mean,
        &rstd,
        &g,
        rows,
        cols,
        &mut dx,
        Some(&mut dw),
        Some(&mut db),
    );
    outs.extend([y.clone(), mean, rstd, dx.clone(), dw, db]);
    let targets: Vec<i64> = (0..rows as i64).map(|r| (r * 7) % cols as i64).collect();
    let (mut loss, mut lse) = (vec![0f32; rows], vec![0f32; rows]);
    cross_entropy_forward(&a, &targets, rows, cols, Some(0), &mut loss, &mut lse).unwrap();
    let dloss = rand(rows, 7, 1.0);
    cross_entropy_backward(&a, &lse, &targets, rows, cols, Some(0), &dloss, &mut dx);
    outs.extend([loss, lse, dx.clone()]);
    let mut s = vec![0f32; rows];
    sum(&a, rows, cols, 1, &mut s);
    outs.push(s);

    for causal in [false, true] {
        let sh = AttentionShape {
            batch_heads: 3,
            seq_q: 70,
            seq_k: 150,
            head_dim: 40,
            causal,
            scale: 0.15,
        };
        let q = rand(3 * 70 * 40, 8, 2.0);
        let k = rand(3 * 150 * 40, 9, 2.0);
        let v = rand(3 * 150 * 40, 10, 1.0);
        let dout = rand(3 * 70 * 40, 11, 1.0);
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![0f32; 3 * 70];
        attention_forward(sh, &ScoreMask::none(), &q, &k, &v, &mut out, &mut lse);
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; q.len()],
            vec![0f32; k.len()],
            vec![0f32; v.len()],
        );
        attention_backward(
            sh,
            &ScoreMask::none(),
            &q,
            &k,
            &v,
            &out,
            &lse,
            &dout,
            &mut dq,
            &mut dk,
            &mut dv,
            None,
        );
        outs.extend([out, lse, dq, dk, dv]);
    }

    let mut p = rand(50_000, 12, 1.0);
    let grad = rand(50_000, 13, 1.0);
    let (mut m, mut v) = (vec![0f32; 50_000], vec![0f32; 50_000]);
    for step in 1..=3 {
        let hp = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
        };
        adamw_step(&hp, &mut p, &grad, &mut m, &mut v);
    }
    outs.extend([p, m, v]);
    let mut z = vec![0f32; 40_000];
    fill_normal(5, 17, 0.0, 1.0, &mut z);
    outs.push(z);

    outs.into_iter()
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn avx2_and_portable_loops_agree_bit_for_bit() {
    set_simd_enabled(true);
    let fast = run_all();
    set_simd_enabled(false);
    let portable = run_all();
    set_simd_enabled(true);
    assert_eq!(fast.len(), portable.len());
    for (i, (a, b)) in fast.iter().zip(&portable).enumerate() {
        let first = a.iter().zip(b).position(|(x, y)| x != y);
        assert!(first.is_none(), "output {i} differs at element {first:?}");
    }
}
