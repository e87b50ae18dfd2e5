//! The checks of the self-check ([`CASES`]): each builds its inputs in the [`Env`], runs one op
//! (or a short composition) forward, then backward from `sum(out * w)` with fixed random weights
//! `w`, and returns the output and every input gradient.

use meshgrad_autograd::Var;
use meshgrad_tensor::{AttentionMask, DType, Device, GeluKind, Result, Tensor};

use super::{Case, Env};
use crate::optim::{AdamW, AdamWConfig, Optimizer, ParamGroup};

type Named = Vec<(&'static str, Tensor)>;

/// `out`, then the gradients of `sum(out * w)` with respect to `inputs` (in order).
fn with_grads(env: &Env, out: &Var, inputs: &[(&'static str, &Var)], seed: u64) -> Result<Named> {
    let w = Var::constant(env.randn(out.tensor().dims(), seed)?);
    out.mul(&w)?.sum_all()?.backward()?;
    let mut named = vec![("out", out.tensor().clone())];
    for (label, v) in inputs {
        let g = v
            .grad()
            .ok_or_else(|| meshgrad_tensor::Error::Msg(format!("{label} received no gradient")))?;
        named.push((*label, g));
    }
    Ok(named)
}

fn leaf(env: &Env, dims: &[usize], seed: u64) -> Result<Var> {
    Ok(Var::leaf(env.randn(dims, seed)?))
}

fn positive_leaf(env: &Env, dims: &[usize], seed: u64) -> Result<Var> {
    // Values in about [0.5, 3.5]: away from the poles of log, sqrt and 1/x.
    Ok(Var::leaf(
        env.scaled(dims, seed, 2.0, 0.5)?
            .clamp(Some(0.5), Some(3.5))?,
    ))
}

macro_rules! unary_case {
    ($name:expr, $tol:expr, $positive:expr, |$x:ident| $body:expr) => {
        Case {
            name: $name,
            tol_factor: $tol,
            half: true,
            run: |env| {
                let $x = if $positive {
                    positive_leaf(env, &[7, 33], 11)?
                } else {
                    leaf(env, &[7, 33], 11)?
                };
                let out = $body?;
                with_grads(env, &out, &[("x", &$x)], 12)
            },
        }
    };
}

fn ids(env: &Env, dims: &[usize], high: i64, seed: u64) -> Result<Tensor> {
    env.exact(Tensor::randint(dims.to_vec(), 0, high, seed)?)
}

/// Every check, in report order.
pub static CASES: &[Case] = &[
    unary_case!("exp", 1.0, false, |x| x.exp()),
    unary_case!("log", 1.0, true, |x| x.log()),
    unary_case!("sqrt", 1.0, true, |x| x.sqrt()),
    unary_case!("tanh", 1.0, false, |x| x.tanh()),
    unary_case!("sigmoid", 1.0, false, |x| x.sigmoid()),
    unary_case!("relu", 1.0, false, |x| x.relu()),
    unary_case!("gelu_tanh", 1.0, false, |x| x.gelu(GeluKind::Tanh)),
    unary_case!("gelu_erf", 1.0, false, |x| x.gelu(GeluKind::Erf)),
    unary_case!("silu", 1.0, false, |x| x.silu()),
    unary_case!("sin_cos", 1.0, false, |x| x.sin()?.mul(&x.cos()?)),
    unary_case!("powf", 1.0, true, |x| x.powf(1.7)),
    unary_case!("scalar_ops", 1.0, false, |x| x
        .mul_scalar(-1.5)?
        .add_scalar(0.25)?
        .sqr()),
    unary_case!("clamp", 1.0, false, |x| x.clamp(Some(-0.5), Some(0.75))),
    Case {
        name: "binary_broadcast",
        tol_factor: 2.0,
        half: true,
        run: |env| {
            let a = leaf(env, &[4, 1, 6], 21)?;
            let b = leaf(env, &[3, 1], 22)?;
            let c = positive_leaf(env, &[6], 23)?;
            let out = a
                .add(&b)?
                .mul(&b)?
                .sub(&a)?
                .div(&c)?
                .maximum(&b.mul_scalar(0.1)?)?
                .minimum(&a.add_scalar(1.0)?)?;
            with_grads(env, &out, &[("a", &a), ("b", &b), ("c", &c)], 24)
        },
    },
    Case {
        name: "strided_views",
        tol_factor: 1.0,
        half: true,
        run: |env| {
            let a = leaf(env, &[5, 8, 6], 31)?;
            let out = a
                .transpose(0, 2)?
                .narrow(1, 2, 5)?
                .contiguous()?
                .mul(&a.transpose(0, 2)?.narrow(1, 1, 5)?)?;
            with_grads(env, &out, &[("a", &a)], 32)
        },
    },
    Case {
        name: "reductions",
        tol_factor: 2.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[6, 40, 5], 41)?;
            let s = x.sum(&[1], false)?;
            let m = x.mean(&[2], true)?;
            let mx = x.max(1, false)?;
            let lse = x.logsumexp(1, false)?;
            let mut out = with_grads(env, &s, &[], 42)?;
            out.push(("mean", m.tensor().clone()));
            out.push(("max", mx.tensor().clone()));
            out.push(("lse", lse.tensor().clone()));
            let all = s.sum_all()?.add(&m.sum_all()?)?.add(&mx.sum_all()?)?;
            let all = all.add(&lse.mul_scalar(0.5)?.sum_all()?)?;
            all.backward()?;
            out.push(("dx", x.grad().expect("x requires grad")));
            Ok(out)
        },
    },
    Case {
        name: "matmul",
        tol_factor: 4.0,
        half: true,
        run: |env| {
            let a = leaf(env, &[3, 17, 64], 51)?;
            let b = leaf(env, &[64, 29], 52)?;
            let out = a.matmul(&b)?;
            // A transposed operand as well.
            let c = leaf(env, &[29, 64], 53)?;
            let out2 = a.matmul(&c.transpose(0, 1)?)?;
            let both = out.add(&out2)?;
            with_grads(env, &both, &[("a", &a), ("b", &b), ("c", &c)], 54)
        },
    },
    Case {
        name: "linear",
        tol_factor: 4.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[2, 9, 48], 61)?;
            let w = leaf(env, &[40, 48], 62)?;
            let b = leaf(env, &[40], 63)?;
            let out = Var::linear(&x, &w, Some(&b))?;
            with_grads(env, &out, &[("x", &x), ("w", &w), ("b", &b)], 64)
        },
    },
    Case {
        // Width 64 (a multiple of 8): on CUDA, cuBLASLt's GELU epilogue with and without the
        // bias (tanh form); on the CPU, linear then gelu.
        name: "linear_gelu",
        tol_factor: 4.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[2, 9, 48], 65)?;
            let w = leaf(env, &[64, 48], 66)?;
            let b = leaf(env, &[64], 67)?;
            let with_bias = Var::linear_gelu(&x, &w, Some(&b), GeluKind::Tanh)?;
            let without = Var::linear_gelu(&x, &w, None, GeluKind::Tanh)?;
            let out = with_bias.add(&without.mul_scalar(0.5)?)?;
            with_grads(env, &out, &[("x", &x), ("w", &w), ("b", &b)], 68)
        },
    },
    Case {
        name: "softmax",
        tol_factor: 1.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[5, 3, 70], 71)?;
            let out = x.softmax(-1)?.add(&x.log_softmax(-1)?.mul_scalar(0.1)?)?;
            with_grads(env, &out, &[("x", &x)], 72)
        },
    },
    Case {
        name: "layer_norm",
        tol_factor: 4.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[6, 5, 96], 81)?;
            let w = leaf(env, &[96], 82)?;
            let b = leaf(env, &[96], 83)?;
            let out = x.layer_norm(Some(&w), Some(&b), 1e-5)?;
            with_grads(env, &out, &[("x", &x), ("w", &w), ("b", &b)], 84)
        },
    },
    Case {
        name: "rms_norm",
        tol_factor: 4.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[6, 5, 96], 91)?;
            let w = leaf(env, &[96], 92)?;
            let out = x.rms_norm(Some(&w), 1e-6)?;
            with_grads(env, &out, &[("x", &x), ("w", &w)], 93)
        },
    },
    Case {
        name: "cross_entropy",
        tol_factor: 2.0,
        half: true,
        run: |env| {
            let logits = leaf(env, &[4, 9, 300], 101)?;
            let mut t = Tensor::randint(vec![4, 9], 0, 300, 102)?.to_vec::<i64>()?;
            t[3] = -100; // one ignored position
            let targets = env.exact(Tensor::from_vec(t, (4, 9), Device::Cpu)?)?;
            let loss = logits.cross_entropy(&targets, Some(-100))?;
            loss.backward()?;
            Ok(vec![
                ("loss", loss.tensor().clone()),
                ("dlogits", logits.grad().expect("logits require grad")),
            ])
        },
    },
    Case {
        name: "embedding",
        tol_factor: 1.0,
        half: true,
        run: |env| {
            let table = leaf(env, &[50, 24], 111)?;
            // Repeated ids: the backward sums rows.
            let out = Var::embedding(&table, &ids(env, &[3, 40], 50, 112)?)?;
            with_grads(env, &out, &[("table", &table)], 113)
        },
    },
    Case {
        name: "gather_index_select",
        tol_factor: 1.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[6, 10, 4], 121)?;
            let g = x.gather(1, &ids(env, &[6, 7, 4], 10, 122)?)?;
            let s = x.index_select(1, &ids(env, &[12], 10, 123)?)?;
            let out = g.sum_all()?.add(&s.sqr()?.sum_all()?)?;
            out.backward()?;
            Ok(vec![
                ("gather", g.tensor().clone()),
                ("index_select", s.tensor().clone()),
                ("dx", x.grad().expect("x requires grad")),
            ])
        },
    },
    Case {
        name: "swiglu",
        tol_factor: 1.0,
        half: true,
        run: |env| {
            let gate = leaf(env, &[5, 64], 131)?;
            let up = leaf(env, &[5, 64], 132)?;
            let out = Var::swiglu(&gate, &up)?;
            with_grads(env, &out, &[("gate", &gate), ("up", &up)], 133)
        },
    },
    Case {
        name: "rotary",
        tol_factor: 2.0,
        half: true,
        run: |env| {
            let x = leaf(env, &[2, 11, 3, 64], 141)?;
            let pos = env.exact(Tensor::arange(0, 11, DType::I64, Device::Cpu)?)?;
            let out = x.rotary_embedding(&pos, 10000.0)?;
            with_grads(env, &out, &[("x", &x)], 142)
        },
    },
    Case {
        name: "attention_causal_d64",
        tol_factor: 4.0,
        half: true,
        run: |env| attention(env, 64, true, false),
    },
    Case {
        name: "attention_padded_d128",
        tol_factor: 4.0,
        half: true,
        run: |env| attention(env, 128, false, true),
    },
    Case {
        name: "attention_qkv",
        tol_factor: 4.0,
        half: true,
        run: |env| {
            let (b, t, h, d) = (2, 70, 2, 64);
            let qkv = leaf(env, &[b, t, 3 * h * d], 151)?;
            let mask = AttentionMask {
                causal: true,
                ..Default::default()
            };
            let out = Var::attention_qkv(&qkv, h, &mask, 1.0 / (d as f64).sqrt())?;
            with_grads(env, &out, &[("qkv", &qkv)], 152)
        },
    },
    Case {
        name: "adamw_3_steps",
        tol_factor: 4.0,
        half: false,
        run: |env| {
            let p = Var::leaf(env.randn(&[33, 17], 161)?);
            let mut opt = AdamW::new(
                vec![ParamGroup::new(vec![("p".to_owned(), p.clone())], 0.1)],
                AdamWConfig::default(),
            )?;
            for step in 0..3u64 {
                opt.zero_grad();
                let w = Var::constant(env.randn(&[33, 17], 162 + step)?);
                p.mul(&w)?.sum_all()?.backward()?;
                opt.step(1e-2)?;
            }
            Ok(vec![("p", p.tensor().clone())])
        },
    },
    Case {
        name: "random_fills",
        tol_factor: 0.0,
        half: false,
        run: |env| {
            // Drawn on the device in f64-exact form is not required: the draw is made in the
            // case's dtype and compared with the CPU's draw of the same dtype, exactly.
            let draw = |device: Device| -> Result<Vec<Tensor>> {
                let r = meshgrad_tensor::Random::new(7)
                    .device(device)
                    .dtype(env.round);
                Ok(vec![
                    r.normal(vec![1000], 0.5, 2.0)?,
                    r.offset(12345).uniform(vec![777], -1.0, 3.0)?,
                ])
            };
            let got = draw(env.device)?;
            let want = draw(Device::Cpu)?;
            let mut named = Vec::new();
            for (g, w) in got.into_iter().zip(want) {
                // Reported as the difference itself (the reference side compares 0 with 0).
                let diff = g
                    .to_device(Device::Cpu)?
                    .to_dtype(DType::F64)?
                    .sub(&w.to_dtype(DType::F64)?)?;
                named.push(("draw_minus_cpu_draw", diff.to_dtype(env.dtype)?));
            }
            Ok(named)
        },
    },
];

fn attention(env: &Env, d: usize, causal: bool, padded: bool) -> Result<Named> {
    let (b, h, t) = (2, 3, 67);
    let q = leaf(env, &[b, h, t, d], 171)?;
    let k = leaf(env, &[b, h, t, d], 172)?;
    let v = leaf(env, &[b, h, t, d], 173)?;
    let key_padding = if padded {
        let mut keep = vec![1u8; b * t];
        for j in 50..t {
            keep[t + j] = 0; // the second sequence's last keys are padding
        }
        Some(env.exact(Tensor::from_vec(keep, (b, t), Device::Cpu)?)?)
    } else {
        None
    };
    let mask = AttentionMask {
        causal,
        key_padding,
        bias: None,
    };
    let out = Var::attention(&q, &k, &v, &mask, 1.0 / (d as f64).sqrt())?;
    with_grads(env, &out, &[("q", &q), ("k", &k), ("v", &v)], 174)
}
