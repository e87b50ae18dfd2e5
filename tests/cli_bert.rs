//! `meshgrad train --model bert` and `meshgrad eval` on BERT checkpoints: eval of a saved
//! checkpoint on a JSON-lines file equals the float64 reference loss; training lowers the MLM
//! loss; `--layout dp=2` and `--layout fsdp=2` (with and without micro-batches, dropout on) train
//! in lockstep with one device; bad eval lines are one-line errors naming the file and line.

#[path = "../nn/tests/bert_ref/mod.rs"]
mod bert_ref;

use crate::common;

use std::path::Path;
use std::process::Output;

use bert_ref::{RefConfig, Reference, Seq};
use common::{assert_lockstep, assert_ok, eval, last_loss, metrics, read_json, tmpdir};
use meshgrad::nn::bert::{BertConfig, BertForMaskedLM};
use meshgrad::nn::state::{load_state_dict, save_bert};
use meshgrad::nn::Module;
use meshgrad::tensor::{DType, Device, Tensor};

/// Deterministic pseudo-random values in [-1, 1).
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

#[test]
fn eval_matches_the_f64_reference_loss() {
    let dir = tmpdir("bert-eval");
    let cfg = BertConfig {
        vocab_size: 40,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 12,
        ..BertConfig::default()
    };
    let m = BertForMaskedLM::new(cfg, 5, DType::F32, Device::Cpu).unwrap();
    // Random values everywhere (biases and norms too).
    let sd: Vec<(String, Tensor)> = m
        .named_parameters()
        .into_iter()
        .enumerate()
        .map(|(i, (n, p))| {
            let v: Vec<f64> = values(i as u64, p.tensor().elem_count())
                .iter()
                .map(|x| {
                    if n.contains("LayerNorm.weight") {
                        1.0 + 0.2 * x
                    } else {
                        0.3 * x
                    }
                })
                .collect();
            (
                n,
                Tensor::from_vec(v, p.tensor().shape().clone(), Device::Cpu).unwrap(),
            )
        })
        .collect();
    load_state_dict(&m, &sd, true).unwrap();
    let ckpt = dir.join("ckpt");
    save_bert(&m, &ckpt).unwrap();

    // Lines of different lengths, with and without mask and token types, some padded.
    let seqs = vec![
        Seq {
            ids: vec![2, 11, 4, 39, 3],
            mask: vec![1.0; 5],
            types: vec![0; 5],
            labels: vec![-100, 11, -100, 7, -100],
        },
        Seq {
            ids: vec![2, 5, 6, 7, 3, 0, 0],
            mask: vec![1., 1., 1., 1., 1., 0., 0.],
            types: vec![0, 0, 0, 1, 1, 0, 0],
            labels: vec![-100, -100, 6, 30, -100, -100, -100],
        },
        Seq {
            ids: vec![2, 8, 9, 10, 11, 12, 13, 3],
            mask: vec![1.0; 8],
            types: vec![0, 0, 0, 0, 1, 1, 1, 1],
            labels: vec![-100, 8, -100, -100, -100, -100, 1, -100],
        },
        Seq {
            ids: vec![2, 20, 21, 3, 0],
            mask: vec![1., 1., 1., 1., 0.],
            types: vec![0; 5],
            labels: vec![-100, -100, 21, -100, -100],
        },
    ];
    let mut text = String::new();
    for (i, s) in seqs.iter().enumerate() {
        let mut obj = serde_json::json!({ "input_ids": s.ids, "labels": s.labels });
        if i != 0 {
            obj["attention_mask"] =
                serde_json::json!(s.mask.iter().map(|&x| x as u32).collect::<Vec<_>>());
        }
        if i != 3 {
            obj["token_type_ids"] = serde_json::json!(s.types);
        }
        text.push_str(&obj.to_string());
        text.push('\n');
    }
    text.push('\n'); // a trailing blank line is fine
    let data = dir.join("eval.jsonl");
    std::fs::write(&data, &text).unwrap();

    let o = eval(&ckpt, &data);
    assert_ok(&o);
    let got = last_loss(&o);
    let want = Reference::load(
        &ckpt,
        "bert.",
        RefConfig {
            hidden_size: 16,
            num_attention_heads: 2,
            num_hidden_layers: 2,
            vocab_size: 40,
            layer_norm_eps: cfg.layer_norm_eps,
        },
    )
    .loss(&seqs);
    assert!(
        (got - want).abs() <= 1e-4 * want.abs(),
        "eval loss {got} vs reference {want}"
    );

    // Bad lines: one-line errors naming the file and the line.
    for (bad, needle) in [
        (
            r#"{"input_ids": [1, 2], "labels": [1]}"#,
            "labels has 1 entries",
        ),
        (
            r#"{"input_ids": [1, 40], "labels": [-100, 1]}"#,
            "input_ids[1] = 40",
        ),
        (
            r#"{"input_ids": [1, 2], "labels": [-100, 1], "attention_mask": [1, 2]}"#,
            "attention_mask[1] = 2",
        ),
        (r#"{"input_ids": [1, 2]}"#, "missing labels"),
        (
            r#"{"input_ids": [1, 2], "labels": [-100, 1], "extra": 1}"#,
            "unknown key",
        ),
        ("not json", "invalid JSON"),
    ] {
        let f = dir.join("bad.jsonl");
        std::fs::write(&f, format!("{}\n{bad}\n", text.lines().next().unwrap())).unwrap();
        let o = eval(&ckpt, &f);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{bad}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(
            lines[0].starts_with("error: ")
                && lines[0].contains("bad.jsonl: line 2")
                && lines[0].contains(needle),
            "{bad}: {err}"
        );
    }
}

/// Trains a tiny BERT for `steps` steps into `dir/<tag>`.
fn train(dir: &Path, tag: &str, steps: usize, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
    ];
    common::train(
        dir,
        tag,
        steps,
        &sets,
        &[&["--model", "bert"], extra].concat(),
    )
}

