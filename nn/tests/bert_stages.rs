//! BERT stages: a `BertForMaskedLM` split into 2 and 3 stages and chained computes the full
//! model's MLM loss and gradients bit for bit (the tied word-embedding gradient summed over its
//! two copies), with padding masks, two token types, dropout on and off and activation
//! checkpointing on and off; each stage holds exactly its slice of the full model's named
//! parameters (names, order, values); the whole model is the full stage; bad stage specs and
//! inputs are one-line errors.

use std::collections::HashMap;
use std::sync::Arc;

use meshgrad_autograd::distributed::Collectives;
use meshgrad_autograd::Var;
use meshgrad_nn::bert::IGNORE_INDEX;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{
    run_chained, BertBatch, BertConfig, BertForMaskedLM, ForwardCtx, ModelStage, Module,
    ParamBuilder, StageInput, StageSpec,
};
use meshgrad_tensor::{DType, Device, Tensor};

const SEED: u64 = 7;
const TIED: &str = "bert.embeddings.word_embeddings.weight";

fn config(dropout: f64) -> BertConfig {
    BertConfig {
        vocab_size: 40,
        hidden_size: 16,
        num_hidden_layers: 4,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 16,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: dropout,
        attention_probs_dropout_prob: dropout,
        pad_token_id: 0,
        initializer_range: 0.02,
    }
}

