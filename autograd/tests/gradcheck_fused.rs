//! The fused ops of Llama- and BERT-style models against central finite differences
//! (`gradcheck`, f64): attention with a key padding mask and a bias (whose gradient is checked
//! too), RMSNorm, rotary position embedding, SwiGLU and linear + GELU, with non-contiguous
//! inputs (views taken inside the checked function); linear + GELU also bit for bit against
//! `linear` then `gelu` on the CPU.

use crate::common;

use common::*;
use meshgrad_autograd::Var;
use meshgrad_tensor::{AttentionMask, DType, Device, GeluKind, Tensor};

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

#[test]
fn rms_norm_with_and_without_weight() {
    let x = rand(40, &[3, 2, 5], -2.0, 2.0);
    let w = rand(41, &[5], 0.5, 1.5);
    gc(
        "rms_norm with weight",
        |v| v[0].rms_norm(Some(&v[1]), 1e-6),
        &[x.clone(), w.clone()],
    );
    gc(
        "rms_norm without weight",
        |v| v[0].rms_norm(None, 0.0),
        std::slice::from_ref(&x),
    );
    // Non-contiguous input and weight views: x read through a transpose, w reversed via a
    // transposed [5, 1] leaf.
    let xt = rand(42, &[5, 3, 2], -2.0, 2.0);
    let wt = rand(43, &[1, 5], 0.5, 1.5);
    gc(
        "rms_norm of views",
        |v| {
            let w = v[1].transpose(0, 1)?.reshape(5)?;
            v[0].permute(&[1, 2, 0])?.rms_norm(Some(&w), 1e-5)
        },
        &[xt, wt],
    );
}

#[test]
fn rms_norm_weight_without_grad_gets_none() {
    let x = Var::leaf(rand(44, &[2, 4], -1.0, 1.0));
    let w = Var::constant(rand(45, &[4], 0.5, 1.5));
    x.rms_norm(Some(&w), 1e-6)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(x.grad().is_some() && w.grad().is_none());
    // eps is checked.
    assert!(x.rms_norm(None, -1.0).is_err());
    assert!(x.rms_norm(None, f64::NAN).is_err());
}

#[test]
fn rotary_embedding_gradient() {
    let pos = Tensor::from_vec(vec![5i64, 0, 9, 2], 4, Device::Cpu).unwrap();
    // [B, T, H, D] = [2, 4, 2, 6] read through a transposed [B, H, T, D] leaf.
    let x = rand(50, &[2, 2, 4, 6], -1.0, 1.0);
    gc(
        "rotary_embedding of a view",
        |v| v[0].transpose(1, 2)?.rotary_embedding(&pos, 10_000.0),
        std::slice::from_ref(&x),
    );
    gc(
        "rotary_embedding theta 3",
        |v| v[0].rotary_embedding(&pos, 3.0),
        &[rand(51, &[1, 4, 1, 4], -1.0, 1.0)],
    );
}

#[test]
fn swiglu_gradient() {
    let g = rand(60, &[3, 4], -4.0, 4.0);
    let u = rand(61, &[4, 3], -2.0, 2.0);
    gc(
        "swiglu (up through a transpose)",
        |v| Var::swiglu(&v[0], &v[1].transpose(0, 1)?),
        &[g.clone(), u.clone()],
    );
    // Only one input requires grad.
    let (gv, uv) = (Var::leaf(g), Var::constant(u.transpose(0, 1).unwrap()));
    Var::swiglu(&gv, &uv)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(gv.grad().is_some() && uv.grad().is_none());
}

#[test]
fn linear_gelu_gradient() {
    let x = rand(80, &[2, 3, 5], -2.0, 2.0);
    let w = rand(81, &[4, 5], -1.0, 1.0);
    let wt = rand(82, &[5, 4], -1.0, 1.0);
    let b = rand(83, &[4], -1.0, 1.0);
    for kind in [GeluKind::Tanh, GeluKind::Erf] {
        gc(
            &format!("linear_gelu {kind:?} with bias"),
            |v| Var::linear_gelu(&v[0], &v[1], Some(&v[2]), kind),
            &[x.clone(), w.clone(), b.clone()],
        );
        gc(
            &format!("linear_gelu {kind:?}, no bias, weight through a transpose"),
            |v| Var::linear_gelu(&v[0].transpose(0, 1)?, &v[1].transpose(0, 1)?, None, kind),
            &[x.transpose(0, 1).unwrap().contiguous().unwrap(), wt.clone()],
        );
    }
}

