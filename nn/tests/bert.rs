//! BERT: logits against an independent float64 reference written here from the raw safetensors
//! tensors (plain loops, no meshgrad ops), with padding and token types; Hugging Face checkpoints
//! both ways (names with and without `bert.`, ignored and tied tensors, errors); the MLM loss
//! over labels with -100; gradients against finite differences in f64; dropout masks that follow
//! global rows; activation checkpointing; the MLM masking.

use crate::bert_ref;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bert_ref::{RefConfig, Reference, Seq};

use meshgrad_autograd::no_grad;
use meshgrad_nn::bert::{BertConfig, BertForMaskedLM, IGNORE_INDEX};
use meshgrad_nn::mlm::{byte_level, mlm_mask, mlm_mask_rows, MlmConfig, SpecialTokens};
use meshgrad_nn::state::hf_bert::{bert_config_from_hf_json, is_bert_checkpoint};
use meshgrad_nn::state::{load_bert, load_state_dict, save_bert, save_safetensors};
use meshgrad_nn::{ForwardCtx, Module};
use meshgrad_tensor::{DType, Device, Tensor};

// ----- helpers -----

/// A fresh, empty directory for one test (removed by `Drop`).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("meshgrad-bert-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random values in [-1, 1) (a small LCG).
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

fn small_config() -> BertConfig {
    BertConfig {
        vocab_size: 50,
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 64,
        max_position_embeddings: 16,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        pad_token_id: 0,
        initializer_range: 0.02,
    }
}

fn ref_config() -> RefConfig {
    let c = small_config();
    RefConfig {
        hidden_size: c.hidden_size,
        num_attention_heads: c.num_attention_heads,
        num_hidden_layers: c.num_hidden_layers,
        vocab_size: c.vocab_size,
        layer_norm_eps: c.layer_norm_eps,
    }
}

/// A small BERT whose every parameter (biases and norms included) holds random values, so the
/// reference comparison exercises all of them. Eval mode.
fn random_model(dtype: DType) -> BertForMaskedLM {
    let m = BertForMaskedLM::new(small_config(), 3, dtype, Device::Cpu).unwrap();
    let mut sd = Vec::new();
    for (i, (name, p)) in m.named_parameters().into_iter().enumerate() {
        let n = p.tensor().elem_count();
        let r = values(100 + i as u64, n);
        let v: Vec<f64> = if name.contains("LayerNorm.weight") {
            r.iter().map(|x| 1.0 + 0.2 * x).collect()
        } else if name.ends_with("bias") {
            r.iter().map(|x| 0.1 * x).collect()
        } else {
            r.iter().map(|x| 0.3 * x).collect()
        };
        let t = Tensor::from_vec(v, p.tensor().shape().clone(), Device::Cpu).unwrap();
        sd.push((name, t));
    }
    load_state_dict(&m, &sd, true).unwrap();
    m.set_training(false);
    m
}

/// Two rows of 7 tokens: the second padded after 4 tokens; mixed token types.
struct Inputs {
    ids: Vec<Vec<usize>>,
    mask: Vec<Vec<f64>>,
    types: Vec<Vec<usize>>,
    labels: Vec<Vec<i64>>,
}

fn inputs() -> Inputs {
    Inputs {
        ids: vec![vec![2, 17, 33, 5, 49, 8, 3], vec![2, 41, 9, 3, 0, 0, 0]],
        mask: vec![vec![1.; 7], vec![1., 1., 1., 1., 0., 0., 0.]],
        types: vec![vec![0, 0, 0, 1, 1, 1, 1], vec![0, 0, 1, 1, 0, 0, 0]],
        labels: vec![
            vec![-100, 17, -100, -100, 12, -100, -100],
            vec![-100, -100, 9, -100, -100, -100, -100],
        ],
    }
}

