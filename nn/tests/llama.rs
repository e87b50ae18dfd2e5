//! The Llama model: stages chained give the whole model's loss and gradients bit for bit (tied
//! and untied heads, with and without activation checkpointing); gradients agree with finite
//! differences; tensor parallelism over two in-process ranks matches one device (bit for bit in
//! reference mode, with and without sequence parallelism); bad configs and layouts are one-line
//! errors. Agreement with Hugging Face transformers is in `llama_hf.rs`.

use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};

use meshgrad_autograd::distributed::Collectives;
use meshgrad_autograd::{gradcheck, GradcheckOptions, Var};
use meshgrad_nn::llama::{reference_chunks, RopeAngles};
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{
    run_chained, ForwardCtx, Llama, LlamaBatch, LlamaConfig, ModelStage, Module, ParamBuilder,
    StageInput, StageSpec,
};
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 5;

fn config(tied: bool) -> LlamaConfig {
    let mut c = LlamaConfig::new(32, 16, 16, 4, 4);
    c.n_kv_head = 2;
    c.intermediate_size = 24;
    c.tie_embeddings = tied;
    c
}

fn batch(b: usize, t: usize, vocab: u32) -> LlamaBatch {
    let mut s = 2024u64;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as u32) % vocab
    };
    let ids: Vec<u32> = (0..b * t).map(|_| next()).collect();
    let tg: Vec<u32> = (0..b * t).map(|_| next()).collect();
    LlamaBatch {
        ids: Tensor::from_vec(ids, (b, t), Device::Cpu).unwrap(),
        targets: Tensor::from_vec(tg, (b, t), Device::Cpu).unwrap(),
        ignore_index: None,
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn grads(m: &dyn Module) -> Vec<(String, Tensor)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| {
            (
                n.clone(),
                p.grad().unwrap_or_else(|| panic!("{n}: no gradient")),
            )
        })
        .collect()
}

#[test]
fn stages_chained_match_the_whole_model_bit_for_bit() {
    for tied in [false, true] {
        for ckpt in [false, true] {
            let c = config(tied);
            let b = batch(2, 12, c.vocab_size as u32);
            let mut full = Llama::new(c, SEED, DType::F32, Device::Cpu).unwrap();
            full.activation_checkpointing = ckpt;
            assert!(full.is_full());
            let loss = full.loss(&b.ids, &b.targets, None).unwrap();
            loss.backward().unwrap();
            let want = grads(&full);
            for sizes in [&[2usize, 2][..], &[1, 2, 1], &[4]] {
                let what = format!("tied {tied}, checkpointing {ckpt}, stages {sizes:?}");
                let stages: Vec<Llama> = StageSpec::split(c.n_layer, sizes)
                    .unwrap()
                    .into_iter()
                    .map(|s| {
                        let mut st = Llama::new_stage(c, s, SEED, DType::F32, Device::Cpu).unwrap();
                        st.activation_checkpointing = ckpt;
                        st
                    })
                    .collect();
                let l = run_chained(&stages, &b, ForwardCtx::new(0, 0)).unwrap();
                assert_eq!(bits(l.tensor()), bits(loss.tensor()), "loss, {what}");
                let mut got: HashMap<String, Tensor> = HashMap::new();
                for st in &stages {
                    for (n, g) in grads(st) {
                        let g = match got.remove(&n) {
                            Some(other) => {
                                assert!(st.tied_parameters().contains(&n), "{n} twice, {what}");
                                other.add(&g).unwrap()
                            }
                            None => g,
                        };
                        got.insert(n, g);
                    }
                    let tied_here = st.tied_parameters();
                    let ends = st.spec.embedding != st.spec.head;
                    if tied && sizes.len() > 1 && ends {
                        assert_eq!(tied_here, ["model.embed_tokens.weight"], "{what}");
                    } else {
                        assert!(tied_here.is_empty(), "{what}");
                    }
                }
                assert_eq!(got.len(), want.len(), "{what}");
                for (n, g) in &want {
                    assert_eq!(bits(&got[n]), bits(g), "gradient of {n}, {what}");
                }
            }
        }
    }
}

