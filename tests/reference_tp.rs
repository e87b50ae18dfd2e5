//! Reference mode (`--reference`) under tensor parallelism: tp=2, tp=4, tp=2 with
//! `--sequence-parallel`, dp=2,tp=2 and fsdp=2,tp=2 train a tiny GPT (with dropout) to the
//! single-device reference run's bits: every loss, validation loss and gradient norm of the
//! metrics (as written) and every weight of the final checkpoint. So does a tiny BERT (its
//! vocabulary padded) under tp=2, tp=4 and tp=2 with sequence parallelism, dp=2,tp=2,
//! fsdp=2,tp=2 with sequence parallelism and tp=2,pp=2. A degree that does not divide the
//! model's reference chunks is refused in one line.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_ok, assert_one_line_error, tmpdir};

/// Trains the tiny reference-mode GPT for 10 steps into `dir/<tag>` (4 heads, vocabulary 256 and
/// 16 positions: 4 reference chunks).
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=2",
        "model.n_head=4",
        "model.n_embd=32",
        "model.block_size=16",
        "model.vocab_size=256",
        "model.dropout=0.1",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "train.eval_interval=5",
        "train.eval_batches=1",
        "train.sample_tokens=0",
    ];
    common::train(dir, tag, 10, &sets, &[&["--reference"], extra].concat())
}

/// The loss, val_loss and grad_norm fields of every metrics line of `dir/<tag>`, as written.
fn numbers(dir: &Path, tag: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            ["step", "loss", "val_loss", "grad_norm"]
                .iter()
                .map(|k| format!("{k}={}", v[k]))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

const LAYOUTS: [(&str, &[&str]); 5] = [
    ("tp2", &["--layout", "tp=2"]),
    ("tp4", &["--layout", "tp=4"]),
    ("tp2sp", &["--layout", "tp=2", "--sequence-parallel"]),
    ("dp2tp2", &["--layout", "dp=2,tp=2"]),
    ("fsdp2tp2", &["--layout", "fsdp=2,tp=2"]),
];

/// Trains each of `layouts` with `train` and checks that it equals the run `single` bit for bit:
/// metrics strings and every weight of the final checkpoint.
fn assert_bit_identical(
    dir: &Path,
    train: impl Fn(&Path, &str, &[&str]) -> Output,
    layouts: &[(&str, &[&str])],
) {
    assert_ok(&train(dir, "single", &[]));
    let want = numbers(dir, "single");
    assert_eq!(want.len(), 10);
    assert!(want.iter().all(|l| !l.contains("grad_norm=null")));
    assert!(want.iter().any(|l| !l.contains("val_loss=null")));
    let weights = |tag: &str| std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    let want_weights = weights("single");
    for (tag, extra) in layouts {
        assert_ok(&train(dir, tag, extra));
        assert_eq!(numbers(dir, tag), want, "{tag}: metrics");
        assert!(
            weights(tag) == want_weights,
            "{tag}: the weights differ from the single-device run's"
        );
    }
}

#[test]
fn tensor_parallel_reference_runs_are_bit_identical_to_one_device() {
    assert_bit_identical(&tmpdir("reference-tp"), train, &LAYOUTS);
}

/// Trains the tiny reference-mode BERT for 10 steps into `dir/<tag>`: its byte-level
/// vocabulary of 261 padded to 264 (`model.vocab_multiple=8`), 4 heads, intermediate width 128
/// and 16 positions give 4 reference chunks.
fn train_bert(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    train(
        dir,
        tag,
        &[
            &["--model", "bert", "--set", "model.vocab_multiple=8"],
            extra,
        ]
        .concat(),
    )
}

#[test]
fn bert_tensor_parallel_reference_runs_are_bit_identical_to_one_device() {
    let layouts: [(&str, &[&str]); 6] = [
        ("tp2", &["--layout", "tp=2"]),
        ("tp4sp", &["--layout", "tp=4", "--sequence-parallel"]),
        ("tp2sp", &["--layout", "tp=2", "--sequence-parallel"]),
        ("dp2tp2", &["--layout", "dp=2,tp=2"]),
        (
            "fsdp2tp2sp",
            &["--layout", "fsdp=2,tp=2", "--sequence-parallel"],
        ),
        ("tp2pp2", &["--layout", "tp=2,pp=2", "--schedule", "1f1b"]),
    ];
    assert_bit_identical(&tmpdir("reference-tp-bert"), train_bert, &layouts);
}

#[test]
fn a_degree_that_does_not_divide_the_reference_chunks_is_refused() {
    let dir = tmpdir("reference-tp-refused");
    // 4 heads: 4 reference chunks, which tp=8 does not divide.
    let o = train(&dir, "tp8", &["--layout", "tp=8"]);
    assert_one_line_error(&o, &["reference mode", "tp = 8", "4 reference chunk"]);
}
