//! `meshgrad train --layout`: data-parallel runs as threads give the single-device losses (same
//! global batch), with and without gradient accumulation; bad layouts are refused in one line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_meshgrad"))
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-cli-par-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Trains a tiny model for 4 steps into `dir/<tag>`, returning the process output.
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let out = dir.join(tag);
    let metrics = dir.join(format!("{tag}.jsonl"));
    bin()
        .args(["train", "--steps", "4", "--out", out.to_str().unwrap()])
        .args(["--metrics", metrics.to_str().unwrap()])
        .args(["--set", "model.n_layer=1", "--set", "model.n_embd=32"])
        .args(["--set", "model.n_head=2", "--set", "model.block_size=32"])
        .args([
            "--set",
            "train.batch_size=8",
            "--set",
            "train.warmup_steps=2",
        ])
        .args([
            "--set",
            "train.eval_batches=1",
            "--set",
            "train.eval_interval=2",
        ])
        .args(["--set", "train.sample_tokens=0"])
        .args(extra)
        .output()
        .unwrap()
}

/// (loss, val_loss if present) per metrics line.
fn metrics(dir: &Path, tag: &str) -> Vec<(f64, Option<f64>)> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["loss"].as_f64().unwrap(), v["val_loss"].as_f64())
        })
        .collect()
}

fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

#[test]
fn data_parallel_losses_match_single_device() {
    let dir = tmpdir("lockstep");
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
        let got = metrics(&dir, tag);
        assert_eq!(got.len(), single.len(), "{tag}: one metrics line per step");
        for (step, ((a, va), (b, vb))) in got.iter().zip(&single).enumerate() {
            assert!(rel(*a, *b) <= 1e-5, "{tag} step {step}: loss {a} vs {b}");
            assert_eq!(va.is_some(), vb.is_some());
            if let (Some(va), Some(vb)) = (va, vb) {
                assert!(rel(*va, *vb) <= 1e-5, "{tag} step {step}: val {va} vs {vb}");
            }
        }
        assert!(dir.join(tag).join("model.safetensors").exists());
    }
}

/// A failed run: non-zero exit and a single `error:` line containing `needle`, no panic.
fn assert_one_line_error(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected failure, stderr: {err}");
    assert!(
        !err.contains("panicked"),
        "panic instead of an error: {err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{err}"
    );
}

#[test]
fn bad_layouts_are_refused_in_one_line() {
    let dir = tmpdir("bad");
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
        assert_one_line_error(&o, needle);
        // Refused before any work: nothing written.
        assert!(
            !dir.join("bad.jsonl").exists(),
            "{extra:?} started training"
        );
    }
}