fn tensors(inp: &Inputs) -> (Tensor, Tensor, Tensor, Tensor) {
    let (b, t) = (inp.ids.len(), inp.ids[0].len());
    let flat_u32 =
        |v: &Vec<Vec<usize>>| -> Vec<u32> { v.iter().flatten().map(|&x| x as u32).collect() };
    let ids = Tensor::from_vec(flat_u32(&inp.ids), (b, t), Device::Cpu).unwrap();
    let types = Tensor::from_vec(flat_u32(&inp.types), (b, t), Device::Cpu).unwrap();
    let mask = Tensor::from_vec(
        inp.mask
            .iter()
            .flatten()
            .map(|&x| x as u8)
            .collect::<Vec<u8>>(),
        (b, t),
        Device::Cpu,
    )
    .unwrap();
    let labels = Tensor::from_vec(
        inp.labels.iter().flatten().copied().collect::<Vec<i64>>(),
        (b, t),
        Device::Cpu,
    )
    .unwrap();
    (ids, mask, types, labels)
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .fold(0.0, |m, (x, y)| f64::max(m, (x - y).abs()))
}

/// The model's logits for the test inputs, as f64 `[B * T * V]`.
fn model_logits(m: &BertForMaskedLM, inp: &Inputs) -> Vec<f64> {
    let (ids, mask, types, _) = tensors(inp);
    no_grad(|| m.forward(&ids, Some(&mask), Some(&types)))
        .unwrap()
        .tensor()
        .to_vec_f64()
        .unwrap()
}

fn seqs(inp: &Inputs) -> Vec<Seq> {
    (0..inp.ids.len())
        .map(|b| Seq {
            ids: inp.ids[b].clone(),
            mask: inp.mask[b].clone(),
            types: inp.types[b].clone(),
            labels: inp.labels[b].clone(),
        })
        .collect()
}

fn reference_logits(dir: &Path, prefix: &str, inp: &Inputs) -> Vec<f64> {
    let r = Reference::load(dir, prefix, ref_config());
    let mut out = Vec::new();
    for b in 0..inp.ids.len() {
        for row in r.logits(&inp.ids[b], &inp.mask[b], &inp.types[b]) {
            out.extend(row);
        }
    }
    out
}

/// The logits of real (non-padded) positions only: padded query rows are not compared (their
/// values are well defined but meaningless).
fn real_positions(l: &[f64], inp: &Inputs, v: usize) -> Vec<f64> {
    let t = inp.ids[0].len();
    let mut out = Vec::new();
    for (b, mask) in inp.mask.iter().enumerate() {
        for (i, &m) in mask.iter().enumerate() {
            if m != 0.0 {
                out.extend_from_slice(&l[(b * t + i) * v..(b * t + i + 1) * v]);
            }
        }
    }
    out
}

// ----- model structure -----

#[test]
fn names_follow_hugging_face_and_count_matches_config() {
    let m = BertForMaskedLM::new(small_config(), 1, DType::F32, Device::Cpu).unwrap();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    for expected in [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.bias",
        "bert.encoder.layer.0.attention.self.query.weight",
        "bert.encoder.layer.0.attention.self.key.bias",
        "bert.encoder.layer.0.attention.self.value.weight",
        "bert.encoder.layer.0.attention.output.dense.weight",
        "bert.encoder.layer.0.attention.output.LayerNorm.bias",
        "bert.encoder.layer.1.intermediate.dense.weight",
        "bert.encoder.layer.1.output.dense.bias",
        "bert.encoder.layer.1.output.LayerNorm.weight",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.LayerNorm.bias",
        "cls.predictions.bias",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "missing {expected}: {names:?}"
        );
    }
    assert!(!names.iter().any(|n| n.contains("decoder")), "{names:?}");
    assert_eq!(names.len(), 5 + 2 * 16 + 5);
    assert_eq!(m.num_parameters(), small_config().num_parameters());
    // The padding row of the word embeddings starts at zero; the others do not.
    let w = m.word_embeddings().unwrap().tensor().to_vec_f64().unwrap();
    assert!(w[..32].iter().all(|&x| x == 0.0));
    assert!(w[32..64].iter().any(|&x| x != 0.0));
    // The encoder layers form a module list (what FSDP's default wrap policy shards by).
    let paths = m.module_paths();
    for p in [
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
        "cls.predictions.transform",
    ] {
        assert!(
            paths.iter().any(|x| x == p),
            "missing module {p}: {paths:?}"
        );
    }
}