#[test]
fn parameter_names_are_hugging_faces_and_stages_hold_their_slice() {
    let c = config(false);
    let full = Llama::new(c, SEED, DType::F32, Device::Cpu).unwrap();
    let names: Vec<String> = full
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let layer0: Vec<&str> = names
        .iter()
        .filter(|n| n.starts_with("model.layers.0."))
        .map(String::as_str)
        .collect();
    assert_eq!(
        layer0,
        [
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
        ]
    );
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(
        &names[names.len() - 2..],
        ["model.norm.weight", "lm_head.weight"]
    );
    assert_eq!(full.num_parameters(), c.num_parameters());
    let tied = Llama::new(config(true), SEED, DType::F32, Device::Cpu).unwrap();
    assert_eq!(tied.num_parameters(), config(true).num_parameters());
    assert_eq!(tied.tied_table(), Some("model.embed_tokens.weight"));
    assert_eq!(full.tied_table(), None);
    // A middle stage holds its layers only, with the whole model's values.
    let mid = Llama::new_stage(
        c,
        StageSpec::new(1..3, false, false),
        SEED,
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    let whole: HashMap<String, Var> = full.named_parameters().into_iter().collect();
    let mid_names: Vec<String> = mid.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(mid_names
        .iter()
        .all(|n| n.starts_with("model.layers.1.") || n.starts_with("model.layers.2.")));
    assert_eq!(mid_names.len(), 18);
    for (n, p) in mid.named_parameters() {
        assert_eq!(bits(p.tensor()), bits(whole[&n].tensor()), "{n}");
    }
    // Its input is hidden states, not ids, and it has no head.
    let b = batch(1, 4, 32);
    let e = mid.hidden(StageInput::Ids(&b.ids)).unwrap_err().to_string();
    assert!(e.contains("not token ids"), "{e}");
    let h = Var::leaf(Tensor::zeros((1, 4, 16), DType::F32, Device::Cpu).unwrap());
    let e = mid.logits(StageInput::Hidden(&h)).unwrap_err().to_string();
    assert!(e.contains("has no head"), "{e}");
}

/// The loss of a tiny f64 Llama against central finite differences: with respect to the hidden
/// states a stage takes (every layer, grouped-query attention, RoPE, RMSNorm, SwiGLU, the head),
/// and to elements of every kind of parameter.
#[test]
fn gradients_match_finite_differences() {
    for angles in [RopeAngles::Fused, RopeAngles::Transformers] {
        gradients_match_finite_differences_with(angles);
    }
}

fn gradients_match_finite_differences_with(angles: RopeAngles) {
    let mut c = LlamaConfig::new(11, 8, 8, 2, 4);
    c.rope_angles = angles;
    c.n_kv_head = 2;
    c.intermediate_size = 6;
    let spec = StageSpec::new(0..2, false, true);
    let stage = Llama::new_stage(c, spec, 3, DType::F64, Device::Cpu).unwrap();
    // Larger weights than N(0, 0.02), so every path contributes visibly.
    for (_, p) in stage.named_parameters() {
        let t = p.tensor();
        let noise = meshgrad_tensor::Random::new(9)
            .dtype(DType::F64)
            .normal(t.shape().clone(), 0.0, 0.3)
            .unwrap();
        t.copy_from(&t.mul_scalar(10.0).unwrap().add(&noise).unwrap())
            .unwrap();
    }
    let targets = Tensor::from_vec(vec![1u32, 7, 3, 10, 0], (1, 5), Device::Cpu).unwrap();
    let x = meshgrad_tensor::Random::new(4)
        .dtype(DType::F64)
        .normal((1, 5, 8), 0.0, 1.0)
        .unwrap();
    gradcheck(
        |xs| stage.stage_loss(StageInput::Hidden(&xs[0]), &targets, None),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )
    .unwrap();
    // Parameters: dL/dp from backward against (L(p + e) - L(p - e)) / 2e for a few elements.
    let loss_of = || -> f64 {
        stage
            .stage_loss(
                StageInput::Hidden(&Var::constant(x.clone())),
                &targets,
                None,
            )
            .unwrap()
            .tensor()
            .item()
            .unwrap()
    };
    stage.zero_grad();
    stage
        .stage_loss(
            StageInput::Hidden(&Var::constant(x.clone())),
            &targets,
            None,
        )
        .unwrap()
        .backward()
        .unwrap();
    for (name, p) in stage.named_parameters() {
        let g = p.grad().unwrap().to_vec_f64().unwrap();
        let t = p.tensor();
        let n = t.elem_count();
        for e in [0, n / 2, n - 1] {
            let base = t.to_vec_f64().unwrap();
            let at = |d: f64| {
                let mut v = base.clone();
                v[e] += d;
                t.copy_from(&Tensor::from_vec(v, t.shape().clone(), Device::Cpu).unwrap())
                    .unwrap();
                loss_of()
            };
            let eps = 1e-6;
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            at(0.0);
            assert!(
                (numeric - g[e]).abs() <= 1e-6 + 1e-5 * numeric.abs(),
                "{angles:?}: {name}[{e}]: backward {} vs finite differences {numeric}",
                g[e]
            );
        }
    }
}

#[test]
fn bad_configs_are_one_line_errors() {
    let one_line = |c: LlamaConfig, key: &str| {
        let e = Llama::new(c, 0, DType::F32, Device::Cpu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!e.contains('\n'), "{e}");
        assert!(e.contains(key), "{e:?} should say {key:?}");
    };
    let mut c = config(false);
    c.n_kv_head = 3;
    one_line(c, "n_kv_head 3 does not divide n_head 4");
    let mut c = config(false);
    c.n_embd = 12; // head width 3
    one_line(c, "must be even");
    let mut c = config(false);
    c.n_embd = 18;
    one_line(c, "n_embd 18 is not divisible by n_head 4");
    let mut c = config(false);
    c.intermediate_size = 0;
    one_line(c, "intermediate_size must be at least 1");
    let mut c = config(false);
    c.rope_theta = 0.0;
    one_line(c, "rope_theta");
    let mut c = config(false);
    c.norm_eps = f64::NAN;
    one_line(c, "norm_eps");
    let e = Llama::new_stage(
        config(false),
        StageSpec::new(1..3, true, false),
        0,
        DType::F32,
        Device::Cpu,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.starts_with("llama stage spec") && e.contains("start at block 0"),
        "{e}"
    );
    let full = Llama::new(config(false), 0, DType::F32, Device::Cpu).unwrap();
    let long = batch(1, 17, 32);
    let e = full
        .loss(&long.ids, &long.targets, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sequence length 17 must be in 1..=16"), "{e}");
}

#[test]
fn layouts_that_do_not_split_are_one_line_errors() {
    let model = Llama::new(config(false), 0, DType::F32, Device::Cpu).unwrap();
    let e = model
        .check_tensor_parallel(4, None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "tensor parallelism: llama n_kv_head = 2 is not divisible by tp = 4"
    );
    let mut c = config(false);
    c.n_head = 2;
    c.n_kv_head = 2;
    c.n_embd = 8;
    let e = meshgrad_nn::llama::check_tp_sizes(&c, 4, None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "tensor parallelism: llama n_head = 2 is not divisible by tp = 4"
    );
    let mut c = config(false);
    c.n_kv_head = 4;
    c.intermediate_size = 30;
    let e = meshgrad_nn::llama::check_tp_sizes(&c, 4, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("intermediate_size = 30"), "{e}");
    let e = model
        .check_tensor_parallel(2, Some(7))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sequence length 7"), "{e}");
    model.check_tensor_parallel(2, Some(8)).unwrap();
    // Building for a group that does not split the heads fails before any allocation.
    let groups = ThreadGroup::group(4);
    let tp = TensorParallel::new(groups[0].clone());
    let builder = ParamBuilder::new(0)
        .tensor_parallel(tp, Llama::tp_plan(&config(false), &StageSpec::full(4)));
    let e = Llama::build(config(false), builder)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("n_kv_head = 2 is not divisible by tp = 4"),
        "{e}"
    );
}

/// In-process ranks whose collectives exchange tensors through shared slots (sums in rank
/// order: with two ranks that is the reference tree).
struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    size: usize,
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

impl ThreadGroup {
    /// The `size` ranks of one group.
    fn group(size: usize) -> Vec<Arc<dyn Collectives>> {
        let shared = Arc::new(Shared {
            size,
            slots: Mutex::new(vec![None; size]),
            barrier: Barrier::new(size),
        });
        (0..size)
            .map(|rank| {
                Arc::new(ThreadGroup {
                    rank,
                    shared: shared.clone(),
                }) as Arc<dyn Collectives>
            })
            .collect()
    }

    fn exchange(&self, t: &Tensor) -> Vec<Tensor> {
        self.shared.slots.lock().unwrap()[self.rank] = Some(t.contiguous().unwrap());
        self.shared.barrier.wait();
        let all: Vec<Tensor> = self
            .shared
            .slots
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.clone().unwrap())
            .collect();
        self.shared.barrier.wait();
        all
    }

    fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.exchange(t);
        all[1..]
            .iter()
            .try_fold(all[0].clone(), |acc, x| acc.add(x))
    }
}

