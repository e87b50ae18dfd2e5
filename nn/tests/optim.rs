//! Optimizers, schedules and clipping against independent f64 reference implementations.

use meshgrad_autograd::Var;
use meshgrad_nn::optim::{
    clip_grad_norm, clip_grads_with_norm, grad_norm, grad_sq_sum, param_groups_for_decay, AdamW,
    AdamWConfig, CosineSchedule, Optimizer, ParamGroup, Sgd, SgdConfig, StateKind,
};
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_tensor::alloc::{with_tracker, MemoryTag, MemoryTracker};
use meshgrad_tensor::{DType, Device, Tensor};

/// Deterministic pseudo-random values in [-1, 1) (a small LCG; independent of meshgrad's RNG).
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(v: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape.to_vec(), Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A parameter with its f64 shadow for the reference.
struct Shadow {
    name: String,
    shape: Vec<usize>,
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    buf: Option<Vec<f64>>,
    step: u64,
}

fn make_params(dtype: DType) -> (Vec<(String, Var)>, Vec<Shadow>) {
    let specs: [(&str, &[usize]); 4] = [
        ("a.weight", &[3, 4]),
        ("a.bias", &[4]),
        ("b.weight", &[2, 5]),
        ("ln.weight", &[5]),
    ];
    let mut named = Vec::new();
    let mut shadows = Vec::new();
    for (i, (name, shape)) in specs.iter().enumerate() {
        let n: usize = shape.iter().product();
        let init = values(100 + i as u64, n);
        let t = tensor(&init, shape, dtype);
        // The shadow starts from the parameter's actual (possibly rounded) values.
        let p = t.to_vec_f64().unwrap();
        named.push((name.to_string(), Var::leaf(t)));
        shadows.push(Shadow {
            name: name.to_string(),
            shape: shape.to_vec(),
            p,
            m: vec![0.0; n],
            v: vec![0.0; n],
            buf: None,
            step: 0,
        });
    }
    (named, shadows)
}

/// Sets gradients for step `step`; parameter 3 gets none on odd steps (it must then be skipped).
/// Returns the gradients as the parameters' dtype rounds them.
fn set_grads(named: &[(String, Var)], step: u64, dtype: DType) -> Vec<Option<Vec<f64>>> {
    named
        .iter()
        .enumerate()
        .map(|(i, (_, p))| {
            if i == 3 && step % 2 == 1 {
                p.set_grad(None);
                return None;
            }
            let dims = p.tensor().dims().to_vec();
            let g: Vec<f64> = values(1000 * step + i as u64, p.tensor().elem_count())
                .iter()
                .map(|x| x * (1.0 + i as f64))
                .collect();
            let t = tensor(&g, &dims, dtype);
            let g = t.to_vec_f64().unwrap();
            p.set_grad(Some(t));
            Some(g)
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn ref_adamw(s: &mut Shadow, g: &[f64], lr: f64, wd: f64, b1: f64, b2: f64, eps: f64) {
    s.step += 1;
    let t = s.step as i32;
    for (((p, m), v), g) in
        s.p.iter_mut()
            .zip(s.m.iter_mut())
            .zip(s.v.iter_mut())
            .zip(g)
    {
        *p -= lr * wd * *p;
        *m = b1 * *m + (1.0 - b1) * g;
        *v = b2 * *v + (1.0 - b2) * g * g;
        let mh = *m / (1.0 - b1.powi(t));
        let vh = *v / (1.0 - b2.powi(t));
        *p -= lr * mh / (vh.sqrt() + eps);
    }
}

fn ref_sgd(s: &mut Shadow, g: &[f64], lr: f64, wd: f64, momentum: f64) {
    let d: Vec<f64> = g.iter().zip(&s.p).map(|(g, p)| g + wd * p).collect();
    let buf = match s.buf.take() {
        _ if momentum == 0.0 => d,
        None => d,
        Some(b) => b.iter().zip(&d).map(|(b, d)| momentum * b + d).collect(),
    };
    for (p, b) in s.p.iter_mut().zip(&buf) {
        *p -= lr * b;
    }
    if momentum != 0.0 {
        s.buf = Some(buf);
    }
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Two groups: {a.weight, b.weight} with decay 0.1 and lr_scale 1, {a.bias, ln.weight} without
/// decay and lr_scale 0.5.
fn two_groups(named: &[(String, Var)]) -> Vec<ParamGroup> {
    let pick = |names: &[&str]| {
        named
            .iter()
            .filter(|(n, _)| names.contains(&n.as_str()))
            .cloned()
            .collect::<Vec<_>>()
    };
    let g0 = ParamGroup::new(pick(&["a.weight", "b.weight"]), 0.1);
    let mut g1 = ParamGroup::new(pick(&["a.bias", "ln.weight"]), 0.0);
    g1.lr_scale = 0.5;
    vec![g0, g1]
}

fn group_of(name: &str) -> (f64, f64) {
    if name.ends_with("bias") || name.starts_with("ln") {
        (0.0, 0.5)
    } else {
        (0.1, 1.0)
    }
}

fn check_adamw(dtype: DType, tol: f64) {
    let (named, mut shadows) = make_params(dtype);
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
    };
    let mut opt = AdamW::new(two_groups(&named), cfg).unwrap();
    for step in 0..6u64 {
        let lr = 1e-2 * (1.0 + step as f64 * 0.3);
        let grads = set_grads(&named, step, dtype);
        opt.step(lr).unwrap();
        for (s, g) in shadows.iter_mut().zip(&grads) {
            if let Some(g) = g {
                let (wd, scale) = group_of(&s.name);
                ref_adamw(s, g, lr * scale, wd, cfg.beta1, cfg.beta2, cfg.eps);
            }
        }
        for ((name, p), s) in named.iter().zip(&shadows) {
            let got = p.tensor().to_vec_f64().unwrap();
            let d = max_diff(&got, &s.p);
            assert!(d <= tol, "{dtype} step {step} {name}: max diff {d} > {tol}");
            assert_eq!(p.tensor().dims(), s.shape.as_slice());
        }
    }
    assert_eq!(opt.step_count(), 6);
    // The parameter that skipped odd steps has its own (smaller) step count.
    assert_eq!(opt.moments("ln.weight").unwrap().2, 3);
    assert_eq!(opt.moments("a.weight").unwrap().2, 6);
    let (m, v, _) = opt.moments("b.weight").unwrap();
    let s = &shadows[2];
    assert!(max_diff(&m.to_vec_f64().unwrap(), &s.m) <= tol);
    assert!(max_diff(&v.to_vec_f64().unwrap(), &s.v) <= tol);
}

#[test]
fn adamw_matches_f64_reference() {
    check_adamw(DType::F64, 1e-12);
}

#[test]
fn adamw_f32_matches_f64_reference() {
    check_adamw(DType::F32, 1e-5);
}

fn check_sgd(momentum: f64, dtype: DType, tol: f64) {
    let (named, mut shadows) = make_params(dtype);
    let mut opt = Sgd::new(two_groups(&named), SgdConfig { momentum }).unwrap();
    for step in 0..5u64 {
        let lr = 0.05 / (1.0 + step as f64);
        let grads = set_grads(&named, step, dtype);
        opt.step(lr).unwrap();
        for (s, g) in shadows.iter_mut().zip(&grads) {
            if let Some(g) = g {
                let (wd, scale) = group_of(&s.name);
                ref_sgd(s, g, lr * scale, wd, momentum);
            }
        }
        for ((name, p), s) in named.iter().zip(&shadows) {
            let d = max_diff(&p.tensor().to_vec_f64().unwrap(), &s.p);
            assert!(
                d <= tol,
                "momentum {momentum} step {step} {name}: max diff {d} > {tol}"
            );
        }
    }
    if momentum == 0.0 {
        assert!(opt.momentum_buffer("a.weight").is_none());
    } else {
        let b = opt
            .momentum_buffer("a.weight")
            .unwrap()
            .to_vec_f64()
            .unwrap();
        assert!(max_diff(&b, shadows[0].buf.as_ref().unwrap()) <= tol);
    }
}

#[test]
fn sgd_with_momentum_matches_f64_reference() {
    check_sgd(0.9, DType::F64, 1e-12);
    check_sgd(0.9, DType::F32, 1e-5);
}

#[test]
fn plain_sgd_matches_f64_reference() {
    check_sgd(0.0, DType::F64, 1e-12);
}

#[test]
fn parameters_without_grad_are_untouched() {
    let (named, _) = make_params(DType::F32);
    let before: Vec<Vec<f32>> = named
        .iter()
        .map(|(_, p)| p.tensor().to_vec_f32().unwrap())
        .collect();
    let mut adam = AdamW::new(
        vec![ParamGroup::new(named.clone(), 0.1)],
        AdamWConfig::default(),
    )
    .unwrap();
    adam.step(0.1).unwrap();
    let mut sgd = Sgd::new(
        vec![ParamGroup::new(named.clone(), 0.1)],
        SgdConfig { momentum: 0.9 },
    )
    .unwrap();
    sgd.step(0.1).unwrap();
    for ((_, p), b) in named.iter().zip(&before) {
        assert_eq!(&p.tensor().to_vec_f32().unwrap(), b);
    }
    assert!(adam.moments("a.weight").is_none());
    assert_eq!(adam.step_count(), 1);
}

#[test]
fn zero_grad_clears_every_group() {
    let (named, _) = make_params(DType::F32);
    set_grads(&named, 0, DType::F32);
    let opt = AdamW::new(two_groups(&named), AdamWConfig::default()).unwrap();
    opt.zero_grad();
    assert!(named.iter().all(|(_, p)| p.grad().is_none()));
}

#[test]
fn invalid_settings_are_errors() {
    let (named, _) = make_params(DType::F32);
    let dup = vec![
        ParamGroup::new(named[..2].to_vec(), 0.0),
        ParamGroup::new(named[1..3].to_vec(), 0.0),
    ];
    let e = AdamW::new(dup, AdamWConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("a.bias") && e.contains("more than once"), "{e}");
    let e = AdamW::new(
        vec![],
        AdamWConfig {
            beta1: 1.0,
            ..Default::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("beta1"), "{e}");
    let e = Sgd::new(
        vec![ParamGroup::new(named.clone(), -1.0)],
        SgdConfig::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("weight_decay"), "{e}");
    let mut opt = AdamW::new(
        vec![ParamGroup::new(named.clone(), 0.0)],
        AdamWConfig::default(),
    )
    .unwrap();
    assert!(opt.step(f64::NAN).is_err());
    assert!(opt.step(-1.0).is_err());
    // A gradient of the wrong shape names the parameter.
    named[0].1.set_grad(Some(
        Tensor::zeros((4, 3), DType::F32, Device::Cpu).unwrap(),
    ));
    let e = opt.step(0.1).err().unwrap().to_string();
    assert!(e.contains("a.weight"), "{e}");
}

#[test]
fn adamw_accepts_non_contiguous_grads_and_other_dtypes() {
    let (named, mut shadows) = make_params(DType::F32);
    let (name, p) = &named[0];
    // A transposed (non-contiguous) f64 gradient.
    let g = values(7, 12);
    let gt = Tensor::from_vec(g.clone(), (4, 3), Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    assert!(!gt.is_contiguous());
    p.set_grad(Some(gt.clone()));
    let mut opt = AdamW::new(
        vec![ParamGroup::new(vec![(name.clone(), p.clone())], 0.0)],
        AdamWConfig::default(),
    )
    .unwrap();
    opt.step(0.01).unwrap();
    let gf32 = gt.to_dtype(DType::F32).unwrap().to_vec_f64().unwrap();
    ref_adamw(&mut shadows[0], &gf32, 0.01, 0.0, 0.9, 0.999, 1e-8);
    assert!(max_diff(&p.tensor().to_vec_f64().unwrap(), &shadows[0].p) < 1e-6);
}

fn tiny_gpt() -> Gpt {
    let cfg = GptConfig {
        vocab_size: 11,
        block_size: 5,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        dropout: 0.0,
        bias: true,
        layer_norm_eps: 1e-5,
    };
    Gpt::new(cfg, 3, DType::F32, Device::Cpu).unwrap()
}

#[test]
fn decay_grouping_follows_the_nanogpt_rule() {
    let model = tiny_gpt();
    let named = model.named_parameters();
    let groups = param_groups_for_decay(named.clone(), 0.1);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].weight_decay, 0.1);
    assert_eq!(groups[1].weight_decay, 0.0);
    assert_eq!(groups[0].params.len() + groups[1].params.len(), named.len());
    for (n, p) in &groups[0].params {
        assert!(p.tensor().rank() >= 2, "{n}");
        assert!(n.ends_with(".weight") && !n.contains("ln_"), "decayed {n}");
    }
    for (n, p) in &groups[1].params {
        assert_eq!(p.tensor().rank(), 1, "{n}");
        let is_ln_weight = n.ends_with(".weight")
            && (n.starts_with("ln_f") || n.contains(".ln_1.") || n.contains(".ln_2."));
        assert!(n.ends_with(".bias") || is_ln_weight, "not decayed: {n}");
    }
    let decayed: Vec<&str> = groups[0].params.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "wte.weight",
        "wpe.weight",
        "h.0.attn.c_attn.weight",
        "h.1.mlp.c_proj.weight",
    ] {
        assert!(decayed.contains(&want), "{want} missing from {decayed:?}");
    }
    // 2 layers x (4 linears) + wte + wpe are decayed; 2 x (4 biases + 2 ln x 2) + ln_f x 2 are not.
    assert_eq!(groups[0].params.len(), 10);
    assert_eq!(groups[1].params.len(), 2 * (4 + 4) + 2);
    // Order within a group follows the model's order.
    let order: Vec<&str> = named
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| decayed.contains(n))
        .collect();
    assert_eq!(order, decayed);
}

#[test]
fn cosine_schedule_at_key_steps() {
    let (max, min, w, n) = (6e-4, 6e-5, 10usize, 110usize);
    let s = CosineSchedule::new(max, min, w, n).unwrap();
    let closed = |step: usize| -> f64 {
        if step < w {
            max * (step + 1) as f64 / w as f64
        } else if step > n {
            min
        } else {
            let r = (step - w) as f64 / (n - w) as f64;
            min + 0.5 * (1.0 + (std::f64::consts::PI * r).cos()) * (max - min)
        }
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-15;
    assert!(close(s.lr_at(0), max / 10.0));
    assert!(close(s.lr_at(w - 1), max));
    assert!(close(s.lr_at(w), max));
    assert!(close(s.lr_at(w + (n - w) / 2), (max + min) / 2.0));
    assert!(close(s.lr_at(n), min));
    assert!(close(s.lr_at(n + 1), min));
    assert!(close(s.lr_at(10 * n), min));
    for step in 0..=n + 5 {
        assert!(
            close(s.lr_at(step), closed(step)),
            "step {step}: {} vs {}",
            s.lr_at(step),
            closed(step)
        );
    }
    // Monotone decay after warm-up.
    for step in w..n {
        assert!(s.lr_at(step + 1) <= s.lr_at(step));
    }
    // No warm-up starts at max_lr; warm-up == total gives min_lr from there on.
    let s0 = CosineSchedule::new(1.0, 0.1, 0, 10).unwrap();
    assert_eq!(s0.lr_at(0), 1.0);
    let s1 = CosineSchedule::new(1.0, 0.1, 4, 4).unwrap();
    assert_eq!(s1.lr_at(3), 1.0);
    assert_eq!(s1.lr_at(4), 0.1);
    // Validation.
    assert!(CosineSchedule::new(1.0, 0.1, 11, 10)
        .err()
        .unwrap()
        .to_string()
        .contains("warmup_steps"));
    assert!(CosineSchedule::new(0.1, 1.0, 1, 10).is_err());
    assert!(CosineSchedule::new(f64::NAN, 0.0, 1, 10).is_err());
    assert!(CosineSchedule::new(1.0, -0.1, 1, 10).is_err());
}

fn grads_f64(named: &[(String, Var)]) -> Vec<Vec<f64>> {
    named
        .iter()
        .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap())
        .collect()
}

#[test]
fn clipping_matches_f64_reference() {
    let (named, _) = make_params(DType::F32);
    let params: Vec<Var> = named.iter().map(|(_, p)| p.clone()).collect();
    set_grads(&named, 0, DType::F32);
    let g = grads_f64(&named);
    let sq: f64 = g.iter().flatten().map(|x| x * x).sum();
    let norm = sq.sqrt();
    assert!((grad_sq_sum(&params).unwrap() - sq).abs() <= 1e-12 * sq);
    assert!((grad_norm(&params).unwrap() - norm).abs() <= 1e-12 * norm);

    // Above the threshold: scaled by max_norm / (norm + 1e-6).
    let max_norm = norm / 4.0;
    let got = clip_grad_norm(&params, max_norm).unwrap();
    assert!((got - norm).abs() <= 1e-12 * norm);
    let coef = max_norm / (norm + 1e-6);
    for (after, before) in grads_f64(&named).iter().zip(&g) {
        for (a, b) in after.iter().zip(before) {
            assert!(
                (a - b * coef).abs() <= 1e-6 * b.abs().max(1e-6),
                "{a} vs {}",
                b * coef
            );
        }
    }
    let new_norm = grad_norm(&params).unwrap();
    assert!(
        (new_norm - max_norm).abs() <= 1e-5 * max_norm,
        "{new_norm} vs {max_norm}"
    );

    // Below the threshold: untouched (bitwise).
    let before = grads_f64(&named);
    let got = clip_grad_norm(&params, new_norm * 2.0).unwrap();
    assert!((got - new_norm).abs() <= 1e-12);
    assert_eq!(grads_f64(&named), before);

    // Gradient storage is scaled in place (shared handles see the new values).
    let shared = params[0].grad().unwrap();
    clip_grads_with_norm(&params, 1e-3, new_norm).unwrap();
    assert_eq!(
        shared.to_vec_f64().unwrap(),
        params[0].grad().unwrap().to_vec_f64().unwrap()
    );
    assert!(shared.to_vec_f64().unwrap() != before[0]);

    // Parameters without gradients are ignored; bad max_norm is an error.
    params[1].set_grad(None);
    let expect: f64 = [0, 2, 3]
        .iter()
        .map(|&i| params[i].grad().unwrap().sqr_sum_f64().unwrap())
        .sum();
    assert_eq!(grad_sq_sum(&params).unwrap(), expect);
    assert!(clip_grad_norm(&params, 0.0).is_err());
    assert!(clip_grad_norm(&params, f64::INFINITY).is_err());
    // A non-finite norm is reported and nothing is scaled.
    params[0].set_grad(Some(
        Tensor::full(f64::NAN, (3, 4), DType::F32, Device::Cpu).unwrap(),
    ));
    let before = params[2].grad().unwrap().to_vec_f64().unwrap();
    assert!(clip_grad_norm(&params, 1.0).unwrap().is_nan());
    assert_eq!(params[2].grad().unwrap().to_vec_f64().unwrap(), before);
}

#[test]
fn optimizer_state_is_counted_as_optimizer_state() {
    let tracker = MemoryTracker::new();
    with_tracker(tracker.clone(), || {
        let (named, _) = make_params(DType::F32);
        let param_bytes: usize = named.iter().map(|(_, p)| p.tensor().elem_count() * 4).sum();
        set_grads(&named, 0, DType::F32); // all four get grads at step 0
        assert_eq!(tracker.stats().current_of(MemoryTag::OptimizerState), 0);
        let mut adam = AdamW::new(two_groups(&named), AdamWConfig::default()).unwrap();
        assert_eq!(
            tracker.stats().current_of(MemoryTag::OptimizerState),
            0,
            "moments are created lazily"
        );
        adam.step(1e-3).unwrap();
        assert_eq!(
            tracker.stats().current_of(MemoryTag::OptimizerState),
            2 * param_bytes
        );
        adam.step(1e-3).unwrap();
        assert_eq!(
            tracker.stats().current_of(MemoryTag::OptimizerState),
            2 * param_bytes,
            "no growth after the first step"
        );

        let mut sgd = Sgd::new(two_groups(&named), SgdConfig { momentum: 0.9 }).unwrap();
        sgd.step(1e-3).unwrap();
        assert_eq!(
            tracker.stats().current_of(MemoryTag::OptimizerState),
            3 * param_bytes
        );
        drop(adam);
        drop(sgd);
        assert_eq!(tracker.stats().current_of(MemoryTag::OptimizerState), 0);

        let mut plain = Sgd::new(two_groups(&named), SgdConfig { momentum: 0.0 }).unwrap();
        plain.step(1e-3).unwrap();
        assert_eq!(
            tracker.stats().current_of(MemoryTag::OptimizerState),
            0,
            "plain SGD keeps no state"
        );
    });
}

fn run_steps(opt: &mut dyn Optimizer, named: &[(String, Var)], steps: std::ops::Range<u64>) {
    for step in steps {
        set_grads(named, step, DType::F32);
        opt.step(1e-2).unwrap();
    }
}

fn clone_params(named: &[(String, Var)]) -> Vec<(String, Var)> {
    named
        .iter()
        .map(|(n, p)| (n.clone(), Var::leaf(p.tensor().deep_clone().unwrap())))
        .collect()
}

fn bits(named: &[(String, Var)]) -> Vec<Vec<u32>> {
    named
        .iter()
        .map(|(_, p)| {
            p.tensor()
                .to_vec_f32()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

#[test]
fn adamw_state_dict_round_trip_continues_bitwise() {
    let (named, _) = make_params(DType::F32);
    let mut a = AdamW::new(two_groups(&named), AdamWConfig::default()).unwrap();
    run_steps(&mut a, &named, 0..3);
    let sd = a.state_dict().unwrap();
    let names: Vec<&str> = sd.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "adamw.step_count",
        "adamw.m.a.weight",
        "adamw.v.a.weight",
        "adamw.step.a.weight",
        "adamw.m.ln.weight",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    // Through a safetensors file, into a fresh optimizer over a copy of the parameters.
    let dir = std::env::temp_dir().join(format!("meshgrad-optim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("adamw.safetensors");
    let copied: Vec<(String, Tensor)> = sd
        .iter()
        .map(|(n, t)| (n.clone(), t.deep_clone().unwrap()))
        .collect();
    meshgrad_nn::state::save_safetensors(&path, &copied, None).unwrap();
    let loaded = meshgrad_nn::state::load_safetensors(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();

    let named_b = clone_params(&named);
    let mut b = AdamW::new(two_groups(&named_b), AdamWConfig::default()).unwrap();
    b.load_state_dict(&loaded).unwrap();
    assert_eq!(b.step_count(), 3);
    assert_eq!(
        b.moments("ln.weight").unwrap().2,
        a.moments("ln.weight").unwrap().2
    );
    run_steps(&mut a, &named, 3..6);
    run_steps(&mut b, &named_b, 3..6);
    assert_eq!(bits(&named), bits(&named_b));

    // Errors: wrong shape names the tensor and both shapes; unknown names; partial state.
    let mut bad = loaded.clone();
    let i = bad
        .iter()
        .position(|(n, _)| n == "adamw.m.a.weight")
        .unwrap();
    bad[i].1 = Tensor::zeros((4, 3), DType::F32, Device::Cpu).unwrap();
    let e = b.load_state_dict(&bad).err().unwrap().to_string();
    assert!(
        e.contains("a.weight") && e.contains("[4, 3]") && e.contains("[3, 4]"),
        "{e}"
    );
    let mut bad = loaded.clone();
    bad.push((
        "adamw.m.nope".into(),
        Tensor::zeros(1, DType::F32, Device::Cpu).unwrap(),
    ));
    assert!(b
        .load_state_dict(&bad)
        .err()
        .unwrap()
        .to_string()
        .contains("adamw.m.nope"));
    let bad: Vec<_> = loaded
        .iter()
        .filter(|(n, _)| n != "adamw.v.b.weight")
        .cloned()
        .collect();
    assert!(b
        .load_state_dict(&bad)
        .err()
        .unwrap()
        .to_string()
        .contains("b.weight"));
    // A failed load leaves the state as it was.
    assert_eq!(b.step_count(), 6);
}

#[test]
fn sgd_state_dict_round_trip_continues_bitwise() {
    let (named, _) = make_params(DType::F32);
    let mut a = Sgd::new(two_groups(&named), SgdConfig { momentum: 0.9 }).unwrap();
    run_steps(&mut a, &named, 0..3);
    let sd: Vec<(String, Tensor)> = a
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.deep_clone().unwrap()))
        .collect();
    assert!(sd.iter().any(|(n, _)| n == "sgd.momentum_buffer.a.weight"));
    let named_b = clone_params(&named);
    let mut b = Sgd::new(two_groups(&named_b), SgdConfig { momentum: 0.9 }).unwrap();
    b.load_state_dict(&sd).unwrap();
    run_steps(&mut a, &named, 3..6);
    run_steps(&mut b, &named_b, 3..6);
    assert_eq!(bits(&named), bits(&named_b));
    assert!(b.load_state_dict(&[]).is_err());
}

#[test]
fn state_kind_describes_every_state_dict_entry() {
    // Every entry an optimizer writes is described, from the name alone; other names are not.
    let (named, _) = make_params(DType::F32);
    set_grads(&named, 0, DType::F32);
    let el = |p: &str| {
        Some(StateKind::Elementwise {
            param: p.to_string(),
        })
    };
    let mut adam = AdamW::new(two_groups(&named), AdamWConfig::default()).unwrap();
    adam.step(1e-3).unwrap();
    let mut sgd = Sgd::new(two_groups(&named), SgdConfig { momentum: 0.9 }).unwrap();
    sgd.step(1e-3).unwrap();
    let opts: [&dyn Optimizer; 2] = [&adam, &sgd];
    for opt in opts {
        for (key, _) in opt.state_dict().unwrap() {
            match opt.state_kind(&key) {
                Some(StateKind::Global) => assert!(key.ends_with("step_count"), "{key}"),
                Some(StateKind::Elementwise { param } | StateKind::PerParam { param }) => {
                    assert!(key.ends_with(&format!(".{param}")), "{key}");
                    assert!(named.iter().any(|(n, _)| *n == param), "{key}");
                }
                None => panic!("{key} is not described"),
            }
        }
    }
    assert_eq!(adam.state_kind("adamw.m.h.0.w"), el("h.0.w"));
    assert_eq!(adam.state_kind("adamw.v.x"), el("x"));
    assert_eq!(
        adam.state_kind("adamw.step.x"),
        Some(StateKind::PerParam { param: "x".into() })
    );
    assert_eq!(adam.state_kind("adamw.step_count"), Some(StateKind::Global));
    assert_eq!(sgd.state_kind("sgd.momentum_buffer.a.b"), el("a.b"));
    assert_eq!(sgd.state_kind("sgd.step_count"), Some(StateKind::Global));
    for other in ["adamw.m.", "sgd.momentum_buffer.x", "wte.weight"] {
        assert_eq!(adam.state_kind(other), None, "{other}");
    }
    assert_eq!(sgd.state_kind("adamw.m.x"), None);
}

/// bf16 and f16 parameters: AdamW keeps an f32 master copy and f32 moments, updates the master
/// exactly as it updates an f32 parameter given the same (f32-cast) gradients, and writes the
/// master rounded back into the parameter.
#[test]
fn half_parameters_get_f32_master_weights() {
    for half in [DType::BF16, DType::F16] {
        // Values representable in the half dtype, so both runs start from the same weights.
        let init = tensor(&values(7, 12), &[3, 4], half);
        let p_half = Var::leaf(init.clone());
        let p_f32 = Var::leaf(init.to_dtype(DType::F32).unwrap());
        let cfg = AdamWConfig::default();
        let mut oh = AdamW::new(
            vec![ParamGroup::new(vec![("w".into(), p_half.clone())], 0.1)],
            cfg,
        )
        .unwrap();
        let mut of = AdamW::new(
            vec![ParamGroup::new(vec![("w".into(), p_f32.clone())], 0.1)],
            cfg,
        )
        .unwrap();
        for step in 0..5u64 {
            let g = tensor(&values(100 + step, 12), &[3, 4], half);
            p_half.set_grad(Some(g.clone()));
            p_f32.set_grad(Some(g.to_dtype(DType::F32).unwrap()));
            // A gradient multiplier (unscaling / clipping) is applied in f32.
            oh.step_scaled(1e-3, 0.5).unwrap();
            p_f32.set_grad(Some(
                g.to_dtype(DType::F32).unwrap().mul_scalar(0.5).unwrap(),
            ));
            of.step(1e-3).unwrap();
        }
        let master = oh.master("w").unwrap();
        assert_eq!(master.dtype(), DType::F32);
        assert_eq!(oh.master("w").unwrap().dims(), &[3, 4]);
        assert!(of.master("w").is_none(), "f32 parameters need no master");
        assert_eq!(
            master.to_vec::<f32>().unwrap(),
            p_f32.tensor().to_vec::<f32>().unwrap(),
            "{half}: the master follows the f32 run bit for bit"
        );
        let (m, v, n) = oh.moments("w").unwrap();
        assert_eq!((m.dtype(), v.dtype(), n), (DType::F32, DType::F32, 5));
        assert_eq!(p_half.tensor().dtype(), half);
        assert_eq!(
            p_half.tensor().to_vec_f64().unwrap(),
            master.to_dtype(half).unwrap().to_vec_f64().unwrap(),
            "{half}: the parameter is the master rounded"
        );
        // The state dict carries the master; loading it restores it exactly.
        let sd = oh.state_dict().unwrap();
        assert!(sd
            .iter()
            .any(|(k, t)| k == "adamw.master.w" && t.dtype() == DType::F32));
        assert_eq!(
            oh.state_kind("adamw.master.w"),
            Some(StateKind::Elementwise { param: "w".into() })
        );
        let snapshot: Vec<_> = sd
            .iter()
            .map(|(k, t)| (k.clone(), t.deep_clone().unwrap()))
            .collect();
        let mut fresh = AdamW::new(
            vec![ParamGroup::new(vec![("w".into(), p_half.clone())], 0.1)],
            cfg,
        )
        .unwrap();
        fresh.load_state_dict(&snapshot).unwrap();
        assert_eq!(
            fresh.master("w").unwrap().to_vec::<f32>().unwrap(),
            master.to_vec::<f32>().unwrap()
        );
        // An f32 parameter given a master (ZeRO's f32 shards resuming a half-precision run)
        // takes the master's exact values.
        let p32 = Var::leaf(p_half.tensor().to_dtype(DType::F32).unwrap());
        let mut f32_opt = AdamW::new(
            vec![ParamGroup::new(vec![("w".into(), p32.clone())], 0.1)],
            cfg,
        )
        .unwrap();
        f32_opt.load_state_dict(&snapshot).unwrap();
        assert_eq!(
            p32.tensor().to_vec::<f32>().unwrap(),
            master.to_vec::<f32>().unwrap()
        );
        assert!(f32_opt.master("w").is_none());
        // Bad multipliers are refused.
        assert!(oh.step_scaled(1e-3, f64::NAN).is_err());
        assert!(oh.step_scaled(1e-3, 0.0).is_err());
    }
}
