//! GPT model tests: parameter naming and count, overfitting one batch, activation checkpointing
//! equivalence, dropout modes, generation determinism, input errors.

use meshgrad_autograd::Var;
use meshgrad_nn::optim::{AdamW, AdamWConfig, Optimizer, ParamGroup};
use meshgrad_nn::ForwardCtx;
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_tensor::{DType, Device, Tensor};

fn tiny(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 32,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        dropout,
        bias: true,
        layer_norm_eps: 1e-5,
    }
}

fn batch(b: usize, t: usize, vocab: u32, seed: u64) -> (Tensor, Tensor) {
    let mut s = seed;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as u32) % vocab
    };
    let toks: Vec<u32> = (0..b * (t + 1)).map(|_| next()).collect();
    let mut ids = Vec::new();
    let mut tg = Vec::new();
    for r in 0..b {
        ids.extend_from_slice(&toks[r * (t + 1)..r * (t + 1) + t]);
        tg.extend_from_slice(&toks[r * (t + 1) + 1..(r + 1) * (t + 1)]);
    }
    (
        Tensor::from_vec(ids, (b, t), Device::Cpu).unwrap(),
        Tensor::from_vec(tg, (b, t), Device::Cpu).unwrap(),
    )
}

#[test]
fn names_follow_gpt2_and_count_matches_config() {
    let cfg = tiny(0.0);
    let m = Gpt::new(cfg, 1, DType::F32, Device::Cpu).unwrap();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    for expected in [
        "wte.weight",
        "wpe.weight",
        "h.0.ln_1.weight",
        "h.0.ln_1.bias",
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_attn.bias",
        "h.0.attn.c_proj.weight",
        "h.1.mlp.c_fc.weight",
        "h.1.mlp.c_proj.bias",
        "ln_f.weight",
        "ln_f.bias",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "missing {expected} in {names:?}"
        );
    }
    assert_eq!(names.len(), 2 + 2 * 12 + 2);
    assert_eq!(m.num_parameters(), cfg.num_parameters());
    // Linear weights are [out, in].
    let w = m.h[0].attn.c_attn.weight.tensor().dims().to_vec();
    assert_eq!(w, vec![48, 16]);
}

#[test]
fn init_depends_on_seed_and_name_only() {
    let a = Gpt::new(tiny(0.0), 5, DType::F32, Device::Cpu).unwrap();
    let b = Gpt::new(tiny(0.0), 5, DType::F32, Device::Cpu).unwrap();
    let c = Gpt::new(tiny(0.0), 6, DType::F32, Device::Cpu).unwrap();
    // The token table (every whole model holds it).
    let table = |m: &Gpt| {
        m.wte
            .as_ref()
            .unwrap()
            .weight
            .tensor()
            .to_vec::<f32>()
            .unwrap()
    };
    let wa = table(&a);
    assert_eq!(wa, table(&b));
    assert_ne!(wa, table(&c));
    // GPT-2 init: std 0.02 for the token table.
    let std = (wa.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / wa.len() as f64).sqrt();
    assert!((std - 0.02).abs() < 0.004, "std {std}");
}

#[test]
fn tiny_gpt_overfits_one_batch() {
    let cfg = tiny(0.0);
    let m = Gpt::new(cfg, 3, DType::F32, Device::Cpu).unwrap();
    let (ids, tg) = batch(4, 16, 32, 9);
    let group = ParamGroup {
        params: m.named_parameters(),
        weight_decay: 0.0,
        lr_scale: 1.0,
    };
    let mut opt = AdamW::new(vec![group], AdamWConfig::default()).unwrap();
    let ctx = ForwardCtx::new(0, 0);
    let first = ctx
        .scope(|| m.loss(&ids, &tg, None))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert!(
        (first - (32f64).ln()).abs() < 0.3,
        "initial loss {first} should be near ln(32)"
    );
    let mut last = first;
    for _ in 0..300 {
        let loss = ctx.scope(|| m.loss(&ids, &tg, None)).unwrap();
        opt.zero_grad();
        loss.backward().unwrap();
        opt.step(3e-3).unwrap();
        last = loss.tensor().item().unwrap();
    }
    assert!(
        last < 0.05,
        "loss after 300 steps on one batch: {last} (from {first})"
    );
}

