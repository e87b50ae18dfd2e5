//! The mixture of experts ([`SparseMoe`]): routing against a float64 hand reference, the layer's
//! output and load-balancing loss against a plain f64 re-computation (transformers' formulas),
//! its gradients (the aux term included) against finite differences in f64, capacity drops,
//! the one-line refusals, and the expert load collected per step.

use meshgrad_autograd::{gradcheck, ForwardCtx, GradcheckOptions, Var};
use meshgrad_nn::moe::{
    collect_expert_load, run_counts, MoeSettings, Routing, RoutingArgs, SequenceSplit, SparseMoe,
};
use meshgrad_nn::{Forward, Module, ParamBuilder};
use meshgrad_tensor::{DType, Device, Random, Tensor};

const C: usize = 6;
const I: usize = 5;

fn layer(settings: MoeSettings, aux_weight: f64) -> SparseMoe {
    ParamBuilder::new(3)
        .dtype(DType::F64)
        .build(|p| SparseMoe::new(p, (C, I), settings, (0, aux_weight)))
        .unwrap()
}

fn input(b: usize, t: usize) -> Tensor {
    Random::new(11)
        .dtype(DType::F64)
        .uniform(&[b, t, C][..], -2.0, 2.0)
        .unwrap()
}

fn param(m: &SparseMoe, name: &str) -> Vec<f64> {
    let all = m.named_parameters();
    let (_, p) = all.iter().find(|(n, _)| n == name).expect(name);
    p.tensor().to_vec_f64().unwrap()
}

/// `w [out, in] x`.
fn matvec(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let n = x.len();
    (0..out)
        .map(|o| (0..n).map(|i| w[o * n + i] * x[i]).sum())
        .collect()
}

