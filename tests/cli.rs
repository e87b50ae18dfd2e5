//! End-to-end tests of the `meshgrad` binary: train -> eval -> generate, and one-line errors.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_one_line_error, bin, eval, loss_line, read_json, text, tmpdir};

/// Trains a tiny model for 6 steps into `dir/ckpt` (metrics in `dir/ckpt.jsonl`).
fn small_train(dir: &Path, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=4",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.sample_tokens=10",
    ];
    common::train(dir, "ckpt", 6, &sets, extra)
}

#[test]
fn train_eval_generate_round_trip() {
    let dir = tmpdir("roundtrip");
    let o = small_train(&dir, &[]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "train failed: {out}\n{err}");
    assert!(out.contains("val_loss"), "{out}");
    let ckpt = dir.join("ckpt");
    for f in ["config.json", "model.safetensors", "meshgrad.toml"] {
        assert!(ckpt.join(f).exists(), "missing {f}");
    }
    // Metrics: one JSON object per step with the required keys.
    let m = std::fs::read_to_string(dir.join("ckpt.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = m
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"].as_u64(), Some(i as u64 + 1));
        for k in ["loss", "lr", "tokens_per_s"] {
            assert!(l[k].as_f64().is_some(), "missing {k} in {l}");
        }
    }

    // Eval over a text file: a value, printed as loss=<value>.
    let data = dir.join("eval.txt");
    std::fs::write(&data, "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. ".repeat(3)).unwrap();
    let o = eval(&ckpt, &data);
    assert!(o.status.success(), "{}", text(&o).1);
    let loss = loss_line(&o);
    assert!(loss.is_finite() && loss > 0.0 && loss < 6.0, "{loss}");

    // Greedy generation is deterministic and prints ids.
    let gen = |seed: &str| {
        let o = bin()
            .args([
                "generate",
                "--checkpoint",
                ckpt.to_str().unwrap(),
                "--prompt",
                "Elizabeth",
                "--max-new-tokens",
                "12",
            ])
            .args(["--temperature", "0", "--seed", seed])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o).1);
        text(&o).0
    };
    let a = gen("1");
    assert_eq!(a, gen("2"));
    let ids = a.lines().find(|l| l.starts_with("ids=")).expect("ids line");
    assert_eq!(ids["ids=".len()..].split(',').count(), 12);

    // Prompt as ids too.
    let o = bin()
        .args([
            "generate",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--prompt-tokens",
            "69,108,105",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
}

#[test]
fn bad_inputs_give_one_line_errors() {
    let dir = tmpdir("errors");
    // Unknown config key in a file.
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, "[train]\nstepz = 5\n").unwrap();
    let o = bin()
        .args(["train", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["stepz"]);
    // Bad value.
    let o = bin()
        .args(["train", "--set", "model.n_head=3"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["n_head"]);
    let o = bin()
        .args(["train", "--set", "train.lr=fast"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["train.lr"]);
    // Missing data file.
    let o = bin()
        .args(["train", "--data", "/nonexistent/meshgrad.txt"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["/nonexistent/meshgrad.txt"]);
    // Data file too short for one window.
    let short = dir.join("short.txt");
    std::fs::write(&short, "tiny").unwrap();
    let o = bin()
        .args([
            "train",
            "--data",
            short.to_str().unwrap(),
            "--steps",
            "1",
            "--set",
            "train.warmup_steps=0",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["short.txt"]);
    // Missing checkpoint.
    let o = eval(Path::new("/nonexistent/ckpt"), &short);
    assert_one_line_error(&o, &["/nonexistent/ckpt"]);
}

#[test]
fn checkpoint_with_wrong_shape_is_named() {
    let dir = tmpdir("shape");
    let o = small_train(&dir, &["--set", "train.sample_tokens=0"]);
    assert!(o.status.success(), "{}", text(&o).1);
    let ckpt = dir.join("ckpt");
    // Claim a wider model in config.json: every tensor then has the wrong shape.
    let cfg_path = ckpt.join("config.json");
    let mut cfg = read_json(&cfg_path);
    cfg["n_embd"] = serde_json::json!(64);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let data = dir.join("d.txt");
    std::fs::write(&data, "x".repeat(200)).unwrap();
    let o = eval(&ckpt, &data);
    assert_one_line_error(&o, &["wte.weight"]);
    let (_, err) = text(&o);
    assert!(
        err.contains("[256, 32]") && err.contains("[256, 64]"),
        "{err}"
    );
}

#[test]
fn a_run_shorter_than_the_warmup_warms_up_over_all_its_steps() {
    // Default warmup is 30 steps; 4 steps must train (GPT and BERT), warming up over the 4.
    let dir = tmpdir("short-warmup");
    let sets = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=16",
        "train.batch_size=2",
        "train.eval_batches=1",
        "train.sample_tokens=0",
    ];
    for (tag, extra) in [("gpt", vec![]), ("bert", vec!["--model", "bert"])] {
        let o = common::train(&dir, tag, 4, &sets, &extra);
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "{tag}: {stdout}\n{stderr}");
        let lrs: Vec<f64> = std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        assert_eq!(lrs.len(), 4, "{tag}");
        // Linear warmup to the peak (3e-3) at the last step: lr rises every step.
        assert!(lrs.windows(2).all(|w| w[1] > w[0]), "{tag}: {lrs:?}");
        assert!(lrs[3] <= 3e-3 + 1e-12, "{tag}: {lrs:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