fn grads(m: &Gpt) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| {
            p.grad()
                .expect("every parameter gets a gradient")
                .to_vec::<f32>()
                .unwrap()
        })
        .collect()
}

#[test]
fn activation_checkpointing_gives_identical_gradients() {
    let (ids, tg) = batch(2, 12, 32, 4);
    let ctx = ForwardCtx::new(3, 0);
    let mut m = Gpt::new(tiny(0.1), 7, DType::F32, Device::Cpu).unwrap();
    let l1 = ctx.scope(|| m.loss(&ids, &tg, None)).unwrap();
    l1.backward().unwrap();
    let g1 = grads(&m);
    m.zero_grad();
    m.activation_checkpointing = true;
    let l2 = ctx.scope(|| m.loss(&ids, &tg, None)).unwrap();
    l2.backward().unwrap();
    let g2 = grads(&m);
    assert_eq!(l1.tensor().item().unwrap(), l2.tensor().item().unwrap());
    assert_eq!(
        g1, g2,
        "checkpointed gradients must be bitwise equal (same ops, same dropout masks)"
    );
}

#[test]
fn dropout_applies_in_training_only() {
    let (ids, tg) = batch(2, 8, 32, 1);
    let m = Gpt::new(tiny(0.5), 2, DType::F32, Device::Cpu).unwrap();
    let ctx = ForwardCtx::new(0, 0);
    let train_a = ctx
        .scope(|| m.loss(&ids, &tg, None))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    let train_b = ForwardCtx::new(1, 0)
        .scope(|| m.loss(&ids, &tg, None))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert_ne!(train_a, train_b, "different steps draw different masks");
    let again = ctx
        .scope(|| m.loss(&ids, &tg, None))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert_eq!(train_a, again, "the same step reproduces its masks");
    m.set_training(false);
    let e1 = ctx
        .scope(|| m.loss(&ids, &tg, None))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    let e2 = ForwardCtx::new(1, 0)
        .scope(|| m.loss(&ids, &tg, None))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert_eq!(e1, e2);
}

#[test]
fn greedy_generation_is_deterministic_and_validates_input() {
    let m = Gpt::new(tiny(0.0), 2, DType::F32, Device::Cpu).unwrap();
    let a = m
        .generate(&[1, 2, 3], 20, 0.0, None, 0, |_| Ok(()))
        .unwrap();
    let b = m
        .generate(&[1, 2, 3], 20, 0.0, None, 99, |_| Ok(()))
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 20);
    // Longer than the context: cropped, still works.
    let long: Vec<u32> = (0..40).map(|i| i % 32).collect();
    let out = m.generate(&long, 3, 0.7, Some(5), 1, |_| Ok(())).unwrap();
    assert_eq!(out.len(), 3);
    let err = m
        .generate(&[40], 1, 0.0, None, 0, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("40") && err.contains("32"), "{err}");
    // Greedy picks the argmax of the model's own last-position logits.
    let ids = Tensor::from_vec(vec![1u32, 2, 3], (1, 3), Device::Cpu).unwrap();
    let logits = m
        .forward(&ids)
        .unwrap()
        .tensor()
        .narrow(1, 2, 1)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
    assert_eq!(a[0] as usize, best);
}

#[test]
fn bad_inputs_are_errors() {
    let m = Gpt::new(tiny(0.0), 2, DType::F32, Device::Cpu).unwrap();
    let too_long = Tensor::zeros((1, 17), DType::U32, Device::Cpu).unwrap();
    let e = m.forward(&too_long).unwrap_err().to_string();
    assert!(e.contains("17") && e.contains("16"), "{e}");
    let float_ids = Tensor::zeros((1, 4), DType::F32, Device::Cpu).unwrap();
    assert!(m.forward(&float_ids).is_err());
    let bad_id = Tensor::from_vec(vec![0u32, 99], (1, 2), Device::Cpu).unwrap();
    let e = m.forward(&bad_id).unwrap_err().to_string();
    assert!(e.contains("99"), "{e}");
    let bad_cfg = GptConfig {
        n_head: 3,
        ..tiny(0.0)
    };
    assert!(Gpt::new(bad_cfg, 0, DType::F32, Device::Cpu).is_err());
    let _ = Var::constant(too_long);
}