/// The fused op against `linear` then `gelu`: the output and every gradient the same bits (the
/// CPU composes the fused op from exactly those two), in f32 and f64, with and without a bias,
/// with only some inputs requiring grad.
#[test]
fn linear_gelu_is_linear_then_gelu_bit_for_bit_on_the_cpu() {
    let bits = |t: &Tensor| -> Vec<u64> { vals(t).iter().map(|v| v.to_bits()).collect() };
    for dtype in [DType::F32, DType::F64] {
        let x = rand(90, &[3, 4, 24], -2.0, 2.0).to_dtype(dtype).unwrap();
        let w = rand(91, &[40, 24], -0.5, 0.5).to_dtype(dtype).unwrap();
        let b = rand(92, &[40], -0.5, 0.5).to_dtype(dtype).unwrap();
        let dy = rand(93, &[3, 4, 40], -1.0, 1.0).to_dtype(dtype).unwrap();
        for kind in [GeluKind::Tanh, GeluKind::Erf] {
            for (with_bias, x_grad) in [(true, true), (false, true), (true, false)] {
                let what = format!("{dtype:?} {kind:?} bias={with_bias} dx={x_grad}");
                let run = |fused: bool| {
                    let xv = if x_grad {
                        Var::leaf(x.clone())
                    } else {
                        Var::constant(x.clone())
                    };
                    let (wv, bv) = (Var::leaf(w.clone()), Var::leaf(b.clone()));
                    let bias = with_bias.then_some(&bv);
                    let y = if fused {
                        Var::linear_gelu(&xv, &wv, bias, kind).unwrap()
                    } else {
                        Var::linear(&xv, &wv, bias).unwrap().gelu(kind).unwrap()
                    };
                    y.mul(&Var::constant(dy.clone()))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let grads: Vec<Option<Tensor>> =
                        [&xv, &wv, &bv].iter().map(|v| v.grad()).collect();
                    (y.tensor().clone(), grads)
                };
                let (y1, g1) = run(true);
                let (y0, g0) = run(false);
                assert_eq!(y1.dtype(), dtype);
                assert_eq!(bits(&y1), bits(&y0), "{what}: output");
                for (name, (a, e)) in ["dx", "dW", "dbias"].iter().zip(g1.iter().zip(&g0)) {
                    assert_eq!(a.is_some(), e.is_some(), "{what}: {name} presence");
                    if let (Some(a), Some(e)) = (a, e) {
                        assert_eq!(bits(a), bits(e), "{what}: {name}");
                    }
                }
                assert_eq!(g1[0].is_some(), x_grad, "{what}");
                assert_eq!(g1[2].is_some(), with_bias, "{what}");
            }
        }
    }
}

#[test]
fn a_llama_block_end_to_end() {
    // rms_norm -> q/k projections with RoPE -> causal attention with padding -> SwiGLU MLP.
    let (b, t, h, d) = (2, 3, 2, 2);
    let c = h * d;
    let x = rand(70, &[b, t, c], -1.0, 1.0);
    let wn = rand(71, &[c], 0.5, 1.5);
    let wq = rand(72, &[c, c], -0.5, 0.5);
    let wk = rand(73, &[c, c], -0.5, 0.5);
    let wg = rand(74, &[c, 5], -0.5, 0.5);
    let wu = rand(75, &[c, 5], -0.5, 0.5);
    let pos = Tensor::arange(0, t as i64, meshgrad_tensor::DType::I64, Device::Cpu).unwrap();
    let pad = padding(b, t, &[(1, 2)]);
    gc(
        "llama block",
        |v| {
            let n = v[0].rms_norm(Some(&v[1]), 1e-6)?;
            let heads = |p: &Var| -> meshgrad_tensor::Result<Var> {
                p.reshape((b, t, h, d))?
                    .rotary_embedding(&pos, 10_000.0)?
                    .transpose(1, 2)
            };
            let q = heads(&n.matmul(&v[2])?)?;
            let k = heads(&n.matmul(&v[3])?)?;
            let val = n.reshape((b, t, h, d))?.transpose(1, 2)?;
            let m = AttentionMask::causal().with_key_padding(pad.clone());
            let a = Var::attention(&q, &k, &val, &m, 0.7)?
                .transpose(1, 2)?
                .reshape((b, t, c))?;
            Var::swiglu(&a.matmul(&v[4])?, &a.matmul(&v[5])?)
        },
        &[x, wn, wq, wk, wg, wu],
    );
}
