//! GPT stages: a GPT split into 2 and 3 stages and chained computes the full model's loss and
//! gradients bit for bit (the tied `wte.weight` gradient summed over its two copies), with and
//! without dropout and activation checkpointing; each stage holds exactly its slice of the full
//! model's named parameters; bad stage specs are one-line errors. The whole model is the stage
//! of every block with the embedding and the head (one type, `Gpt`).

use std::collections::HashMap;
use std::sync::Arc;

use meshgrad_autograd::distributed::Collectives;
use meshgrad_autograd::Var;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{
    run_chained, ForwardCtx, Gpt, GptBatch, GptConfig, ModelStage, Module, ParamBuilder,
    StageInput, StageSpec,
};
use meshgrad_tensor::{DType, Device, Tensor};

const SEED: u64 = 7;

fn config(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 40,
        block_size: 16,
        n_layer: 4,
        n_head: 2,
        n_embd: 16,
        dropout,
        bias: true,
        layer_norm_eps: 1e-5,
    }
}

fn batch(b: usize, t: usize, vocab: u32) -> GptBatch {
    let mut s = 12345u64;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as u32) % vocab
    };
    let ids: Vec<u32> = (0..b * t).map(|_| next()).collect();
    let tg: Vec<u32> = (0..b * t).map(|_| next()).collect();
    GptBatch {
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

/// The full model's loss and gradients, by name.
fn full_run(cfg: GptConfig, ckpt: bool, b: &GptBatch, step: u64) -> (u32, Vec<(String, Tensor)>) {
    let mut model = Gpt::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    model.activation_checkpointing = ckpt;
    let loss = ForwardCtx::new(step, 0).scope(|| model.loss(&b.ids, &b.targets, None).unwrap());
    loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().expect("every parameter has a gradient")))
        .collect();
    (bits(loss.tensor())[0], grads)
}

/// The stages chained on one device ([`run_chained`]).
fn staged_run(
    cfg: GptConfig,
    ckpt: bool,
    b: &GptBatch,
    step: u64,
    sizes: &[usize],
) -> (u32, Vec<Gpt>) {
    let specs = StageSpec::split(cfg.n_layer, sizes).unwrap();
    let stages: Vec<Gpt> = specs
        .into_iter()
        .map(|s| {
            let mut st = Gpt::new_stage(cfg, s, SEED, DType::F32, Device::Cpu).unwrap();
            st.activation_checkpointing = ckpt;
            st
        })
        .collect();
    let loss = run_chained(&stages, b, ForwardCtx::new(step, 0)).unwrap();
    (bits(loss.tensor())[0], stages)
}

fn check_split(dropout: f64, ckpt: bool, sizes: &[usize]) {
    let cfg = config(dropout);
    let b = batch(3, 12, cfg.vocab_size as u32);
    let what = format!("dropout {dropout}, checkpointing {ckpt}, stages {sizes:?}");
    let (full_loss, full_grads) = full_run(cfg, ckpt, &b, 3);
    let (loss, stages) = staged_run(cfg, ckpt, &b, 3, sizes);
    assert_eq!(loss, full_loss, "loss, {what}");
    // Every parameter's gradient, found in the stage(s) holding it; the tied table's copies summed.
    let mut staged: HashMap<String, Tensor> = HashMap::new();
    for st in &stages {
        for (n, p) in st.named_parameters() {
            let g = p
                .grad()
                .unwrap_or_else(|| panic!("{n} has no gradient, {what}"));
            let g = match staged.remove(&n) {
                Some(other) => {
                    assert!(
                        st.tied_parameters().contains(&n),
                        "{n} in two stages, {what}"
                    );
                    other.add(&g).unwrap()
                }
                None => g,
            };
            staged.insert(n, g);
        }
    }
    assert_eq!(staged.len(), full_grads.len(), "{what}");
    for (n, g) in &full_grads {
        assert_eq!(bits(&staged[n]), bits(g), "gradient of {n}, {what}");
    }
    if dropout > 0.0 {
        // Dropout really is on: the run differs from one without it.
        let (no_drop, _) = full_run(config(0.0), ckpt, &b, 3);
        assert_ne!(no_drop, full_loss);
    }
}

