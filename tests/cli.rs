//! End-to-end tests of the `meshgrad` binary: train -> eval -> generate, and one-line errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_meshgrad"))
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Asserts a failed run: non-zero exit, a single `error:` line naming `needle`, no panic trace.
fn assert_one_line_error(o: &Output, needle: &str) {
    let (_, err) = text(o);
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

fn small_train(dir: &Path, extra: &[&str]) -> Output {
    let out = dir.join("ckpt");
    let metrics = dir.join("metrics.jsonl");
    let mut cmd = bin();
    cmd.args([
        "train",
        "--steps",
        "6",
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ])
    .args([
        "--set",
        "model.n_layer=1",
        "--set",
        "model.n_embd=32",
        "--set",
        "model.n_head=2",
    ])
    .args([
        "--set",
        "model.block_size=32",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.warmup_steps=2",
    ])
    .args([
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.sample_tokens=10",
    ])
    .args(extra);
    cmd.output().unwrap()
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
    let m = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
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
    let o = bin()
        .args([
            "eval",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("loss="))
        .expect("a loss= line");
    let loss: f64 = line["loss=".len()..].parse().unwrap();
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
    assert_one_line_error(&o, "stepz");
    // Bad value.
    let o = bin()
        .args(["train", "--set", "model.n_head=3"])
        .output()
        .unwrap();
    assert_one_line_error(&o, "n_head");
    let o = bin()
        .args(["train", "--set", "train.lr=fast"])
        .output()
        .unwrap();
    assert_one_line_error(&o, "train.lr");
    // Missing data file.
    let o = bin()
        .args(["train", "--data", "/nonexistent/meshgrad.txt"])
        .output()
        .unwrap();
    assert_one_line_error(&o, "/nonexistent/meshgrad.txt");
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
    assert_one_line_error(&o, "short.txt");
    // Missing checkpoint.
    let o = bin()
        .args([
            "eval",
            "--checkpoint",
            "/nonexistent/ckpt",
            "--data",
            short.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, "/nonexistent/ckpt");
}

#[test]
fn checkpoint_with_wrong_shape_is_named() {
    let dir = tmpdir("shape");
    let o = small_train(&dir, &["--set", "train.sample_tokens=0"]);
    assert!(o.status.success(), "{}", text(&o).1);
    let ckpt = dir.join("ckpt");
    // Claim a wider model in config.json: every tensor then has the wrong shape.
    let cfg_path = ckpt.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["n_embd"] = serde_json::json!(64);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let data = dir.join("d.txt");
    std::fs::write(&data, "x".repeat(200)).unwrap();
    let o = bin()
        .args([
            "eval",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, "wte.weight");
    let (_, err) = text(&o);
    assert!(
        err.contains("[256, 32]") && err.contains("[256, 64]"),
        "{err}"
    );
}