#[test]
fn config_validation_errors_name_the_field() {
    let cases: Vec<(BertConfig, &str)> = vec![
        (
            BertConfig {
                num_attention_heads: 5,
                ..small_config()
            },
            "not divisible",
        ),
        (
            BertConfig {
                vocab_size: 0,
                ..small_config()
            },
            "vocab_size",
        ),
        (
            BertConfig {
                hidden_dropout_prob: 1.0,
                ..small_config()
            },
            "hidden_dropout_prob",
        ),
        (
            BertConfig {
                pad_token_id: 50,
                ..small_config()
            },
            "pad_token_id",
        ),
        (
            BertConfig {
                layer_norm_eps: 0.0,
                ..small_config()
            },
            "layer_norm_eps",
        ),
    ];
    for (c, needle) in cases {
        let e = BertForMaskedLM::new(c, 0, DType::F32, Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
}

#[test]
fn input_errors_are_reported() {
    let m = BertForMaskedLM::new(small_config(), 1, DType::F32, Device::Cpu).unwrap();
    let ids = Tensor::from_vec(vec![1u32; 6], (2, 3), Device::Cpu).unwrap();
    let long = Tensor::from_vec(vec![1u32; 17], (1, 17), Device::Cpu).unwrap();
    let e = m.forward(&long, None, None).err().unwrap().to_string();
    assert!(e.contains("max_position_embeddings"), "{e}");
    let bad_mask = Tensor::from_vec(vec![1u32; 3], (1, 3), Device::Cpu).unwrap();
    let e = m
        .forward(&ids, Some(&bad_mask), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("attention_mask"), "{e}");
    let labels =
        Tensor::from_vec(vec![-100i64, 3, 50, -100, -100, -100], (2, 3), Device::Cpu).unwrap();
    let e = m.loss(&ids, None, None, &labels).err().unwrap().to_string();
    assert!(
        e.contains("label 50") && e.contains("row 0, position 2"),
        "{e}"
    );
}

// ----- against the reference -----

#[test]
fn logits_match_f64_reference_with_padding_and_token_types() {
    let inp = inputs();
    let v = small_config().vocab_size;
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::F64, 1e-10)] {
        let m = random_model(dtype);
        let dir = TempDir::new(&format!("ref-{dtype}"));
        save_bert(&m, dir.path()).unwrap();
        let want = reference_logits(dir.path(), "bert.", &inp);
        let got = model_logits(&m, &inp);
        let scale = want.iter().fold(0f64, |a, x| a.max(x.abs()));
        assert!(
            scale > 1.0,
            "logits too small to be a useful check: {scale}"
        );
        let d = max_abs_diff(
            &real_positions(&got, &inp, v),
            &real_positions(&want, &inp, v),
        );
        assert!(d <= tol, "{dtype}: max |logit diff| {d:e} (scale {scale})");
    }
}

#[test]
fn padding_does_not_change_the_real_positions() {
    // Row 1 padded to 7 tokens gives the same logits at its 4 real positions as alone.
    let m = random_model(DType::F64);
    let inp = inputs();
    let full = model_logits(&m, &inp);
    let alone = Inputs {
        ids: vec![inp.ids[1][..4].to_vec()],
        mask: vec![vec![1.0; 4]],
        types: vec![inp.types[1][..4].to_vec()],
        labels: vec![inp.labels[1][..4].to_vec()],
    };
    let (ids, _, types, _) = tensors(&alone);
    let got = no_grad(|| m.forward(&ids, None, Some(&types)))
        .unwrap()
        .tensor()
        .to_vec_f64()
        .unwrap();
    let v = small_config().vocab_size;
    let d = max_abs_diff(&got, &full[7 * v..(7 + 4) * v]);
    assert!(d < 1e-12, "{d:e}");
}