#[test]
fn two_and_three_stages_match_the_full_model_bit_for_bit() {
    for dropout in [0.0, 0.2] {
        for ckpt in [false, true] {
            check_split(dropout, ckpt, &[2, 2]);
            check_split(dropout, ckpt, &[1, 2, 1]);
        }
    }
}

#[test]
fn one_stage_is_the_full_model() {
    let cfg = config(0.1);
    let b = batch(2, 8, cfg.vocab_size as u32);
    let (full_loss, full_grads) = full_run(cfg, false, &b, 1);
    let (loss, stages) = staged_run(cfg, false, &b, 1, &[4]);
    assert_eq!(loss, full_loss);
    assert!(stages[0].tied_parameters().is_empty());
    let names: Vec<String> = stages[0]
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let full_names: Vec<&String> = full_grads.iter().map(|(n, _)| n).collect();
    assert_eq!(names.iter().collect::<Vec<_>>(), full_names);
    let logits = stages[0].logits(StageInput::Ids(&b.ids)).unwrap();
    assert_eq!(logits.tensor().dims(), &[2, 8, cfg.vocab_size]);
}

#[test]
fn stages_hold_exactly_their_slice_of_the_full_parameters() {
    let cfg = config(0.0);
    let full = Gpt::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    let full_params = full.named_parameters();
    for sizes in [&[2usize, 2][..], &[1, 2, 1], &[1, 1, 1, 1]] {
        let specs = StageSpec::split(cfg.n_layer, sizes).unwrap();
        let mut covered = 0;
        for spec in specs {
            let st = Gpt::new_stage(cfg, spec.clone(), SEED, DType::F32, Device::Cpu).unwrap();
            let owns = |n: &str| {
                let top = n.split('.').next().unwrap();
                match top {
                    "wte" => spec.embedding || spec.head,
                    "wpe" => spec.embedding,
                    "ln_f" => spec.head,
                    "h" => {
                        let i: usize = n.split('.').nth(1).unwrap().parse().unwrap();
                        spec.blocks.contains(&i)
                    }
                    _ => panic!("unexpected parameter {n}"),
                }
            };
            // The same names, in the full model's order, with the same values.
            let want: Vec<&(String, Var)> = full_params.iter().filter(|(n, _)| owns(n)).collect();
            let got = st.named_parameters();
            assert_eq!(
                got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                want.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                "stage {spec}"
            );
            for ((n, p), (_, q)) in got.iter().zip(&want) {
                assert_eq!(bits(p.tensor()), bits(q.tensor()), "{n} of stage {spec}");
            }
            // Only its own parameters are allocated.
            let elems: usize = want.iter().map(|(_, p)| p.tensor().elem_count()).sum();
            assert_eq!(st.num_parameters(), elems, "stage {spec}");
            assert!(st.num_parameters() < full.num_parameters() || sizes.len() == 1);
            // Dropout paths are the full model's.
            let paths = st.module_paths();
            for (i, _) in st.h.iter() {
                assert!(paths.contains(&format!("h.{i}.attn.resid_dropout")));
                assert!(st.h.get(i).is_some());
            }
            assert_eq!(paths.contains(&"drop".to_string()), spec.embedding);
            covered += st.h.len();
            let tied = st.tied_parameters();
            if sizes.len() > 1 && (spec.embedding || spec.head) {
                assert_eq!(tied, ["wte.weight"]);
            } else {
                assert!(tied.is_empty());
            }
        }
        assert_eq!(covered, cfg.n_layer);
    }
}

/// A tensor-parallel group of one rank (every collective is the identity).
struct OneRank;