/// transformers' `MixtralSparseMoeBlock` and `load_balancing_loss_func` for each sequence, in
/// plain f64: returns the output `[b * t * C]` and the per-sequence aux losses.
fn reference(m: &SparseMoe, x: &[f64], b: usize, t: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (m.settings.n_experts, m.settings.experts_per_token);
    let gate = param(m, "gate.weight");
    let mut out = vec![0.0; b * t * C];
    let mut aux = Vec::new();
    for row in 0..b {
        let mut tokens_per_expert = vec![0.0; n];
        let mut prob_per_expert = vec![0.0; n];
        for tok in 0..t {
            let xi = &x[(row * t + tok) * C..(row * t + tok + 1) * C];
            let logits = matvec(&gate, xi, n);
            let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
            let p: Vec<f64> = logits.iter().map(|l| (l - mx).exp() / z).collect();
            let mut idx: Vec<usize> = (0..n).collect();
            idx.sort_by(|&a, &c| p[c].partial_cmp(&p[a]).unwrap());
            let top = &idx[..k];
            let s: f64 = top.iter().map(|&e| p[e]).sum();
            for &e in top {
                let w1 = param(m, &format!("experts.{e}.w1.weight"));
                let w2 = param(m, &format!("experts.{e}.w2.weight"));
                let w3 = param(m, &format!("experts.{e}.w3.weight"));
                let g = matvec(&w1, xi, I);
                let u = matvec(&w3, xi, I);
                let h: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let y = matvec(&w2, &h, C);
                for c in 0..C {
                    out[(row * t + tok) * C + c] += p[e] / s * y[c];
                }
                tokens_per_expert[e] += 1.0 / t as f64;
            }
            for e in 0..n {
                prob_per_expert[e] += p[e] / t as f64;
            }
        }
        let l: f64 = (0..n)
            .map(|e| tokens_per_expert[e] * prob_per_expert[e])
            .sum();
        aux.push(l * n as f64);
    }
    (out, aux)
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn routing_matches_a_hand_reference() {
    // Two rows of two tokens, three experts, top 2: ties go to the lower index.
    let probs = [
        0.5, 0.2, 0.3, // t0: 0, 2
        0.1, 0.6, 0.3, // t1: 1, 2
        0.4, 0.4, 0.2, // t2: 0, 1 (tie)
        0.2, 0.3, 0.5, // t3: 2, 1
    ];
    let args = RoutingArgs {
        probs: &probs,
        rows: 2,
        tokens: 2,
        n_experts: 3,
        top_k: 2,
        capacity_factor: None,
        split: None,
    };
    let r = Routing::new(args).unwrap();
    assert_eq!(r.choices, vec![0, 2, 1, 2, 0, 1, 2, 1]);
    // Grouped by expert, in token order: expert 0 {t0, t2}, 1 {t1, t2, t3}, 2 {t0, t1, t3}.
    assert_eq!(r.permuted_tokens, vec![0, 2, 1, 2, 3, 0, 1, 3]);
    assert_eq!(r.expert_sizes, vec![2, 3, 3]);
    assert_eq!(r.slot_position, vec![0, 5, 2, 6, 1, 3, 7, 4]);
    assert_eq!(r.routed, vec![2, 3, 3]);
    assert_eq!(r.row_routed, vec![1, 1, 2, 1, 2, 1]);
    assert_eq!(r.dropped, 0);
    // Capacity factor 0.5: ceil(0.5 * 2 * 2 / 3) = 1 copy per expert and row; the later token's
    // copy is dropped (expert 1 in row 1: t3; expert 2 in row 0: t1).
    let r = Routing::new(RoutingArgs {
        capacity_factor: Some(0.5),
        split: None,
        ..args
    })
    .unwrap();
    assert_eq!(r.permuted_tokens, vec![0, 2, 1, 2, 0, 3]);
    assert_eq!(r.expert_sizes, vec![2, 2, 2]);
    assert_eq!(r.dropped, 2);
    assert_eq!(r.slot_position, vec![0, 4, 2, 6, 1, 3, 5, 6]);
    // One-line refusals.
    for (k, n) in [(0, 3), (4, 3)] {
        let e = Routing::new(RoutingArgs {
            top_k: k,
            n_experts: n,
            ..args
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("experts_per_token = {k} must be in 1..=3")),
            "{e}"
        );
    }
    let e = MoeSettings::new(4, 5).validate().unwrap_err().to_string();
    assert!(
        e.contains("experts_per_token = 5") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn a_capacity_over_context_parallel_chunks_keeps_one_devices_copies() {
    // One row of 8 tokens, 3 experts, top 2, capacity ceil(0.75 * 8 * 2 / 3) = 4 copies. Two
    // ranks hold chunks {0, 3} and {1, 2} of 4 (two tokens each); each routes its chunks with
    // the copies routed at earlier chunks (from both ranks' run counts, added by hand here).
    let (t, n, k) = (8, 3, 2);
    let probs: Vec<f64> = Random::new(7)
        .dtype(DType::F64)
        .uniform(&[t, n][..], 0.0, 1.0)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let whole = RoutingArgs {
        probs: &probs,
        rows: 1,
        tokens: t,
        n_experts: n,
        top_k: k,
        capacity_factor: Some(0.75),
        split: None,
    };
    let one = Routing::new(whole).unwrap();
    assert!(one.dropped > 0, "{one:?}");
    // Whether each token's j-th copy was kept, by global token.
    let kept = |r: &Routing, s: usize| r.slot_position[s] < r.permuted_tokens.len() as u32;
    let chunks = [[0usize, 3], [1, 2]];
    let local: Vec<Vec<f64>> = chunks
        .iter()
        .map(|cs| {
            cs.iter()
                .flat_map(|&c| probs[c * 2 * n..(c + 1) * 2 * n].to_vec())
                .collect()
        })
        .collect();
    fn args<'a>(whole: RoutingArgs<'a>, p: &'a [f64]) -> RoutingArgs<'a> {
        RoutingArgs {
            probs: p,
            tokens: 4,
            ..whole
        }
    }
    let counts: Vec<Vec<usize>> = local
        .iter()
        .map(|p| run_counts(&args(whole, p), 2).unwrap())
        .collect();
    // counts[rank][run * n + e]: chunk c of the sequence is rank/run `owner[c]`.
    let owner = [(0, 0), (1, 0), (1, 1), (0, 1)];
    let mut dropped = 0;
    for (rank, cs) in chunks.iter().enumerate() {
        let mut before = vec![0; 2 * n];
        for (run, &c) in cs.iter().enumerate() {
            for &(r, s) in &owner[..c] {
                for e in 0..n {
                    before[run * n + e] += counts[r][s * n + e];
                }
            }
        }
        let r = Routing::new(RoutingArgs {
            split: Some(SequenceSplit {
                sequence: t,
                segments: 2,
                routed_before: &before,
            }),
            ..args(whole, &local[rank])
        })
        .unwrap();
        dropped += r.dropped;
        for (run, &c) in cs.iter().enumerate() {
            for s in 0..2 * k {
                let (mine, global) = (run * 2 * k + s, c * 2 * k + s);
                assert_eq!(r.choices[mine], one.choices[global]);
                assert_eq!(
                    kept(&r, mine),
                    kept(&one, global),
                    "rank {rank} chunk {c} slot {s}"
                );
            }
        }
    }
    assert_eq!(dropped, one.dropped);
}

#[test]
fn the_layer_and_its_loss_match_transformers_formulas_in_f64() {
    let m = layer(MoeSettings::new(4, 2), 0.0);
    let (b, t) = (2, 5);
    let x = input(b, t);
    let out = m.forward_routed(&Var::constant(x.clone())).unwrap();
    let (want, aux_rows) = reference(&m, &x.to_vec_f64().unwrap(), b, t);
    close(
        &out.output.tensor().to_vec_f64().unwrap(),
        &want,
        1e-12,
        "output",
    );
    let mean = aux_rows.iter().sum::<f64>() / b as f64;
    close(&[out.aux.tensor().item().unwrap()], &[mean], 1e-12, "aux");
    // One sequence: exactly transformers' loss for one layer.
    let one = m
        .forward_routed(&Var::constant(x.narrow(0, 1, 1).unwrap()))
        .unwrap();
    close(
        &[one.aux.tensor().item().unwrap()],
        &[aux_rows[1]],
        1e-12,
        "aux row 1",
    );
}

#[test]
fn gradients_with_the_aux_term_match_finite_differences() {
    // f(x) = attach(moe(x)): gradcheck's objective sum(w * y) gains 0.3 * aux through the
    // backward alone; its finite differences see only sum(w * y), so the check compares with
    // an explicit sum(w * y) + 0.3 * aux whose aux is the same layer's value.
    let (b, t) = (2, 3);
    let x = input(b, t);
    let plain = layer(MoeSettings::new(4, 2), 0.0);
    let weighted = layer(MoeSettings::new(4, 2), 0.3);
    let opts = GradcheckOptions {
        atol: 1e-6,
        rtol: 1e-5,
        ..GradcheckOptions::default()
    };
    // The layer without the aux term, then the objective with it, differentiated by the input.
    gradcheck(|v| plain.forward(&v[0]), std::slice::from_ref(&x), opts).unwrap();
    let w = Random::new(5)
        .dtype(DType::F64)
        .uniform(&[b, t, C][..], -1.0, 1.0)
        .unwrap();
    let objective = |xt: &Tensor| -> f64 {
        let o = plain.forward_routed(&Var::constant(xt.clone())).unwrap();
        let main = o
            .output
            .tensor()
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .item()
            .unwrap();
        main + 0.3 * o.aux.tensor().item().unwrap()
    };
    let xv = Var::leaf(x.clone());
    let y = weighted.forward(&xv).unwrap();
    y.backward_with(w.clone()).unwrap();
    let analytic = xv.grad().unwrap().to_vec_f64().unwrap();
    let base = x.to_vec_f64().unwrap();
    let eps = 1e-6;
    for i in 0..base.len() {
        let at = |d: f64| {
            let mut v = base.clone();
            v[i] += d;
            objective(&Tensor::from_vec(v, (b, t, C), Device::Cpu).unwrap())
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps);
        assert!(
            (analytic[i] - fd).abs() <= 1e-6 + 1e-5 * fd.abs(),
            "d/dx[{i}]: {} vs {fd}",
            analytic[i]
        );
    }
    // The router's gradient includes the aux term: it differs from the plain layer's.
    let g_aux = weighted.gate.weight.grad().unwrap().to_vec_f64().unwrap();
    let xp = Var::leaf(x.clone());
    plain.forward(&xp).unwrap().backward_with(w).unwrap();
    let g_plain = plain.gate.weight.grad().unwrap().to_vec_f64().unwrap();
    assert!(g_aux
        .iter()
        .zip(&g_plain)
        .any(|(a, b)| (a - b).abs() > 1e-9));
}

#[test]
fn the_aux_gradient_follows_the_forward_loss_scale() {
    let x = input(1, 4);
    let m = layer(MoeSettings::new(3, 1), 0.5);
    let grad_at = |scale: f64| {
        m.gate.weight.zero_grad();
        let y = ForwardCtx::new(0, 0).scope_scaled(scale, || m.forward(&Var::constant(x.clone())));
        // Only the aux term: the output's gradient is zero.
        y.unwrap().backward_with(x.zeros_like().unwrap()).unwrap();
        m.gate.weight.grad().unwrap().to_vec_f64().unwrap()
    };
    let (one, quarter) = (grad_at(1.0), grad_at(0.25));
    assert!(one.iter().any(|g| *g != 0.0));
    close(
        &quarter,
        &one.iter().map(|g| g * 0.25).collect::<Vec<_>>(),
        1e-12,
        "scaled",
    );
}

#[test]
fn capacity_drops_copies_and_the_load_is_collected() {
    let mut s = MoeSettings::new(4, 2);
    s.capacity_factor = Some(0.5);
    let m = layer(s, 0.0);
    let x = input(2, 6);
    let (out, load) = collect_expert_load(|| m.forward_routed(&Var::leaf(x.clone())).unwrap());
    // ceil(0.5 * 6 * 2 / 4) = 2 copies per expert and row.
    let r = &out.routings[0];
    assert!(r.dropped > 0, "{r:?}");
    assert_eq!(r.expert_sizes.iter().sum::<usize>() + r.dropped, 2 * 6 * 2);
    assert!(r.expert_sizes.iter().all(|&n| n <= 2 * 2));
    let l = &load.layers[&0];
    assert_eq!(l.routed.iter().sum::<f64>(), 24.0);
    assert_eq!(l.dropped, r.dropped as f64);
    assert_eq!(l.rows, 2.0);
    close(
        &[l.aux_sum / 2.0],
        &[out.aux.tensor().item().unwrap()],
        1e-12,
        "aux",
    );
    // A dropped copy adds nothing: the dropless layer differs exactly where copies were dropped.
    let full = layer(MoeSettings::new(4, 2), 0.0)
        .forward(&Var::constant(x.clone()))
        .unwrap();
    assert_ne!(
        full.tensor().to_vec_f64().unwrap(),
        out.output.tensor().to_vec_f64().unwrap()
    );
    // Outside a collection, or without grad, nothing is recorded.
    let (_, none) = collect_expert_load(|| {
        meshgrad_autograd::no_grad(|| m.forward(&Var::leaf(x.clone())).unwrap())
    });
    assert!(none.is_empty());
}

#[test]
fn mixtral_folders_round_trip_and_refuse_what_they_cannot_hold() {
    use meshgrad_nn::llama::{Llama, LlamaConfig};
    use meshgrad_nn::state::hf_mixtral::{
        is_mixtral_folder, load_mixtral, mixtral_config_from_hf_json, save_mixtral,
    };
    let mut c = LlamaConfig::new(32, 8, 16, 2, 2);
    c.intermediate_size = 8;
    c.moe = Some(MoeSettings::new(3, 2));
    let model = Llama::new(c, 5, DType::F32, Device::Cpu).unwrap();
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.contains(&"model.layers.1.block_sparse_moe.gate.weight".to_string()));
    assert!(names.contains(&"model.layers.0.block_sparse_moe.experts.2.w3.weight".to_string()));
    assert!(!names.iter().any(|n| n.contains(".mlp.")));
    let dir = std::env::temp_dir().join(format!("meshgrad-mixtral-{}", std::process::id()));
    save_mixtral(&model, &dir).unwrap();
    assert!(is_mixtral_folder(&dir));
    let back = load_mixtral(&dir, DType::F32, Device::Cpu).unwrap();
    assert_eq!(back.config.moe, c.moe);
    for ((n, p), (m, q)) in model.named_parameters().iter().zip(back.named_parameters()) {
        assert_eq!(
            (n, p.tensor().to_vec_f64().unwrap()),
            (&m, q.tensor().to_vec_f64().unwrap())
        );
    }
    let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], (1, 4), Device::Cpu).unwrap();
    let (a, b) = (model.forward(&ids).unwrap(), back.forward(&ids).unwrap());
    let (a, b) = (
        a.tensor().to_vec_f64().unwrap(),
        b.tensor().to_vec_f64().unwrap(),
    );
    close(&a, &b, 1e-5, "logits");
    std::fs::remove_dir_all(&dir).unwrap();
    // A transformers-style config: defaults, and one-line refusals.
    let json = |extra: &str| {
        format!(
            "{{\"model_type\": \"mixtral\", \"vocab_size\": 32, \"hidden_size\": 16, \
             \"intermediate_size\": 8, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \
             \"num_key_value_heads\": 1, \"max_position_embeddings\": 8, \
             \"num_local_experts\": 4, \"num_experts_per_tok\": 2{extra}}}"
        )
    };
    let c = mixtral_config_from_hf_json(&json("")).unwrap();
    let moe = c.moe.unwrap();
    assert_eq!((moe.n_experts, moe.experts_per_token), (4, 2));
    assert_eq!(moe.router_aux_loss_coef, 0.001);
    // MixtralConfig's defaults, not LlamaConfig's (1e-6, 1e4).
    assert_eq!((c.norm_eps, c.rope_theta), (1e-5, 1e6));
    for (extra, needle) in [
        (", \"sliding_window\": 4", "sliding_window 4"),
        (", \"router_jitter_noise\": 0.1", "router_jitter_noise"),
        (", \"num_experts_per_tok\": 5", "experts_per_token = 5"),
    ] {
        let text = json(extra).replacen(
            ", \"num_experts_per_tok\": 2",
            "",
            usize::from(extra.contains("per_tok")),
        );
        let e = mixtral_config_from_hf_json(&text).unwrap_err().to_string();
        assert!(e.contains(needle) && !e.contains('\n'), "{e}");
    }
}