impl Collectives for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.sum(t)
    }
    fn all_reduce_max(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.exchange(t);
        all[1..]
            .iter()
            .try_fold(all[0].clone(), |acc, x| acc.maximum(x))
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.exchange(t);
        let refs: Vec<&Tensor> = all.iter().collect();
        Tensor::cat(&refs, 0)
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        let s = self.sum(t)?;
        let n = s.dims()[0] / self.shared.size;
        s.narrow(0, self.rank * n, n)?.contiguous()
    }
    fn describe(&self) -> String {
        format!("threads[{} of {}]", self.rank, self.shared.size)
    }
}

/// Loss bits and whole (gathered) gradients of one training step of the whole model on `tp`
/// in-process ranks (`tp = 1`: one device, no group), in reference mode when `reference`.
fn tp_step(
    c: LlamaConfig,
    tp: usize,
    sp: bool,
    reference: bool,
    b: &LlamaBatch,
) -> (f32, Vec<(String, Tensor)>) {
    let chunks = reference.then(|| reference_chunks(&c));
    let plan = Llama::tp_plan(&c, &StageSpec::full(c.n_layer));
    let run = |group: Option<Arc<dyn Collectives>>| {
        let builder = ParamBuilder::new(SEED);
        let builder = match (group, chunks) {
            (Some(g), k) => builder.tensor_parallel(
                TensorParallel::new(g).sequence_parallel(sp).reference(k),
                plan.clone(),
            ),
            (None, Some(k)) => {
                builder.tensor_parallel(TensorParallel::single_device(k), plan.clone())
            }
            (None, None) => builder,
        };
        let model = Llama::build(c, builder).unwrap();
        check_local_shapes(&model, &c, tp);
        let loss = model.loss(&b.ids, &b.targets, b.ignore_index).unwrap();
        loss.backward().unwrap();
        let grads: Vec<(String, Tensor)> = model
            .named_parameters()
            .into_iter()
            .map(|(n, p)| {
                let g = p.grad().unwrap();
                let g = match p.placement() {
                    Some(pl) => pl.gather(&g).unwrap(),
                    None => g,
                };
                (n, g)
            })
            .collect();
        (loss.tensor().to_vec::<f32>().unwrap()[0], grads)
    };
    if tp == 1 {
        return run(None);
    }
    let groups = ThreadGroup::group(tp);
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| s.spawn(|| run(Some(g))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.into_iter().next().unwrap()
}

/// Each of `tp` ranks holds its `1 / tp` of the split parameters: query heads, kv heads, MLP
/// rows or columns, vocabulary rows; norms whole.
fn check_local_shapes(model: &Llama, c: &LlamaConfig, tp: usize) {
    let d = c.head_dim();
    let (e, i, v) = (c.n_embd, c.intermediate_size, c.vocab_size);
    for (n, p) in model.named_parameters() {
        let want: Vec<usize> = match n.rsplit('.').nth(1).unwrap() {
            "q_proj" => vec![c.n_head * d / tp, e],
            "k_proj" | "v_proj" => vec![c.n_kv_head * d / tp, e],
            "o_proj" => vec![e, c.n_head * d / tp],
            "gate_proj" | "up_proj" => vec![i / tp, e],
            "down_proj" => vec![e, i / tp],
            "embed_tokens" | "lm_head" => vec![v / tp, e],
            _ => vec![e],
        };
        assert_eq!(p.tensor().dims(), want, "{n} on one of {tp} ranks");
    }
}

#[test]
fn two_tensor_parallel_ranks_match_one_device() {
    for (tied, angles) in [
        (false, RopeAngles::Fused),
        (true, RopeAngles::Fused),
        (false, RopeAngles::Transformers),
    ] {
        let c = LlamaConfig {
            rope_angles: angles,
            ..config(tied)
        };
        let b = batch(2, 8, c.vocab_size as u32);
        // Reference mode: the same bits on two ranks as on one device, with or without
        // sequence parallelism.
        let (loss1, grads1) = tp_step(c, 1, false, true, &b);
        for sp in [false, true] {
            let (loss2, grads2) = tp_step(c, 2, sp, true, &b);
            assert_eq!(
                loss2.to_bits(),
                loss1.to_bits(),
                "tied {tied}, sp {sp}: loss"
            );
            for ((n, g2), (_, g1)) in grads2.iter().zip(&grads1) {
                assert_eq!(bits(g2), bits(g1), "tied {tied}, sp {sp}: gradient of {n}");
            }
        }
        // Fast mode: close to the plain single-device model.
        let (loss0, grads0) = tp_step(c, 1, false, false, &b);
        let (loss2, grads2) = tp_step(c, 2, true, false, &b);
        assert!(
            (loss2 - loss0).abs() < 1e-5,
            "tied {tied}: {loss2} vs {loss0}"
        );
        assert!(
            (loss1 - loss0).abs() < 1e-5,
            "tied {tied}: {loss1} vs {loss0}"
        );
        for ((n, g2), (_, g0)) in grads2.iter().zip(&grads0) {
            let (a, z) = (g2.to_vec_f64().unwrap(), g0.to_vec_f64().unwrap());
            let worst = a
                .iter()
                .zip(&z)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-5,
                "tied {tied}: gradient of {n} differs by {worst}"
            );
        }
    }
}