impl Collectives for OneRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> meshgrad_tensor::Result<Tensor> {
        Ok(t.clone())
    }
    fn all_reduce_max(&self, t: &Tensor) -> meshgrad_tensor::Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, t: &Tensor) -> meshgrad_tensor::Result<Tensor> {
        Ok(t.clone())
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> meshgrad_tensor::Result<Tensor> {
        Ok(t.clone())
    }
    fn describe(&self) -> String {
        "one rank".into()
    }
}

#[test]
fn stage_tp_plans_resolve_on_their_stages() {
    // A one-rank tensor-parallel group: every style degenerates, but the plan must match the
    // stage's modules (a pattern matching nothing is an error).
    let cfg = config(0.0);
    for spec in StageSpec::split(cfg.n_layer, &[1, 2, 1]).unwrap() {
        let group = Arc::new(OneRank);
        let tp = TensorParallel::new(group);
        let builder = ParamBuilder::new(SEED).tensor_parallel(tp, Gpt::stage_tp_plan(&spec));
        let st = Gpt::build_stage(cfg, spec.clone(), builder).unwrap();
        let direct = Gpt::new_stage(cfg, spec.clone(), SEED, DType::F32, Device::Cpu).unwrap();
        for ((n, p), (_, q)) in st.named_parameters().iter().zip(direct.named_parameters()) {
            assert_eq!(bits(p.tensor()), bits(q.tensor()), "{n} of stage {spec}");
        }
    }
    // The full plan does not fit a middle stage.
    let middle = StageSpec::new(1..3, false, false);
    let group = Arc::new(OneRank);
    let builder =
        ParamBuilder::new(SEED).tensor_parallel(TensorParallel::new(group), Gpt::tp_plan());
    let e = Gpt::build_stage(cfg, middle, builder)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("matches no module"), "{e}");
}