#[test]
fn generation_streams_each_token_and_checks_its_arguments() {
    let m = Gpt::new(tiny(0.0), 2, DType::F32, Device::Cpu).unwrap();
    // The callback sees every token, in order, as it is chosen.
    let mut seen = Vec::new();
    let out = m
        .generate(&[1, 2], 7, 0.9, Some(4), 3, |t| {
            seen.push(t);
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, out);
    // An error from the callback stops the generation.
    let mut calls = 0;
    let err = m
        .generate(&[1, 2], 7, 0.0, None, 0, |_| {
            calls += 1;
            if calls == 3 {
                meshgrad_tensor::bail!("stop here");
            }
            Ok(())
        })
        .unwrap_err();
    assert!(err.to_string().contains("stop here"), "{err}");
    assert_eq!(calls, 3);
    // Bad sampling arguments.
    for (temperature, top_k, needle) in [
        (-0.5, None, "temperature"),
        (f64::NAN, None, "temperature"),
        (f64::INFINITY, None, "temperature"),
        (0.8, Some(0), "top_k"),
    ] {
        let err = m
            .generate(&[1], 2, temperature, top_k, 0, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{temperature} {top_k:?}: {err}");
    }
    // NaN weights: the first step's logits are NaN, and the error names the step.
    let nan = Tensor::from_vec(vec![f32::NAN; 16], 16, Device::Cpu).unwrap();
    meshgrad_nn::state::load_state_dict(&m, &[("ln_f.weight".to_string(), nan)], false).unwrap();
    let err = m
        .generate(&[1, 2], 5, 0.0, None, 0, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not finite") && err.contains("step 1 of 5"),
        "{err}"
    );
}

#[test]
fn config_refuses_a_bad_layer_norm_epsilon() {
    for eps in [0.0, -1e-5, f64::NAN, f64::INFINITY] {
        let cfg = GptConfig {
            layer_norm_eps: eps,
            ..tiny(0.0)
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("layer_norm_epsilon"), "{eps}: {err}");
    }
}

/// A GPT built in bf16 or f16: the logits are half, the loss (the fused cross-entropy's
/// log-sum-exp and mean) is f32, the gradients are half, and AdamW's f32 master weights train
/// it like the f32 model (one-batch overfitting at lr 1e-2, within 5% of the f32 losses;
/// measured: bf16 1.4e-2, f16 1.6e-3 relative at worst over the 30 steps).
#[test]
fn half_precision_gpt_has_an_f32_loss_and_trains_with_master_weights() {
    let (ids, tg) = batch(4, 16, 32, 9);
    let run = |dtype: DType| -> Vec<f64> {
        let m = Gpt::new(tiny(0.0), 3, dtype, Device::Cpu).unwrap();
        let mut opt = AdamW::new(
            vec![ParamGroup::new(m.named_parameters(), 0.0)],
            AdamWConfig::default(),
        )
        .unwrap();
        let mut losses = Vec::new();
        for _ in 0..30 {
            opt.zero_grad();
            let loss = ForwardCtx::new(0, 0)
                .scope(|| m.loss(&ids, &tg, None))
                .unwrap();
            assert_eq!(
                loss.tensor().dtype(),
                DType::F32,
                "{dtype}: the loss is f32"
            );
            loss.backward().unwrap();
            for (n, p) in m.named_parameters() {
                assert_eq!(p.grad().unwrap().dtype(), dtype, "{n}");
            }
            opt.step(1e-2).unwrap();
            losses.push(loss.tensor().item().unwrap());
        }
        if dtype != DType::F32 {
            let (n, _) = &m.named_parameters()[0];
            assert_eq!(opt.master(n).unwrap().dtype(), DType::F32);
        }
        losses
    };
    let f32_losses = run(DType::F32);
    for dtype in [DType::BF16, DType::F16] {
        let l = run(dtype);
        assert!(l[29] < l[0] - 1.0, "{dtype} did not train: {l:?}");
        let worst = l
            .iter()
            .zip(&f32_losses)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        assert!(worst < 0.05, "{dtype} vs f32: {worst}");
        eprintln!("{dtype}: max relative loss difference to f32 over 30 steps: {worst:.2e}");
    }
}