/// bf16 and f16 parameters (the fused ops compute in f32): the loss and the gradients come out
/// finite and close to the f32 model's, with the same parameter values rounded.
#[test]
fn half_precision_models_track_the_f32_model() {
    let c = config(false);
    let b = batch(2, 8, c.vocab_size as u32);
    let full = Llama::new(c, SEED, DType::F32, Device::Cpu).unwrap();
    let want: f64 = full
        .loss(&b.ids, &b.targets, None)
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let half = Llama::new(c, SEED, dtype, Device::Cpu).unwrap();
        let loss = half.loss(&b.ids, &b.targets, None).unwrap();
        loss.backward().unwrap();
        let got: f64 = loss.tensor().item().unwrap();
        assert!(
            (got - want).abs() < 0.05,
            "{dtype}: loss {got} vs f32 {want}"
        );
        for (n, g) in grads(&half) {
            assert_eq!(g.dtype(), dtype, "{n}");
            assert!(
                g.to_vec_f64().unwrap().iter().all(|x| x.is_finite()),
                "{dtype}: {n}"
            );
        }
    }
}

/// Pipeline stages on two tensor-parallel ranks (each stage built from its part of the plan,
/// [`Llama::tp_plan`] of its spec), chained: in reference mode the loss and the (gathered, tied
/// copies summed) gradients are one device's whole model's, bit for bit.
#[test]
fn stages_on_two_tensor_parallel_ranks_match_one_device() {
    for tied in [false, true] {
        let c = config(tied);
        let b = batch(2, 8, c.vocab_size as u32);
        let (loss1, grads1) = tp_step(c, 1, false, true, &b);
        let k = reference_chunks(&c);
        for sp in [false, true] {
            let groups = ThreadGroup::group(2);
            let run = |g: Arc<dyn Collectives>| {
                let stages: Vec<Llama> = StageSpec::split(c.n_layer, &[1, 2, 1])
                    .unwrap()
                    .into_iter()
                    .map(|spec| {
                        let tp = TensorParallel::new(g.clone())
                            .sequence_parallel(sp)
                            .reference(Some(k));
                        let plan = Llama::tp_plan(&c, &spec);
                        Llama::build_stage(
                            c,
                            spec,
                            ParamBuilder::new(SEED).tensor_parallel(tp, plan),
                        )
                        .unwrap()
                    })
                    .collect();
                let loss = run_chained(&stages, &b, ForwardCtx::new(0, 0)).unwrap();
                let mut grads: HashMap<String, Tensor> = HashMap::new();
                for st in &stages {
                    for (n, p) in st.named_parameters() {
                        let g = p.grad().unwrap();
                        let g = match p.placement() {
                            Some(pl) => pl.gather(&g).unwrap(),
                            None => g,
                        };
                        let g = match grads.remove(&n) {
                            Some(other) => other.add(&g).unwrap(),
                            None => g,
                        };
                        grads.insert(n, g);
                    }
                }
                (loss.tensor().to_vec::<f32>().unwrap()[0], grads)
            };
            let (loss2, grads2) = std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .into_iter()
                    .map(|g| s.spawn(move || run(g)))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).next().unwrap()
            });
            let what = format!("tied {tied}, sp {sp}");
            assert_eq!(loss2.to_bits(), loss1.to_bits(), "{what}: loss");
            assert_eq!(grads2.len(), grads1.len(), "{what}");
            for (n, g1) in &grads1 {
                assert_eq!(bits(&grads2[n]), bits(g1), "{what}: gradient of {n}");
            }
        }
    }
}