#[test]
fn train_bert_lowers_the_mlm_loss_and_writes_a_bert_checkpoint() {
    let dir = tmpdir("bert-train");
    let o = train(&dir, "run", 20, &["--lr", "3e-3"]);
    assert_ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("BERT (masked LM, vocabulary 261)"), "{out}");
    let m = metrics(&dir, "run");
    assert_eq!(m.len(), 20);
    assert!(
        m.iter().all(|s| s.grad_norm.is_finite()),
        "grad_norm on every line"
    );
    let first: f64 = m[..3].iter().map(|x| x.loss).sum::<f64>() / 3.0;
    let last: f64 = m[17..].iter().map(|x| x.loss).sum::<f64>() / 3.0;
    assert!(
        (first - (261f64).ln()).abs() < 0.3,
        "initial loss {first} vs ln 261"
    );
    assert!(last < first - 0.5, "loss did not fall: {first} -> {last}");
    // The checkpoint is a Hugging Face BERT folder that `eval` reads.
    let ckpt = dir.join("run");
    let cfg = read_json(&ckpt.join("config.json"));
    assert_eq!(cfg["model_type"], "bert");
    assert_eq!(cfg["vocab_size"], 261);
    let data = dir.join("e.jsonl");
    // "[CLS] Elizabeth [SEP]" with one letter masked.
    let mut ids: Vec<i64> = vec![258];
    ids.extend("Elizabeth".bytes().map(|b| b as i64));
    ids.push(259);
    let mut labels = vec![-100i64; ids.len()];
    labels[5] = ids[5];
    ids[5] = 260;
    std::fs::write(
        &data,
        serde_json::json!({"input_ids": ids, "labels": labels}).to_string(),
    )
    .unwrap();
    let o = eval(&ckpt, &data);
    assert_ok(&o);
    assert!(last_loss(&o).is_finite());
}

#[test]
fn bert_trains_in_lockstep_under_dp_and_fsdp() {
    let dir = tmpdir("bert-lockstep");
    let common = ["--set", "model.dropout=0.1", "--lr", "1e-3"];
    let o = train(&dir, "single", 4, &common);
    assert_ok(&o);
    let single = metrics(&dir, "single");
    assert_eq!(single.len(), 4);
    for (tag, layout) in [
        ("dp2", &["--layout", "dp=2"][..]),
        ("fsdp2", &["--layout", "fsdp=2"][..]),
        (
            "fsdp2m2",
            &["--layout", "fsdp=2", "--microbatches", "2"][..],
        ),
    ] {
        let mut extra = common.to_vec();
        extra.extend_from_slice(layout);
        let o = train(&dir, tag, 4, &extra);
        assert_ok(&o);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains(&format!("layout {}", layout[1])),
            "{tag}: {out}"
        );
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
        assert!(dir.join(tag).join("model.safetensors").exists(), "{tag}");
    }
}
