//! `meshgrad train --layout`: data-parallel runs as threads give the single-device losses (same
//! global batch), with and without gradient accumulation; bad layouts are refused in one line.

mod common;

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
        (&["--layout", "pp=2"][..], "unknown strategy 'pp'"),
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
