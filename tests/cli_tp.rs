//! `meshgrad train --layout` with tensor parallelism: tp=2, tp=4, tp=2 with
//! `--sequence-parallel`, dp=2,tp=2, fsdp=2,tp=2 and hsdp=2x2,tp=2 (with and without sequence
//! parallelism) give the single-device losses on the same global batch (within 1e-5 relative, train and validation; gradient norms within
//! 1e-4), rank 0 writes a checkpoint gathered from the tensor-parallel ranks that holds the single
//! device's weights to rounding (1e-5 of each tensor's scale) and that `eval` reads. BERT
//! (byte-level vocabulary of 261 = 9 x 29 entries, so tp=3) trains in lockstep under tp=3 and
//! fsdp=2,tp=3 with sequence parallelism.

mod common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, assert_one_line_error, metrics, tmpdir};

/// Trains a tiny model (4 heads, so tp=2 and tp=4 split them) for 4 steps into `dir/<tag>`.
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=32",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
        "train.min_lr=1e-4",
    ];
    common::train(dir, tag, 4, &sets, &[&["--lr", "1e-3"], extra].concat())
}

const LAYOUTS: [(&str, &[&str]); 7] = [
    ("tp2", &["--layout", "tp=2"]),
    ("tp4", &["--layout", "tp=4"]),
    ("tp2sp", &["--layout", "tp=2", "--sequence-parallel"]),
    ("dp2tp2", &["--layout", "dp=2,tp=2"]),
    ("fsdp2tp2", &["--layout", "fsdp=2,tp=2"]),
    ("hsdp2x2tp2", &["--layout", "hsdp=2x2,tp=2"]),
    (
        "hsdp2x2tp2sp",
        &["--layout", "hsdp=2x2,tp=2", "--sequence-parallel"],
    ),
];

#[test]
fn tensor_parallel_layouts_match_single_device() {
    let dir = tmpdir("tp-lockstep");
    let o = train(&dir, "single", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let single = metrics(&dir, "single");
    assert_eq!(single.len(), 4);
    for (tag, extra) in LAYOUTS {
        let o = train(&dir, tag, extra);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            out.contains(&format!("layout {}", extra[1])),
            "{tag}: {out}"
        );
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
    }
    // The checkpoints gathered from the tensor-parallel ranks hold the single device's weights.
    let tags: Vec<&str> = LAYOUTS.iter().map(|(t, _)| *t).collect();
    common::assert_checkpoints_match(&dir, &tags, "single");
    // `eval` reads a checkpoint written by a tensor-parallel run.
    let data = dir.join("eval.txt");
    std::fs::write(
        &data,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let a = common::eval(&dir.join("fsdp2tp2"), &data);
    let b = common::eval(&dir.join("single"), &data);
    let (la, lb) = (common::loss_line(&a), common::loss_line(&b));
    assert!((la - lb).abs() <= 1e-4 * lb.abs(), "eval loss {la} vs {lb}");
}

#[test]
fn sizes_that_do_not_split_over_tp_are_refused() {
    let dir = tmpdir("tp-bad");
    for (extra, needle) in [
        (
            &["--layout", "tp=3"][..],
            "n_head = 4 is not divisible by tp = 3",
        ),
        (
            &["--layout", "tp=2", "--set", "model.vocab_size=257"][..],
            "vocab_size = 257 is not divisible by tp = 2",
        ),
        (
            &[
                "--layout",
                "tp=4",
                "--sequence-parallel",
                "--set",
                "model.block_size=30",
            ][..],
            "sequence length 30 is not divisible by tp = 4",
        ),
    ] {
        let o = train(&dir, "bad", extra);
        assert_one_line_error(&o, &[needle]);
    }
}

/// Trains a tiny BERT (3 heads of 16, sequence 33) for 4 steps into `dir/<tag>`.
fn train_bert(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=2",
        "model.n_embd=48",
        "model.n_head=3",
        "model.block_size=33",
        "train.batch_size=4",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
    ];
    common::train(
        dir,
        tag,
        4,
        &sets,
        &[&["--model", "bert", "--lr", "1e-3"], extra].concat(),
    )
}

#[test]
fn bert_trains_in_lockstep_under_tensor_parallelism() {
    let dir = tmpdir("tp-bert");
    let o = train_bert(&dir, "single", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let single = metrics(&dir, "single");
    for (tag, extra) in [
        ("tp3", &["--layout", "tp=3"][..]),
        (
            "fsdp2tp3sp",
            &["--layout", "fsdp=2,tp=3", "--sequence-parallel"][..],
        ),
    ] {
        let o = train_bert(&dir, tag, extra);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
        assert!(dir.join(tag).join("model.safetensors").exists(), "{tag}");
    }
    let o = train_bert(&dir, "bad", &["--layout", "tp=2"]);
    assert_one_line_error(&o, &["261 entries", "tp=2 does not divide"]);
}