#[test]
fn bad_stage_specs_are_one_line_errors() {
    let cfg = config(0.0);
    let build = |spec: StageSpec| {
        Gpt::new_stage(cfg, spec, SEED, DType::F32, Device::Cpu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let one_line = |e: &str, key: &str| {
        assert!(!e.contains('\n'), "{e}");
        assert!(e.contains(key), "{e:?} should say {key:?}");
    };
    one_line(&build(StageSpec::new(2..2, false, false)), "empty");
    #[allow(clippy::reversed_empty_ranges)]
    one_line(&build(StageSpec::new(3..1, false, false)), "empty");
    one_line(&build(StageSpec::new(2..5, false, false)), "n_layer = 4");
    one_line(
        &build(StageSpec::new(1..3, true, false)),
        "start at block 0",
    );
    one_line(
        &build(StageSpec::new(1..3, false, true)),
        "end at the last block",
    );
    let part = |specs: &[StageSpec]| {
        StageSpec::check_partition(specs, 4)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    one_line(
        &part(&[
            StageSpec::new(0..3, true, false),
            StageSpec::new(2..4, false, true),
        ]),
        "overlaps",
    );
    one_line(
        &part(&[
            StageSpec::new(0..1, true, false),
            StageSpec::new(2..4, false, true),
        ]),
        "held by no stage",
    );
    one_line(
        &part(&[StageSpec::new(0..3, true, true)]),
        "end at the last",
    );
    one_line(
        &part(&[
            StageSpec::new(0..2, true, true),
            StageSpec::new(2..4, false, true),
        ]),
        "stage 0: stage spec: a stage with the head must end at the last block",
    );
    one_line(
        &part(&[
            StageSpec::new(0..2, false, false),
            StageSpec::new(2..4, false, true),
        ]),
        "the first stage must hold the embedding",
    );
    one_line(&part(&[]), "no stage");
    one_line(
        &StageSpec::split(4, &[2, 0, 2]).err().unwrap().to_string(),
        "empty",
    );
    one_line(
        &StageSpec::split(4, &[2, 3]).err().unwrap().to_string(),
        "n_layer = 4",
    );
    one_line(
        &StageSpec::even(4, 5).err().unwrap().to_string(),
        "5 stages",
    );
    assert_eq!(
        StageSpec::even(5, 3).unwrap(),
        [
            StageSpec::new(0..2, true, false),
            StageSpec::new(2..4, false, false),
            StageSpec::new(4..5, false, true)
        ]
    );
    // Wrong inputs for a stage.
    let b = batch(1, 4, cfg.vocab_size as u32);
    let mid = Gpt::new_stage(
        cfg,
        StageSpec::new(1..3, false, false),
        SEED,
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    one_line(
        &mid.hidden(StageInput::Ids(&b.ids))
            .err()
            .unwrap()
            .to_string(),
        "not token ids",
    );
    one_line(
        &mid.stage_loss(StageInput::Ids(&b.ids), &b.targets, None)
            .err()
            .unwrap()
            .to_string(),
        "has no head",
    );
    let bad = Var::constant(Tensor::zeros((1, 4, 8), DType::F32, Device::Cpu).unwrap());
    one_line(
        &mid.hidden(StageInput::Hidden(&bad))
            .err()
            .unwrap()
            .to_string(),
        "[B, T, 16]",
    );
    let first = Gpt::new_stage(
        cfg,
        StageSpec::new(0..1, true, false),
        SEED,
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    let h = Var::constant(Tensor::zeros((1, 4, 16), DType::F32, Device::Cpu).unwrap());
    one_line(
        &first
            .hidden(StageInput::Hidden(&h))
            .err()
            .unwrap()
            .to_string(),
        "takes token ids",
    );
}

#[test]
fn the_whole_model_is_the_full_stage() {
    let cfg = config(0.1);
    let whole = Gpt::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    let full = Gpt::new_stage(cfg, StageSpec::full(4), SEED, DType::F32, Device::Cpu).unwrap();
    assert!(whole.is_full() && full.is_full());
    assert_eq!(whole.spec, StageSpec::full(cfg.n_layer));
    assert_eq!(whole.h.range(), 0..4);
    assert!(std::ptr::eq(&*whole.h[2], &*whole.h.blocks()[2]));
    let (a, b) = (whole.named_parameters(), full.named_parameters());
    assert_eq!(a.len(), b.len());
    for ((n, p), (m, q)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        assert_eq!(bits(p.tensor()), bits(q.tensor()), "{n}");
    }
    // The full stage's plan is the whole plan; a middle stage's has no embedding or head.
    assert_eq!(
        Gpt::stage_tp_plan(&StageSpec::full(4)).entries(),
        Gpt::tp_plan().entries()
    );
    let middle = StageSpec::new(1..3, false, false);
    let plan = Gpt::stage_tp_plan(&middle);
    assert!(plan.entries().iter().all(|(p, _)| p.starts_with("h.*.")));
    // Only the whole model generates and becomes a Hugging Face folder.
    let last = Gpt::new_stage(
        cfg,
        StageSpec::new(2..4, false, true),
        SEED,
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    assert_eq!(last.h.range(), 2..4);
    assert!(last.h.get(1).is_none());
    let e = last
        .generate(&[1, 2], 2, 0.0, None, 0, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("is a stage (blocks 2..4 + head)"), "{e}");
    let e = meshgrad_nn::state::hf_config_json(&last)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a Hugging Face folder holds the whole model"),
        "{e}"
    );
    // A stage's whole-model loss on ids needs the embedding.
    let b = batch(1, 4, cfg.vocab_size as u32);
    let e = last.loss(&b.ids, &b.targets, None).unwrap_err().to_string();
    assert!(e.contains("not token ids"), "{e}");
    let out = whole
        .generate(&[1, 2], 3, 0.0, None, 0, |_| Ok(()))
        .unwrap();
    assert_eq!(out.len(), 3);
}
