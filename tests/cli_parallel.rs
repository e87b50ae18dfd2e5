//! `meshgrad train --layout`: data-parallel runs as threads give the single-device losses (same
//! global batch), with and without gradient accumulation; layouts compose (`dp=2,fsdp=2` is
//! `hsdp=2x2`); bad layouts (and `--sequence-parallel` without tensor parallelism) are refused in
//! one line.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, assert_ok, assert_one_line_error, metrics, tmpdir};

/// Trains a tiny model for 4 steps into `dir/<tag>`, returning the process output.
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
    ];
    common::train(dir, tag, 4, &sets, extra)
}

#[test]
fn data_parallel_losses_match_single_device() {
    let dir = tmpdir("par-lockstep");
    assert_ok(&train(&dir, "single", &[]));
    let single = metrics(&dir, "single");
    assert_eq!(single.len(), 4);
    for (tag, extra) in [
        ("dp2", &["--layout", "dp=2"][..]),
        ("dp2m2", &["--layout", "dp=2", "--microbatches", "2"][..]),
        ("m4", &["--microbatches", "4"][..]),
    ] {
        let o = train(&dir, tag, extra);
        assert_ok(&o);
        if tag.starts_with("dp") {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains("layout dp=2 (2 ranks x 4 rows"), "{out}");
        }
        assert_lockstep(tag, &metrics(&dir, tag), &single, false);
        assert!(dir.join(tag).join("model.safetensors").exists());
    }
}

#[test]
fn bad_layouts_are_refused_in_one_line() {
    let dir = tmpdir("par-bad");
    for (extra, needle) in [
        (
            &["--layout", "dp=3"][..],
            "8 rows does not split evenly over 3",
        ),
        (&["--layout", "dp=0"][..], "at least 1"),
        (&["--layout", "hsdp=2x0"][..], "at least 1"),
        (&["--layout", "pp=0"][..], "pp degree must be at least 1"),
        (
            &["--layout", "dp=3,fsdp=2"][..],
            "8 rows does not split evenly over 6 data-parallel ranks",
        ),
        (
            &["--layout", "tp=4"][..],
            "n_head = 2 is not divisible by tp = 4",
        ),
        (
            &["--layout", "fsdp=2,zero1=2"][..],
            "fsdp and zero1 conflict",
        ),
        (&["--layout", "dp=2,dp=2"][..], "dp is given twice"),
        (&["--layout", "hsdp=2x2,dp=2"][..], "hsdp and dp conflict"),
        (
            &["--sequence-parallel"][..],
            "--sequence-parallel needs tensor parallelism (tp>1 in --layout)",
        ),
        (
            &["--layout", "dp=2", "--sequence-parallel"][..],
            "--sequence-parallel needs tensor parallelism",
        ),
        (
            &["--layout", "zero2=3"][..],
            "8 rows does not split evenly over 3",
        ),
        (
            &["--layout", "hsdp=2x2", "--microbatches", "4"][..],
            "4 micro-batches",
        ),
        (
            &["--layout", "dp=2", "--microbatches", "3"][..],
            "3 micro-batches",
        ),
        (&["--microbatches", "0"][..], "at least 1"),
    ] {
        let o = train(&dir, "bad", extra);
        assert_one_line_error(&o, &[needle]);
        // Refused before any work: nothing written.
        assert!(
            !dir.join("bad.jsonl").exists(),
            "{extra:?} started training"
        );
    }
}

#[test]
fn composed_layout_equals_hybrid_sharding() {
    let dir = tmpdir("par-compose");
    let sets = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
    ];
    let o = common::train(&dir, "dp2fsdp2", 2, &sets, &["--layout", "dp=2,fsdp=2"]);
    assert_ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    // dp=2,fsdp=2 is hsdp=2x2 (4 ranks, each 2 of the 8 rows) and prints as such.
    assert!(out.contains("layout hsdp=2x2 (4 ranks x 2 rows"), "{out}");
    assert!(dir.join("dp2fsdp2").join("model.safetensors").exists());
    let o = common::train(&dir, "hsdp", 2, &sets, &["--layout", "hsdp=2x2"]);
    assert_ok(&o);
    let (a, b) = (metrics(&dir, "dp2fsdp2"), metrics(&dir, "hsdp"));
    assert_eq!(a.len(), 2);
    // The same layout: the same run, bit for bit.
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits());
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
    }
}