#[test]
fn loss_is_the_mean_over_labelled_tokens() {
    let inp = inputs();
    let m = random_model(DType::F64);
    let dir = TempDir::new("loss");
    save_bert(&m, dir.path()).unwrap();
    let want = Reference::load(dir.path(), "bert.", ref_config()).loss(&seqs(&inp));
    let (ids, mask, types, labels) = tensors(&inp);
    let got = no_grad(|| m.loss(&ids, Some(&mask), Some(&types), &labels))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert!((got - want).abs() < 1e-10, "{got} vs {want}");
    assert_eq!(m.count_labels(&labels).unwrap(), 3);
    // The share of the same rows in a larger batch's mean.
    let part = no_grad(|| m.loss_over(&ids, Some(&mask), Some(&types), &labels, 6.0))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert!((part - want * 3.0 / 6.0).abs() < 1e-10, "{part}");
    // F32 against the same reference (weights saved as f32).
    let m32 = random_model(DType::F32);
    let got32 = no_grad(|| m32.loss(&ids, Some(&mask), Some(&types), &labels))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    let dir32 = TempDir::new("loss32");
    save_bert(&m32, dir32.path()).unwrap();
    let want32 = Reference::load(dir32.path(), "bert.", ref_config()).loss(&seqs(&inp));
    assert!(
        (got32 - want32).abs() < 1e-4 * want32.abs(),
        "{got32} vs {want32}"
    );
    // No labelled token: 0 (Hugging Face gives NaN).
    let none = Tensor::from_vec(vec![IGNORE_INDEX; 14], (2, 7), Device::Cpu).unwrap();
    let z = no_grad(|| m.loss(&ids, Some(&mask), Some(&types), &none))
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    assert_eq!(z, 0.0);
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let inp = inputs();
    let m = random_model(DType::F64);
    // Dropout on, with fixed masks (the same ForwardCtx for every evaluation).
    m.set_training(true);
    let (ids, mask, types, labels) = tensors(&inp);
    let ctx = ForwardCtx::new(5, 0);
    let loss = || ctx.scope(|| m.loss(&ids, Some(&mask), Some(&types), &labels));
    m.zero_grad();
    loss().unwrap().backward().unwrap();
    let params: HashMap<String, meshgrad_autograd::Var> =
        m.named_parameters().into_iter().collect();
    let picks = [
        ("bert.embeddings.word_embeddings.weight", 17 * 32 + 3),
        ("bert.embeddings.word_embeddings.weight", 12 * 32 + 5), // label only: via the decoder
        ("bert.embeddings.position_embeddings.weight", 2 * 32 + 7),
        ("bert.embeddings.token_type_embeddings.weight", 32 + 1),
        ("bert.embeddings.LayerNorm.bias", 4),
        (
            "bert.encoder.layer.0.attention.self.query.weight",
            5 * 32 + 9,
        ),
        ("bert.encoder.layer.0.attention.self.key.weight", 31 * 32),
        ("bert.encoder.layer.1.attention.self.value.bias", 30),
        ("bert.encoder.layer.1.attention.output.LayerNorm.weight", 11),
        (
            "bert.encoder.layer.0.intermediate.dense.weight",
            40 * 32 + 2,
        ),
        ("bert.encoder.layer.1.output.dense.bias", 8),
        ("cls.predictions.transform.dense.weight", 3 * 32 + 3),
        ("cls.predictions.transform.LayerNorm.weight", 6),
        ("cls.predictions.bias", 9),
    ];
    let eps = 1e-5;
    for (name, i) in picks {
        let p = &params[name];
        let g = p.grad().unwrap().to_vec_f64().unwrap()[i];
        let t = p.tensor();
        let orig = t.to_vec_f64().unwrap();
        let at = |x: f64| -> f64 {
            let mut v = orig.clone();
            v[i] = x;
            t.copy_from(&Tensor::from_vec(v, t.shape().clone(), Device::Cpu).unwrap())
                .unwrap();
            no_grad(loss).unwrap().tensor().item().unwrap()
        };
        let numeric = (at(orig[i] + eps) - at(orig[i] - eps)) / (2.0 * eps);
        at(orig[i]);
        assert!(
            (g - numeric).abs() <= 1e-7 + 1e-5 * numeric.abs(),
            "{name}[{i}]: analytic {g:e} vs numeric {numeric:e}"
        );
    }
}

