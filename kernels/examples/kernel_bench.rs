//! Quick throughput figures for the CPU kernels (not a test; timings depend on the machine).
//!
//! `cargo run --release -p meshgrad-kernels --example kernel_bench [nosimd] [filter...]`

use std::time::Instant;

use meshgrad_kernels::cpu::adamw::adamw_step;
use meshgrad_kernels::cpu::attention::{attention_backward, attention_forward, ScoreMask};
use meshgrad_kernels::cpu::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use meshgrad_kernels::cpu::elementwise::{binary, unary, View};
use meshgrad_kernels::cpu::layer_norm::{layer_norm_backward, layer_norm_forward};
use meshgrad_kernels::cpu::matmul::matmul;
use meshgrad_kernels::cpu::softmax::softmax_forward;
use meshgrad_kernels::ops::{
    AdamWStep, AttentionShape, BiasLayout, BinaryOp, MatrixLayout, UnaryOp,
};
use meshgrad_kernels::rng::fill_uniform;

/// Fastest of `reps` runs of `f` after two warm-ups, in seconds (the minimum is the figure least
/// disturbed by other work on a shared machine).
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    f();
    (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    fill_uniform(seed, 0, -1.0, 1.0, &mut v);
    v
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nosimd = args.iter().any(|a| a == "nosimd");
    meshgrad_kernels::cpu::set_simd_enabled(!nosimd);
    let filters: Vec<&String> = args.iter().filter(|a| *a != "nosimd").collect();
    let want = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));
    println!(
        "rayon threads: {}, avx2 loops: {}",
        rayon::current_num_threads(),
        !nosimd
    );

    if want("matmul") {
        for &n in &[128usize, 256, 512, 1024] {
            let a = rand(n * n, 1);
            let b = rand(n * n, 2);
            let mut c = vec![0f32; n * n];
            let l = MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: n,
                col_stride: 1,
            };
            let lt = MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: 1,
                col_stride: n,
            };
            let s = time(7, || matmul(1, n, n, n, &a, l, &b, l, &mut c, l, false));
            let st = time(7, || matmul(1, n, n, n, &a, l, &b, lt, &mut c, l, false));
            let f = 2.0 * (n * n * n) as f64;
            println!(
                "matmul f32 {n}^3: {:.1} GFLOP/s (B transposed: {:.1})",
                f / s / 1e9,
                f / st / 1e9
            );
        }
        // Batched small products (attention-like): [32, 128, 64] x [32, 64, 128].
        let (bt, m, k, n) = (32usize, 128usize, 64usize, 128usize);
        let a = rand(bt * m * k, 3);
        let b = rand(bt * k * n, 4);
        let mut c = vec![0f32; bt * m * n];
        let la = MatrixLayout {
            offset: 0,
            batch_stride: m * k,
            row_stride: k,
            col_stride: 1,
        };
        let lb = MatrixLayout {
            offset: 0,
            batch_stride: k * n,
            row_stride: n,
            col_stride: 1,
        };
        let lc = MatrixLayout {
            offset: 0,
            batch_stride: m * n,
            row_stride: n,
            col_stride: 1,
        };
        let s = time(7, || matmul(bt, m, n, k, &a, la, &b, lb, &mut c, lc, false));
        println!(
            "matmul f32 batched 32x128x128x64: {:.1} GFLOP/s",
            2.0 * (bt * m * n * k) as f64 / s / 1e9
        );
    }

    if want("attention") {
        for &(bh, t, d, causal) in &[
            (32usize, 128usize, 64usize, true),
            (24, 256, 64, true),
            (8, 512, 64, false),
        ] {
            let sh = AttentionShape {
                batch_heads: bh,
                seq_q: t,
                seq_k: t,
                head_dim: d,
                causal,
                scale: 0.125,
            };
            let q = rand(bh * t * d, 5);
            let k = rand(bh * t * d, 6);
            let v = rand(bh * t * d, 7);
            let dout = rand(bh * t * d, 8);
            let mut out = vec![0f32; bh * t * d];
            let mut lse = vec![0f32; bh * t];
            let (mut dq, mut dk, mut dv) = (
                vec![0f32; q.len()],
                vec![0f32; q.len()],
                vec![0f32; q.len()],
            );
            let fwd = time(7, || {
                attention_forward(sh, &ScoreMask::none(), &q, &k, &v, &mut out, &mut lse)
            });
            let bwd = time(7, || {
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
                )
            });
            // Useful flops: 4 t^2 d per head forward (2 matmuls), 10 t^2 d backward (5), halved if causal.
            let frac = if causal { 0.5 } else { 1.0 };
            let ff = 4.0 * (bh * t * t * d) as f64 * frac;
            println!(
                "attention bh{bh} t{t} d{d} causal={causal}: fwd {:.2} ms ({:.1} GFLOP/s), bwd {:.2} ms ({:.1} GFLOP/s)",
                fwd * 1e3,
                ff / fwd / 1e9,
                bwd * 1e3,
                2.5 * ff / bwd / 1e9
            );
            // The masked instances on the same work: a padding mask that masks nothing, an
            // additive [4, t, t] bias shared by the batch, and its gradient.
            let heads = 4;
            let pad = vec![1u8; bh / heads * t];
            let bias = rand(heads * t * t, 9);
            let mut dbias = vec![0f32; bh * t * t];
            let bl = BiasLayout {
                batch_stride: 0,
                ..BiasLayout::contiguous(heads, t, t)
            };
            let mask = ScoreMask {
                heads,
                key_padding: Some(&pad),
                bias: Some((&bias, bl)),
            };
            let mfwd = time(7, || {
                attention_forward(sh, &mask, &q, &k, &v, &mut out, &mut lse)
            });
            let mbwd = time(7, || {
                attention_backward(
                    sh,
                    &mask,
                    &q,
                    &k,
                    &v,
                    &out,
                    &lse,
                    &dout,
                    &mut dq,
                    &mut dk,
                    &mut dv,
                    Some(&mut dbias),
                )
            });
            println!(
                "  with padding + [4, t, t] bias (+ dbias): fwd {:.2} ms, bwd {:.2} ms",
                mfwd * 1e3,
                mbwd * 1e3,
            );
        }
    }

    if want("layer_norm") {
        let (rows, cols) = (1024usize, 256usize);
        let x = rand(rows * cols, 9);
        let w = rand(cols, 10);
        let b = rand(cols, 11);
        let dy = rand(rows * cols, 12);
        let mut y = vec![0f32; rows * cols];
        let (mut m, mut r) = (vec![0f32; rows], vec![0f32; rows]);
        let mut dx = vec![0f32; rows * cols];
        let (mut dw, mut db) = (vec![0f32; cols], vec![0f32; cols]);
        let f = time(21, || {
            layer_norm_forward(
                &x,
                Some(&w),
                Some(&b),
                rows,
                cols,
                1e-5,
                &mut y,
                &mut m,
                &mut r,
            )
        });
        let bk = time(21, || {
            layer_norm_backward(
                &x,
                Some(&w),
                &m,
                &r,
                &dy,
                rows,
                cols,
                &mut dx,
                Some(&mut dw),
                Some(&mut db),
            )
        });
        let gb = (rows * cols * 4) as f64 / 1e9;
        println!(
            "layer_norm 1024x256: fwd {:.1} us ({:.1} GB/s x), bwd {:.1} us",
            f * 1e6,
            gb / f,
            bk * 1e6
        );
    }

    if want("softmax") {
        let (rows, cols) = (4096usize, 128usize);
        let x = rand(rows * cols, 13);
        let mut y = vec![0f32; rows * cols];
        let s = time(21, || softmax_forward(&x, rows, cols, &mut y));
        println!(
            "softmax 4096x128: {:.1} us ({:.2} ns/elem)",
            s * 1e6,
            s * 1e9 / (rows * cols) as f64
        );
    }

    if want("cross_entropy") {
        let (rows, cols) = (1024usize, 256usize);
        let x = rand(rows * cols, 14);
        let t: Vec<i64> = (0..rows as i64).map(|i| i % cols as i64).collect();
        let (mut loss, mut lse) = (vec![0f32; rows], vec![0f32; rows]);
        let dloss = vec![1.0f32 / rows as f32; rows];
        let mut dl = vec![0f32; rows * cols];
        let f = time(21, || {
            cross_entropy_forward(&x, &t, rows, cols, None, &mut loss, &mut lse).unwrap()
        });
        let b = time(21, || {
            cross_entropy_backward(&x, &lse, &t, rows, cols, None, &dloss, &mut dl)
        });
        println!(
            "cross_entropy 1024x256: fwd {:.1} us, bwd {:.1} us",
            f * 1e6,
            b * 1e6
        );
    }

    if want("elementwise") {
        let n = 1 << 20;
        let a = rand(n, 15);
        let b = rand(n, 16);
        let mut o = vec![0f32; n];
        let shape = [1024usize, 1024];
        let cont = [1024usize, 1];
        let add = time(21, || {
            binary(
                BinaryOp::Add,
                &shape,
                View {
                    data: &a,
                    offset: 0,
                    strides: &cont,
                },
                View {
                    data: &b,
                    offset: 0,
                    strides: &cont,
                },
                &mut o,
            )
        });
        let bias = time(21, || {
            binary(
                BinaryOp::Add,
                &shape,
                View {
                    data: &a,
                    offset: 0,
                    strides: &cont,
                },
                View {
                    data: &b,
                    offset: 0,
                    strides: &[0, 1],
                },
                &mut o,
            )
        });
        let gelu = time(21, || unary(UnaryOp::GeluTanh, &a, &mut o));
        let exp = time(21, || unary(UnaryOp::Exp, &a, &mut o));
        println!(
            "elementwise 1M f32: add {:.0} us, bias-add {:.0} us, gelu_tanh {:.0} us, exp {:.0} us",
            add * 1e6,
            bias * 1e6,
            gelu * 1e6,
            exp * 1e6
        );
    }

    if want("adamw") {
        let n = 3_257_856usize;
        let mut p = rand(n, 17);
        let g = rand(n, 18);
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut step = 0;
        let s = time(11, || {
            step += 1;
            let hp = AdamWStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
            };
            adamw_step(&hp, &mut p, &g, &mut m, &mut v)
        });
        println!("adamw 3.26M params: {:.2} ms", s * 1e3);
    }
}
