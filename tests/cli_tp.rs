//! `meshgrad train --layout` with tensor parallelism: tp=2, tp=4, tp=2 with
//! `--sequence-parallel`, dp=2,tp=2, fsdp=2,tp=2 and hsdp=2x2,tp=2 (with and without sequence
//! parallelism) give the single-device losses on the same global batch (within 1e-5 relative, train and validation; gradient norms within
//! 1e-4), rank 0 writes a checkpoint gathered from the tensor-parallel ranks that holds the single
//! device's weights to rounding (1e-5 of each tensor's scale) and that `eval` reads. BERT
//! (byte-level vocabulary of 261 = 9 x 29 entries, so tp=3) trains in lockstep under tp=3 and
//! fsdp=2,tp=3 with sequence parallelism; with the vocabulary padded (`model.vocab_multiple`),
//! BERT and a GPT of 257 ids train under tp=2.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, assert_ok, assert_one_line_error, metrics, tmpdir};

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
            "vocabulary of 257 ids (model.vocab_size 257, model.vocab_multiple 1) does not split \
             over tp=2; pad it with --set model.vocab_multiple=2",
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
    let o = train_bert(
        &dir,
        "bad",
        &["--layout", "tp=2", "--set", "model.n_head=4"],
    );
    assert_one_line_error(
        &o,
        &[
            "vocabulary of 261 ids",
            "tp=2",
            "--set model.vocab_multiple=2",
        ],
    );
}

/// A padded vocabulary (`model.vocab_multiple`) lets tp=2 split BERT's 261 ids (as 262) and a
/// GPT's 257 (as 264): each trains in lockstep with the same padded model on one device, and
/// the padded model is what the single device trains and exports (its config says 264 ids).
#[test]
fn a_padded_vocabulary_splits_over_tp() {
    let dir = tmpdir("tp-padded");
    let bert = ["--set", "model.vocab_multiple=2", "--set", "model.n_head=4"];
    assert_ok(&train_bert(&dir, "bert_single", &bert));
    assert_ok(&train_bert(
        &dir,
        "bert_tp2",
        &[&bert[..], &["--layout", "tp=2"]].concat(),
    ));
    assert_lockstep(
        "bert_tp2",
        &metrics(&dir, "bert_tp2"),
        &metrics(&dir, "bert_single"),
        true,
    );
    let gpt = [
        "--set",
        "model.vocab_size=257",
        "--set",
        "model.vocab_multiple=8",
    ];
    assert_ok(&train(
        &dir,
        "gpt_single",
        &[&gpt[..], &["--save-every", "4"]].concat(),
    ));
    assert_ok(&train(
        &dir,
        "gpt_tp2",
        &[&gpt[..], &["--layout", "tp=2"]].concat(),
    ));
    assert_lockstep(
        "gpt_tp2",
        &metrics(&dir, "gpt_tp2"),
        &metrics(&dir, "gpt_single"),
        true,
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("gpt_single/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["vocab_size"], 264,
        "the exported model is the padded one"
    );
    // Generation never samples the 7 padded ids (hot sampling of a barely trained model would
    // hit them within a few hundred tokens otherwise), from the final model as from a training
    // checkpoint, and refuses them in a prompt.
    let generate = |ckpt: &Path, prompt: &str| {
        common::bin()
            .args(["generate", "--checkpoint", ckpt.to_str().unwrap()])
            .args(["--prompt-tokens", prompt, "--max-new-tokens", "400"])
            .args(["--temperature", "3", "--seed", "5"])
            .output()
            .unwrap()
    };
    for ckpt in [dir.join("gpt_single"), dir.join("gpt_single/checkpoints")] {
        let o = generate(&ckpt, "1,2,3");
        assert_ok(&o);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let ids: Vec<u32> = out
            .lines()
            .find_map(|l| l.strip_prefix("ids="))
            .expect("ids line")
            .split(',')
            .map(|i| i.parse().unwrap())
            .collect();
        assert_eq!(ids.len(), 400);
        assert!(ids.iter().all(|&i| i < 257), "{}: {ids:?}", ckpt.display());
        assert_one_line_error(&generate(&ckpt, "1,260"), &["260", "outside"]);
    }
}