#[test]
fn dropout_masks_follow_global_rows_and_checkpointing_replays_them() {
    let inp = inputs();
    let (ids, mask, types, labels) = tensors(&inp);
    let m = random_model(DType::F64);
    m.set_training(true);
    let whole = ForwardCtx::new(2, 0)
        .scope(|| no_grad(|| m.forward(&ids, Some(&mask), Some(&types))))
        .unwrap()
        .tensor()
        .to_vec_f64()
        .unwrap();
    let eval = model_logits(&random_model(DType::F64), &inp);
    assert!(max_abs_diff(&whole, &eval) > 1e-3, "dropout had no effect");
    // Row 1 on its own, as global row 1, sees the same masks.
    let row = |t: &Tensor| t.narrow(0, 1, 1).unwrap().contiguous().unwrap();
    let part = ForwardCtx::new(2, 1)
        .scope(|| no_grad(|| m.forward(&row(&ids), Some(&row(&mask)), Some(&row(&types)))))
        .unwrap()
        .tensor()
        .to_vec_f64()
        .unwrap();
    let v = small_config().vocab_size;
    assert!(max_abs_diff(&part, &whole[7 * v..]) < 1e-12);
    // Activation checkpointing: the same loss and gradients.
    let grads = |m: &BertForMaskedLM| -> (f64, Vec<Vec<f64>>) {
        m.zero_grad();
        let l = ForwardCtx::new(4, 0)
            .scope(|| m.loss(&ids, Some(&mask), Some(&types), &labels))
            .unwrap();
        l.backward().unwrap();
        let g = m
            .parameters()
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f64().unwrap())
            .collect();
        (l.tensor().item().unwrap(), g)
    };
    let (l0, g0) = grads(&m);
    let mut mc = random_model(DType::F64);
    mc.set_training(true);
    mc.activation_checkpointing = true;
    let (l1, g1) = grads(&mc);
    assert_eq!(l0, l1);
    for (a, b) in g0.iter().zip(&g1) {
        assert!(max_abs_diff(a, b) < 1e-12);
    }
}

// ----- checkpoints -----

/// Rewrites `dir/model.safetensors` with `f` applied to the list of (name, tensor).
fn rewrite(dir: &Path, f: impl FnOnce(Vec<(String, Tensor)>) -> Vec<(String, Tensor)>) {
    let path = dir.join("model.safetensors");
    let t = meshgrad_nn::state::load_safetensors(&path).unwrap();
    save_safetensors(&path, &f(t), None).unwrap();
}

#[test]
fn save_load_gives_identical_logits_with_and_without_prefix() {
    let inp = inputs();
    let m = random_model(DType::F32);
    let want = model_logits(&m, &inp);
    let dir = TempDir::new("roundtrip");
    save_bert(&m, dir.path()).unwrap();
    assert!(is_bert_checkpoint(dir.path()));
    // What is written: HF BertForMaskedLM names, no tied decoder, the format metadata.
    let (file, meta) =
        meshgrad_nn::state::load_safetensors_with_metadata(dir.path().join("model.safetensors"))
            .unwrap();
    assert_eq!(meta.unwrap()["format"], "pt");
    assert!(file
        .iter()
        .all(|(n, _)| n.starts_with("bert.") || n.starts_with("cls.predictions.")));
    assert!(!file.iter().any(|(n, _)| n.contains("decoder")));
    let cfg_text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
    assert_eq!(json["model_type"], "bert");
    assert_eq!(json["architectures"][0], "BertForMaskedLM");
    assert_eq!(json["hidden_act"], "gelu");
    assert_eq!(bert_config_from_hf_json(&cfg_text).unwrap(), small_config());

    let loaded = load_bert(dir.path(), DType::F32, Device::Cpu).unwrap();
    assert_eq!(model_logits(&loaded, &inp), want);

    // Without the `bert.` prefix (BertModel-style names), plus what HF files may also hold: the
    // position_ids / token_type_ids buffers, a pooler, the NSP head and the tied decoder.
    let word = file
        .iter()
        .find(|(n, _)| n == "bert.embeddings.word_embeddings.weight")
        .unwrap()
        .1
        .clone();
    let bias = file
        .iter()
        .find(|(n, _)| n == "cls.predictions.bias")
        .unwrap()
        .1
        .clone();
    rewrite(dir.path(), |t| {
        let mut t: Vec<(String, Tensor)> = t
            .into_iter()
            .map(|(n, x)| (n.strip_prefix("bert.").unwrap_or(&n).to_string(), x))
            .collect();
        let c = Device::Cpu;
        t.push((
            "embeddings.position_ids".into(),
            Tensor::arange(0, 16, DType::I64, c)
                .unwrap()
                .reshape((1, 16))
                .unwrap(),
        ));
        t.push((
            "embeddings.token_type_ids".into(),
            Tensor::zeros((1, 16), DType::I64, c).unwrap(),
        ));
        t.push((
            "pooler.dense.weight".into(),
            Tensor::zeros((32, 32), DType::F32, c).unwrap(),
        ));
        t.push((
            "pooler.dense.bias".into(),
            Tensor::zeros(32, DType::F32, c).unwrap(),
        ));
        t.push((
            "cls.seq_relationship.weight".into(),
            Tensor::zeros((2, 32), DType::F32, c).unwrap(),
        ));
        t.push(("cls.predictions.decoder.weight".into(), word.clone()));
        t.push(("cls.predictions.decoder.bias".into(), bias.clone()));
        t
    });
    let loaded = load_bert(dir.path(), DType::F32, Device::Cpu).unwrap();
    assert_eq!(model_logits(&loaded, &inp), want);
    // Loading converts the dtype.
    let l64 = load_bert(dir.path(), DType::F64, Device::Cpu).unwrap();
    let d = max_abs_diff(&model_logits(&l64, &inp), &want);
    assert!(d < 1e-4, "{d}");
}

