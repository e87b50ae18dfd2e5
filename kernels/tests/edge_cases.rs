//! Empty and degenerate sizes must not panic (and must write what the contracts promise).

use meshgrad_kernels::cpu::adamw::adamw_step;
use meshgrad_kernels::cpu::attention::{attention_backward, attention_forward, ScoreMask};
use meshgrad_kernels::cpu::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use meshgrad_kernels::cpu::elementwise::{binary, compare, unary, where_cond, View};
use meshgrad_kernels::cpu::embedding::{embedding_backward, embedding_forward};
use meshgrad_kernels::cpu::layer_norm::{layer_norm_backward, layer_norm_forward};
use meshgrad_kernels::cpu::matmul::matmul;
use meshgrad_kernels::cpu::sgd::sgd_step;
use meshgrad_kernels::cpu::softmax::{log_softmax_forward, softmax_backward, softmax_forward};
use meshgrad_kernels::cpu::strided::copy_strided;
use meshgrad_kernels::ops::{AdamWStep, AttentionShape, BinaryOp, CmpOp, MatrixLayout, UnaryOp};
use meshgrad_kernels::rng::{fill_normal, fill_uniform};

#[test]
fn zero_sized_inputs() {
    let e: [f32; 0] = [];
    let mut o: [f32; 0] = [];
    unary(UnaryOp::Exp, &e, &mut o);
    let v = View {
        data: &e[..],
        offset: 0,
        strides: &[1, 0],
    };
    binary(BinaryOp::Add, &[0, 3], v, v, &mut o);
    let mut m: [u8; 0] = [];
    compare(CmpOp::Lt, &[0, 3], v, v, &mut m);
    where_cond(
        &[0, 3],
        View {
            data: &[] as &[u8],
            offset: 0,
            strides: &[1, 0],
        },
        v,
        v,
        &mut o,
    );
    copy_strided(&e, 0, &[3, 0], &[0, 1], &mut o);
    for (rows, cols) in [(0, 5), (5, 0), (0, 0)] {
        let x = vec![0.5f32; rows * cols];
        let mut y = vec![0f32; rows * cols];
        softmax_forward(&x, rows, cols, &mut y);
        log_softmax_forward(&x, rows, cols, &mut y);
        let mut dx = vec![0f32; rows * cols];
        softmax_backward(&x, &x, rows, cols, &mut dx);
        let (mut mean, mut rstd) = (vec![9f32; rows], vec![9f32; rows]);
        layer_norm_forward(
            &x, None, None, rows, cols, 1e-5, &mut y, &mut mean, &mut rstd,
        );
        let (mut dw, mut db) = (vec![9f32; cols], vec![9f32; cols]);
        layer_norm_backward(
            &x,
            None,
            &mean,
            &rstd,
            &x,
            rows,
            cols,
            &mut dx,
            Some(&mut dw),
            Some(&mut db),
        );
        assert!(
            dw.iter().chain(&db).all(|&g| g == 0.0),
            "empty sums are zero"
        );
        let targets = vec![-100i64; rows];
        let (mut loss, mut lse) = (vec![9f32; rows], vec![9f32; rows]);
        cross_entropy_forward(&x, &targets, rows, cols, Some(-100), &mut loss, &mut lse).unwrap();
        assert!(loss.iter().all(|&l| l == 0.0));
        cross_entropy_backward(&x, &lse, &targets, rows, cols, Some(-100), &loss, &mut dx);
    }
    embedding_forward(&[1.0f32; 6], 3, 2, &[], &mut o).unwrap();
    let mut dw = [0f32; 6];
    embedding_backward(&e, &[], 3, 2, &mut dw).unwrap();
    let sh = AttentionShape {
        batch_heads: 0,
        seq_q: 4,
        seq_k: 4,
        head_dim: 8,
        causal: true,
        scale: 1.0,
    };
    attention_forward(sh, &ScoreMask::none(), &e, &e, &e, &mut o, &mut []);
    attention_backward(
        sh,
        &ScoreMask::none(),
        &e,
        &e,
        &e,
        &e,
        &e,
        &e,
        &mut [],
        &mut [],
        &mut [],
        None,
    );
    let l = MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: 1,
        col_stride: 1,
    };
    matmul(0, 3, 3, 3, &e, l, &e, l, &mut o, l, false);
    let hp = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
    };
    adamw_step(&hp, &mut [], &e, &mut [], &mut []);
    sgd_step(0.1, 0.9, 0.0, true, &mut [], &e, &mut []);
    fill_uniform(1, 0, 0.0, 1.0, &mut o);
    fill_normal(1, 0, 0.0, 1.0, &mut o);
}

#[test]
fn single_column_layer_norm_and_softmax() {
    // One column: softmax is 1, layer norm output is the bias (x - mean = 0).
    let x = [3.0f64, -2.0];
    let mut y = [0.0; 2];
    softmax_forward(&x, 2, 1, &mut y);
    assert_eq!(y, [1.0, 1.0]);
    let (mut mean, mut rstd) = ([0.0; 2], [0.0; 2]);
    layer_norm_forward(
        &x,
        Some(&[2.0]),
        Some(&[0.5]),
        2,
        1,
        1e-5,
        &mut y,
        &mut mean,
        &mut rstd,
    );
    assert_eq!(y, [0.5, 0.5]);
    assert_eq!(mean, x);
}