/// `b` rows of `t` tokens: row `r` has `t - 3 r` real tokens (the rest padding, mask 0), the
/// second half of the real tokens of token type 1, about a third of the real tokens labelled.
fn batch(b: usize, t: usize, vocab: u32) -> BertBatch {
    let mut s = 12345u64;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    let (mut ids, mut mask, mut types, mut labels) = (vec![], vec![], vec![], vec![]);
    for r in 0..b {
        let len = t.saturating_sub(3 * r).max(2);
        for c in 0..t {
            let real = c < len;
            ids.push(if real { 1 + next() % (vocab - 1) } else { 0 });
            mask.push(u32::from(real));
            types.push(u32::from(real && c >= len / 2));
            labels.push(if real && next() % 3 == 0 {
                i64::from(next() % vocab)
            } else {
                IGNORE_INDEX
            });
        }
    }
    let u = |v: Vec<u32>| Tensor::from_vec(v, (b, t), Device::Cpu).unwrap();
    BertBatch {
        ids: u(ids),
        attention_mask: Some(u(mask)),
        token_type_ids: Some(u(types)),
        labels: Tensor::from_vec(labels, (b, t), Device::Cpu).unwrap(),
        denominator: None,
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
fn full_run(cfg: BertConfig, ckpt: bool, b: &BertBatch, step: u64) -> (u32, Vec<(String, Tensor)>) {
    let mut model = BertForMaskedLM::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    model.activation_checkpointing = ckpt;
    let (mask, types) = (b.attention_mask.as_ref(), b.token_type_ids.as_ref());
    let loss = ForwardCtx::new(step, 0).scope(|| match b.denominator {
        None => model.loss(&b.ids, mask, types, &b.labels).unwrap(),
        Some(d) => model.loss_over(&b.ids, mask, types, &b.labels, d).unwrap(),
    });
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
    cfg: BertConfig,
    ckpt: bool,
    b: &BertBatch,
    step: u64,
    sizes: &[usize],
) -> (u32, Vec<BertForMaskedLM>) {
    let specs = StageSpec::split(cfg.num_hidden_layers, sizes).unwrap();
    let stages: Vec<BertForMaskedLM> = specs
        .into_iter()
        .map(|s| {
            let mut st = BertForMaskedLM::new_stage(cfg, s, SEED, DType::F32, Device::Cpu).unwrap();
            st.activation_checkpointing = ckpt;
            st
        })
        .collect();
    let loss = run_chained(&stages, b, ForwardCtx::new(step, 0)).unwrap();
    (bits(loss.tensor())[0], stages)
}

/// Every parameter's gradient, found in the stage(s) holding it; the tied table's copies summed.
fn summed_grads(stages: &[BertForMaskedLM], what: &str) -> HashMap<String, Tensor> {
    let mut staged: HashMap<String, Tensor> = HashMap::new();
    for st in stages {
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
    staged
}

fn check_split(dropout: f64, ckpt: bool, sizes: &[usize], b: &BertBatch) {
    let cfg = config(dropout);
    let what = format!(
        "dropout {dropout}, checkpointing {ckpt}, stages {sizes:?}, denominator {:?}",
        b.denominator
    );
    let (full_loss, full_grads) = full_run(cfg, ckpt, b, 3);
    let (loss, stages) = staged_run(cfg, ckpt, b, 3, sizes);
    assert_eq!(loss, full_loss, "loss, {what}");
    let staged = summed_grads(&stages, &what);
    assert_eq!(staged.len(), full_grads.len(), "{what}");
    for (n, g) in &full_grads {
        assert_eq!(bits(&staged[n]), bits(g), "gradient of {n}, {what}");
    }
    if dropout > 0.0 {
        // Dropout really is on: the run differs from one without it.
        let (no_drop, _) = full_run(config(0.0), ckpt, b, 3);
        assert_ne!(no_drop, full_loss, "{what}");
    }
}

#[test]
fn two_and_three_stages_match_the_full_model_bit_for_bit() {
    let b = batch(3, 12, 40);
    // The batch really has padding, both token types and ignored labels.
    let mask = b.attention_mask.as_ref().unwrap().to_vec_f64().unwrap();
    assert!(mask.contains(&0.0) && mask.contains(&1.0));
    let types = b.token_type_ids.as_ref().unwrap().to_vec_f64().unwrap();
    assert!(types.contains(&0.0) && types.contains(&1.0));
    let labels = b.labels.to_vec::<i64>().unwrap();
    assert!(labels.contains(&IGNORE_INDEX) && labels.iter().any(|&l| l != IGNORE_INDEX));
    for dropout in [0.0, 0.2] {
        for ckpt in [false, true] {
            check_split(dropout, ckpt, &[2, 2], &b);
            check_split(dropout, ckpt, &[1, 2, 1], &b);
        }
    }
}

#[test]
fn a_global_denominator_matches_loss_over() {
    // A microbatch of a larger batch: its loss is its share of the larger batch's mean.
    let mut b = batch(2, 10, 40);
    b.denominator = Some(23.0);
    check_split(0.1, false, &[3, 1], &b);
    // Without masks or token types (attend everywhere, type 0).
    let mut b = batch(2, 10, 40);
    b.attention_mask = None;
    b.token_type_ids = None;
    check_split(0.1, true, &[1, 3], &b);
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
    let logits = stages[0]
        .logits(
            StageInput::Ids(&b.ids),
            b.attention_mask.as_ref(),
            b.token_type_ids.as_ref(),
        )
        .unwrap();
    assert_eq!(logits.tensor().dims(), &[2, 8, cfg.vocab_size]);
}

#[test]
fn stages_hold_exactly_their_slice_of_the_full_parameters() {
    let cfg = config(0.0);
    let full = BertForMaskedLM::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    let full_params = full.named_parameters();
    let full_paths = full.module_paths();
    for sizes in [&[2usize, 2][..], &[1, 2, 1], &[1, 1, 1, 1]] {
        let specs = StageSpec::split(cfg.num_hidden_layers, sizes).unwrap();
        let mut covered = 0;
        for spec in specs {
            let st = BertForMaskedLM::new_stage(cfg, spec.clone(), SEED, DType::F32, Device::Cpu)
                .unwrap();
            let owns = |n: &str| {
                if n == TIED {
                    spec.embedding || spec.head
                } else if let Some(rest) = n.strip_prefix("bert.encoder.layer.") {
                    let i: usize = rest.split('.').next().unwrap().parse().unwrap();
                    spec.blocks.contains(&i)
                } else if n.starts_with("bert.embeddings.") {
                    spec.embedding
                } else if n.starts_with("cls.") {
                    spec.head
                } else {
                    panic!("unexpected parameter {n}")
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
            // The padding row of every copy of the table starts at zero.
            if let Some(table) = st.word_embeddings() {
                let row = table.tensor().narrow(0, cfg.pad_token_id, 1).unwrap();
                assert!(row.to_vec_f64().unwrap().iter().all(|&v| v == 0.0));
            }
            // Only its own parameters are allocated.
            let elems: usize = want.iter().map(|(_, p)| p.tensor().elem_count()).sum();
            assert_eq!(st.num_parameters(), elems, "stage {spec}");
            assert!(st.num_parameters() < full.num_parameters() || sizes.len() == 1);
            // Module paths (so dropout masks) are the full model's.
            let paths = st.module_paths();
            for p in &paths {
                assert!(full_paths.contains(p), "{p} of stage {spec}");
            }
            for (i, _) in st.bert.encoder.layer.iter() {
                for d in ["attention.self.dropout", "attention.output.dropout"] {
                    assert!(paths.contains(&format!("bert.encoder.layer.{i}.{d}")));
                }
            }
            assert_eq!(
                paths.contains(&"bert.embeddings.dropout".to_string()),
                spec.embedding
            );
            assert_eq!(paths.contains(&"cls.predictions".to_string()), spec.head);
            covered += st.bert.encoder.layer.len();
            let tied = st.tied_parameters();
            if sizes.len() > 1 && (spec.embedding || spec.head) {
                assert_eq!(tied, [TIED]);
            } else {
                assert!(tied.is_empty());
            }
        }
        assert_eq!(covered, cfg.num_hidden_layers);
    }
}

#[test]
fn delayed_init_stages_get_the_same_values() {
    let cfg = config(0.0);
    for spec in StageSpec::split(cfg.num_hidden_layers, &[1, 2, 1]).unwrap() {
        let lazy =
            BertForMaskedLM::build_stage(cfg, spec.clone(), ParamBuilder::new(SEED).delayed_init())
                .unwrap();
        let eager =
            BertForMaskedLM::new_stage(cfg, spec.clone(), SEED, DType::F32, Device::Cpu).unwrap();
        for ((n, p), (_, q)) in lazy.named_parameters().iter().zip(eager.named_parameters()) {
            assert_eq!(bits(p.tensor()), bits(q.tensor()), "{n} of stage {spec}");
        }
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
    for spec in StageSpec::split(cfg.num_hidden_layers, &[1, 2, 1]).unwrap() {
        let tp = TensorParallel::new(Arc::new(OneRank));
        let builder =
            ParamBuilder::new(SEED).tensor_parallel(tp, BertForMaskedLM::stage_tp_plan(&spec));
        let st = BertForMaskedLM::build_stage(cfg, spec.clone(), builder).unwrap();
        let direct =
            BertForMaskedLM::new_stage(cfg, spec.clone(), SEED, DType::F32, Device::Cpu).unwrap();
        for ((n, p), (_, q)) in st.named_parameters().iter().zip(direct.named_parameters()) {
            assert_eq!(bits(p.tensor()), bits(q.tensor()), "{n} of stage {spec}");
        }
    }
    // The full plan is the whole model's stage's plan.
    assert_eq!(
        BertForMaskedLM::stage_tp_plan(&StageSpec::full(4)).entries(),
        BertForMaskedLM::tp_plan().entries()
    );
    // The full plan does not fit a middle stage.
    let middle = StageSpec::new(1..3, false, false);
    let builder = ParamBuilder::new(SEED).tensor_parallel(
        TensorParallel::new(Arc::new(OneRank)),
        BertForMaskedLM::tp_plan(),
    );
    let e = BertForMaskedLM::build_stage(cfg, middle, builder)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("matches no module"), "{e}");
}

#[test]
fn bad_stage_specs_and_inputs_are_one_line_errors() {
    let cfg = config(0.0);
    let build = |spec: StageSpec| {
        BertForMaskedLM::new_stage(cfg, spec, SEED, DType::F32, Device::Cpu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let one_line = |e: &str, key: &str| {
        assert!(!e.contains('\n'), "{e}");
        assert!(e.contains(key), "{e:?} should say {key:?}");
    };
    one_line(&build(StageSpec::new(2..2, false, false)), "empty");
    one_line(&build(StageSpec::new(2..5, false, false)), "n_layer = 4");
    one_line(
        &build(StageSpec::new(1..3, true, false)),
        "start at block 0",
    );
    one_line(
        &build(StageSpec::new(1..3, false, true)),
        "end at the last block",
    );
    one_line(&build(StageSpec::new(1..3, false, true)), "bert stage spec");
    let bad_cfg = BertConfig {
        num_attention_heads: 3,
        ..cfg
    };
    one_line(
        &BertForMaskedLM::new_stage(bad_cfg, StageSpec::full(4), SEED, DType::F32, Device::Cpu)
            .err()
            .unwrap()
            .to_string(),
        "not divisible by num_attention_heads",
    );
    // Wrong inputs for a stage.
    let b = batch(2, 6, cfg.vocab_size as u32);
    let stage = |blocks: std::ops::Range<usize>, e: bool, h: bool| {
        BertForMaskedLM::new_stage(
            cfg,
            StageSpec::new(blocks, e, h),
            SEED,
            DType::F32,
            Device::Cpu,
        )
        .unwrap()
    };
    let err = |r: meshgrad_tensor::Result<Var>| r.err().unwrap().to_string();
    let mid = stage(1..3, false, false);
    let mask = b.attention_mask.as_ref();
    one_line(
        &err(mid.hidden_states(StageInput::Ids(&b.ids), mask, None)),
        "not token ids",
    );
    one_line(
        &err(mid.stage_loss(StageInput::Ids(&b.ids), mask, None, &b.labels, None)),
        "has no MLM head",
    );
    let bad = Var::constant(Tensor::zeros((2, 6, 8), DType::F32, Device::Cpu).unwrap());
    one_line(
        &err(mid.hidden_states(StageInput::Hidden(&bad), mask, None)),
        "[B, T, 16]",
    );
    let h3 = Var::constant(Tensor::zeros((3, 6, 16), DType::F32, Device::Cpu).unwrap());
    one_line(
        &err(mid.hidden_states(StageInput::Hidden(&h3), mask, None)),
        "does not match the hidden states",
    );
    one_line(
        &err(mid.forward_stage(&b, Some(&h3))),
        "do not match the batch",
    );
    let first = stage(0..1, true, false);
    let h = Var::constant(Tensor::zeros((2, 6, 16), DType::F32, Device::Cpu).unwrap());
    one_line(
        &err(first.hidden_states(StageInput::Hidden(&h), mask, None)),
        "takes token ids",
    );
    let short = Tensor::zeros((2, 5), DType::U32, Device::Cpu).unwrap();
    one_line(
        &err(first.hidden_states(StageInput::Ids(&b.ids), Some(&short), None)),
        "attention_mask has shape",
    );
    let last = stage(3..4, false, true);
    let mut wrong = b.clone();
    wrong.labels = Tensor::full(50.0, (2, 6), DType::I64, Device::Cpu).unwrap();
    one_line(&err(last.forward_stage(&wrong, Some(&h))), "vocab_size 40");
    wrong.labels = Tensor::full(1.0, (2, 5), DType::I64, Device::Cpu).unwrap();
    one_line(
        &err(last.forward_stage(&wrong, Some(&h))),
        "must match input_ids",
    );
    let mut zero = b.clone();
    zero.denominator = Some(0.0);
    one_line(&err(last.forward_stage(&zero, Some(&h))), "denominator");
}

#[test]
fn the_whole_model_is_the_full_stage() {
    let cfg = config(0.1);
    let whole = BertForMaskedLM::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    let full =
        BertForMaskedLM::new_stage(cfg, StageSpec::full(4), SEED, DType::F32, Device::Cpu).unwrap();
    assert!(whole.is_full() && full.is_full());
    assert_eq!(whole.spec, StageSpec::full(cfg.num_hidden_layers));
    assert_eq!(whole.bert.encoder.layer.range(), 0..4);
    assert!(whole.bert.embeddings.as_ref().is_some() && whole.cls.is_some());
    let (a, b) = (whole.named_parameters(), full.named_parameters());
    assert_eq!(a.len(), b.len());
    for ((n, p), (m, q)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        assert_eq!(bits(p.tensor()), bits(q.tensor()), "{n}");
    }
    assert_eq!(whole.module_paths(), full.module_paths());
    // A middle stage's plan has no embeddings or head.
    let middle = StageSpec::new(1..3, false, false);
    let plan = BertForMaskedLM::stage_tp_plan(&middle);
    assert!(plan
        .entries()
        .iter()
        .all(|(p, _)| p.starts_with("bert.encoder.layer.*.")));
    // Training mode is the dropouts'.
    assert!(whole.is_training());
    whole.set_training(false);
    assert!(!whole.is_training());
    // Only the whole model becomes a Hugging Face folder.
    let last = BertForMaskedLM::new_stage(
        cfg,
        StageSpec::new(2..4, false, true),
        SEED,
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    assert!(!last.is_full());
    assert_eq!(last.bert.encoder.layer.range(), 2..4);
    assert!(last.word_embeddings().is_some());
    let e = meshgrad_nn::state::hf_bert::hf_bert_config_json(&last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is a stage (blocks 2..4 + head)"), "{e}");
    let dir = std::env::temp_dir().join(format!("meshgrad_bert_stage_{}", std::process::id()));
    let e = meshgrad_nn::state::hf_bert::load_bert_weights(&last, &dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("load_bert: this bert is a stage"), "{e}");
    // A middle stage holds no table; the whole model's forward needs the embeddings and head.
    let mid = BertForMaskedLM::new_stage(cfg, middle, SEED, DType::F32, Device::Cpu).unwrap();
    assert!(mid.word_embeddings().is_none());
    let ids = Tensor::from_vec(vec![1u32, 2, 3], (1, 3), Device::Cpu).unwrap();
    let e = mid.forward(&ids, None, None).unwrap_err().to_string();
    assert!(e.contains("has no MLM head"), "{e}");
}