#[test]
fn checkpoint_errors_name_the_tensor() {
    let m = random_model(DType::F32);
    let dir = TempDir::new("errors");
    let err = |dir: &Path| {
        load_bert(dir, DType::F32, Device::Cpu)
            .err()
            .unwrap()
            .to_string()
    };

    // Wrong shape: the tensor and both shapes.
    save_bert(&m, dir.path()).unwrap();
    rewrite(dir.path(), |t| {
        t.into_iter()
            .map(|(n, x)| {
                if n == "bert.encoder.layer.1.attention.self.key.weight" {
                    (n, Tensor::zeros((32, 31), DType::F32, Device::Cpu).unwrap())
                } else {
                    (n, x)
                }
            })
            .collect()
    });
    let e = err(dir.path());
    assert!(
        e.contains("bert.encoder.layer.1.attention.self.key.weight")
            && e.contains("[32, 31]")
            && e.contains("[32, 32]")
            && e.contains("model.safetensors"),
        "{e}"
    );

    // A missing head tensor; an unexpected tensor; the same tensor under both names.
    save_bert(&m, dir.path()).unwrap();
    rewrite(dir.path(), |t| {
        t.into_iter()
            .filter(|(n, _)| n != "cls.predictions.bias")
            .collect()
    });
    let e = err(dir.path());
    assert!(e.contains("missing tensor cls.predictions.bias"), "{e}");
    assert!(e.contains("bare BertModel"), "{e}");

    save_bert(&m, dir.path()).unwrap();
    rewrite(dir.path(), |mut t| {
        t.push((
            "bert.encoder.layer.2.output.dense.bias".into(),
            Tensor::zeros(32, DType::F32, Device::Cpu).unwrap(),
        ));
        t
    });
    let e = err(dir.path());
    assert!(
        e.contains("unexpected tensor bert.encoder.layer.2.output.dense.bias"),
        "{e}"
    );

    save_bert(&m, dir.path()).unwrap();
    rewrite(dir.path(), |mut t| {
        let (n, x) = t
            .iter()
            .find(|(n, _)| n.ends_with("embeddings.LayerNorm.bias"))
            .unwrap()
            .clone();
        t.push((n.strip_prefix("bert.").unwrap().to_string(), x));
        t
    });
    let e = err(dir.path());
    assert!(e.contains("appears twice"), "{e}");

    // An untied decoder.
    save_bert(&m, dir.path()).unwrap();
    rewrite(dir.path(), |mut t| {
        t.push((
            "cls.predictions.decoder.weight".into(),
            Tensor::zeros((50, 32), DType::F32, Device::Cpu).unwrap(),
        ));
        t
    });
    let e = err(dir.path());
    assert!(
        e.contains("cls.predictions.decoder.weight") && e.contains("untied"),
        "{e}"
    );

    // Config problems name the file and the key.
    save_bert(&m, dir.path()).unwrap();
    let cfg = dir.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("\"gelu\"", "\"relu\"")).unwrap();
    let e = err(dir.path());
    assert!(e.contains("config.json") && e.contains("hidden_act"), "{e}");
    std::fs::write(&cfg, text.replace("\"bert\"", "\"gpt2\"")).unwrap();
    let e = err(dir.path());
    assert!(e.contains("model_type"), "{e}");
    assert!(!is_bert_checkpoint(dir.path()));
}

// ----- MLM masking -----

