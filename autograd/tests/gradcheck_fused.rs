//! The fused ops of Llama- and BERT-style models against central finite differences
//! (`gradcheck`, f64): attention with a key padding mask and a bias (whose gradient is checked
//! too), RMSNorm, rotary position embedding and SwiGLU, with non-contiguous inputs (views taken
//! inside the checked function).

mod common;

use common::*;
use meshgrad_autograd::Var;
use meshgrad_tensor::{AttentionMask, Device, Tensor};

/// A `[B, Tk]` padding mask of i64 with the given zeros.
fn padding(b: usize, tk: usize, masked: &[(usize, usize)]) -> Tensor {
    let mut p = vec![1i64; b * tk];
    for &(bi, j) in masked {
        p[bi * tk + j] = 0;
    }
    Tensor::from_vec(p, (b, tk), Device::Cpu).unwrap()
}

#[test]
fn attention_with_padding_and_bias() {
    // q, k, v [B, H, T, D] as transposed views of [B, T, H, D] leaves; the bias [H, Tq, Tk] is a
    // leaf too, so its gradient (summed over the batch) is checked.
    let (b, h, tq, tk, d) = (2, 2, 3, 4, 3);
    for causal in [false, true] {
        let q = rand(1, &[b, tq, h, d], -1.0, 1.0);
        let k = rand(2, &[b, tk, h, d], -1.0, 1.0);
        let v = rand(3, &[b, tk, h, d], -1.0, 1.0);
        let bias = rand(4, &[h, tq, tk], -1.0, 1.0);
        // Batch 0 hides key 1; batch 1 hides keys 0 and 3.
        let pad = padding(b, tk, &[(0, 1), (1, 0), (1, 3)]);
        let f = |x: &[Var]| {
            let m = AttentionMask {
                causal,
                ..AttentionMask::none()
            }
            .with_key_padding(pad.clone())
            .with_bias(x[3].clone());
            Var::attention(
                &x[0].transpose(1, 2)?,
                &x[1].transpose(1, 2)?,
                &x[2].transpose(1, 2)?,
                &m,
                0.6,
            )
        };
        gc(
            &format!("attention padding+bias causal={causal}"),
            f,
            &[q.clone(), k.clone(), v.clone(), bias.clone()],
        );
    }
    // Bias broadcast [B, 1, 1, Tk] given as a strided view (a transposed [Tk, B] leaf), alone.
    let q = rand(5, &[b, h, tq, d], -1.0, 1.0);
    let k = rand(6, &[b, h, tk, d], -1.0, 1.0);
    let bias_t = rand(7, &[tk, b], -1.0, 1.0);
    gc(
        "attention bias [B,1,1,Tk]",
        |x| {
            let bias = x[2].transpose(0, 1)?.reshape((b, 1, 1, tk))?;
            Var::attention(
                &x[0],
                &x[1],
                &x[1],
                &AttentionMask::none().with_bias(bias),
                0.5,
            )
        },
        &[q, k, bias_t],
    );
}

#[test]
fn attention_with_a_fully_masked_row() {
    // Batch 1 hides every key: its rows are 0 and pass no gradient; the rest still checks.
    let (b, h, t, d) = (2, 1, 3, 2);
    let q = rand(10, &[b, h, t, d], -1.0, 1.0);
    let k = rand(11, &[b, h, t, d], -1.0, 1.0);
    let v = rand(12, &[b, h, t, d], -1.0, 1.0);
    let bias = rand(13, &[t, t], -1.0, 1.0);
    let pad = padding(b, t, &[(1, 0), (1, 1), (1, 2)]);
    let f = |x: &[Var]| {
        let m = AttentionMask::causal()
            .with_key_padding(pad.clone())
            .with_bias(x[3].clone());
        Var::attention(&x[0], &x[1], &x[2], &m, 0.7)
    };
    gc(
        "attention fully masked batch",
        f,
        &[q.clone(), k.clone(), v.clone(), bias.clone()],
    );
    let xs: Vec<Var> = [q, k, v, bias].into_iter().map(Var::leaf).collect();
    let y = f(&xs).unwrap();
    let out = vals(y.tensor());
    assert!(
        out[t * d..].iter().all(|&x| x == 0.0),
        "masked batch output"
    );
    y.sum_all().unwrap().backward().unwrap();
    for x in &xs[..3] {
        let g = grad_of(x);
        assert!(g.iter().all(|x| x.is_finite()));
        assert!(
            g[t * d..].iter().all(|&x| x == 0.0),
            "masked batch gradient"
        );
    }
}

#[test]
fn attention_qkv_with_padding_and_bias() {
    let (b, t, heads) = (2, 4, 2);
    let qkv = rand(20, &[b, t, 12], -1.0, 1.0); // 2 heads of 2
    let bias = rand(21, &[b, 1, t, t], -1.0, 1.0);
    let pad = padding(b, t, &[(0, 3), (1, 1)]);
    for causal in [true, false] {
        gc(
            &format!("attention_qkv padding+bias causal={causal}"),
            |v| {
                let m = AttentionMask {
                    causal,
                    key_padding: Some(pad.clone()),
                    bias: Some(v[1].clone()),
                };
                Var::attention_qkv(&v[0], heads, &m, 0.6)
            },
            &[qkv.clone(), bias.clone()],
        );
    }
}

#[test]
fn attention_bias_without_grad_gets_none() {
    // A constant bias: the op records it as an input but computes no gradient for it.
    let q = Var::leaf(rand(30, &[1, 2, 3, 2], -1.0, 1.0));
    let bias = Var::constant(rand(31, &[3, 3], -1.0, 1.0));
    let y = Var::attention(
        &q,
        &q,
        &q,
        &AttentionMask::none().with_bias(bias.clone()),
        0.5,
    )
    .unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert!(q.grad().is_some());
    assert!(bias.grad().is_none());
}