#[test]
fn mlm_proportions_and_special_tokens() {
    let cfg = MlmConfig::byte_level();
    let (rows, t) = (512usize, 128usize);
    // Rows of [CLS] bytes... [SEP], some padded at the end.
    let mut ids = Vec::new();
    for r in 0..rows {
        let len = if r % 4 == 0 { 100 } else { t };
        for c in 0..t {
            ids.push(if c == 0 {
                byte_level::CLS
            } else if c == len - 1 {
                byte_level::SEP
            } else if c >= len {
                byte_level::PAD
            } else {
                ((r * 31 + c * 7) % 256) as u32
            });
        }
    }
    let (masked, labels) = mlm_mask_rows(&ids, t, 0, 3, 42, &cfg).unwrap();
    let (mut normal, mut selected, mut to_mask, mut to_random, mut kept) = (0, 0, 0, 0, 0);
    for i in 0..ids.len() {
        let special = ids[i] >= 256;
        if special {
            assert_eq!(labels[i], IGNORE_INDEX, "special token {} selected", ids[i]);
            assert_eq!(masked[i], ids[i]);
            continue;
        }
        normal += 1;
        if labels[i] == IGNORE_INDEX {
            assert_eq!(masked[i], ids[i]);
            continue;
        }
        selected += 1;
        assert_eq!(labels[i], ids[i] as i64);
        if masked[i] == byte_level::MASK {
            to_mask += 1;
        } else if masked[i] == ids[i] {
            kept += 1;
        } else {
            assert!(
                masked[i] < 256,
                "random replacement {} is special",
                masked[i]
            );
            to_random += 1;
        }
    }
    let frac = |a: usize, b: usize| a as f64 / b as f64;
    // ~60k normal tokens: 0.15 +- 0.005; ~9k selected: 0.8 +- 0.02, 0.1 +- 0.015 (a random
    // replacement equal to the original counts as kept: 1/256 of 10%).
    assert!(
        (frac(selected, normal) - 0.15).abs() < 0.005,
        "{}",
        frac(selected, normal)
    );
    assert!(
        (frac(to_mask, selected) - 0.8).abs() < 0.02,
        "{}",
        frac(to_mask, selected)
    );
    assert!(
        (frac(to_random, selected) - 0.1).abs() < 0.015,
        "{}",
        frac(to_random, selected)
    );
    assert!(
        (frac(kept, selected) - 0.1).abs() < 0.015,
        "{}",
        frac(kept, selected)
    );
}

#[test]
fn mlm_rows_are_the_same_under_any_split() {
    let cfg = MlmConfig::bert(40, SpecialTokens::after(40));
    let (rows, t) = (8usize, 24usize);
    let ids: Vec<u32> = values(9, rows * t)
        .iter()
        .map(|x| ((x + 1.0) * 20.0) as u32 % 40)
        .collect();
    let ids = Tensor::from_vec(ids, (rows, t), Device::Cpu).unwrap();
    let (wm, wl) = mlm_mask(&ids, 0, 7, 11, &cfg).unwrap();
    let (wm, wl) = (wm.to_vec::<u32>().unwrap(), wl.to_vec::<i64>().unwrap());
    assert!(wl.iter().any(|&l| l != IGNORE_INDEX));
    for split in [1usize, 3, 5] {
        let (a, b) = (
            ids.narrow(0, 0, split).unwrap(),
            ids.narrow(0, split, rows - split).unwrap(),
        );
        let (am, al) = mlm_mask(&a, 0, 7, 11, &cfg).unwrap();
        let (bm, bl) = mlm_mask(&b, split as u64, 7, 11, &cfg).unwrap();
        let mut m = am.to_vec::<u32>().unwrap();
        m.extend(bm.to_vec::<u32>().unwrap());
        let mut l = al.to_vec::<i64>().unwrap();
        l.extend(bl.to_vec::<i64>().unwrap());
        assert_eq!(m, wm, "split at {split}");
        assert_eq!(l, wl, "split at {split}");
    }
    // Another step or seed draws other masks.
    let (_, other_step) = mlm_mask(&ids, 0, 8, 11, &cfg).unwrap();
    assert_ne!(other_step.to_vec::<i64>().unwrap(), wl);
    let (_, other_seed) = mlm_mask(&ids, 0, 7, 12, &cfg).unwrap();
    assert_ne!(other_seed.to_vec::<i64>().unwrap(), wl);
}
