//! Checks before work and bad input, through the `meshgrad` binary: one test per class, each
//! failing case a one-line error with a non-zero exit, before any training step (issue 11,
//! "checks before work"):
//!
//! * config values: integers the saved TOML cannot hold, ranges, negative numbers on the command
//!   line;
//! * output: an `--out` or `--metrics` that cannot be written is refused before the data is read;
//! * memory: sizes that cannot fit (or whose product overflows) are refused before allocating,
//!   in training and when loading a checkpoint; the default run passes (and, with `--steps 5`,
//!   is shorter than the default warm-up);
//! * generate: sampling arguments, streamed output with `ids=` last, NaN logits;
//! * training: divergence stops the run, and metrics lines are on disk as soon as they are
//!   written (a `kill -9` loses none).

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, assert_one_line_error, bin, eval, text, tmpdir};

/// The sets of a tiny, fast GPT.
const TINY: [&str; 7] = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "train.batch_size=2",
    "train.eval_batches=1",
    "train.sample_tokens=0",
];

/// `meshgrad train --out <dir>/out --set ...(TINY) <args>` (no `--out` of its own when `args`
/// has one).
fn train(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = bin();
    cmd.arg("train");
    if !args.contains(&"--out") {
        cmd.arg("--out").arg(dir.join("out"));
    }
    for s in TINY {
        cmd.args(["--set", s]);
    }
    cmd.args(args);
    cmd
}

fn run(mut cmd: Command) -> Output {
    cmd.output().unwrap()
}

/// Asserts a one-line error from a run that stopped before any work: nothing on stdout (the
/// header and the first validation come after the checks).
fn assert_refused_before_work(o: &Output, needles: &[&str]) {
    assert_one_line_error(o, needles);
    let (out, _) = text(o);
    assert!(out.is_empty(), "work was done before the error: {out}");
}

#[test]
fn config_values_are_checked_before_training() {
    let dir = tmpdir("checks-config");
    // A seed the config file cannot hold (TOML integers are signed 64-bit): refused up front,
    // not after training when the config is saved.
    let o = run(train(
        &dir,
        &["--seed", "9223372036854775808", "--steps", "1"],
    ));
    assert_refused_before_work(
        &o,
        &["train.seed", "9223372036854775808", "9223372036854775807"],
    );
    assert!(!dir.join("out").exists(), "nothing is created");
    let o = run(train(
        &dir,
        &["--set", "train.warmup_steps=18446744073709551615"],
    ));
    assert_refused_before_work(&o, &["train.warmup_steps", "too large"]);
    // Negative numbers reach the config's checks (not a usage error); AdamW's decay factor
    // 1 - lr * weight_decay must stay positive.
    let o = run(train(&dir, &["--lr", "-1"]));
    assert_refused_before_work(&o, &["train.lr", "> 0", "-1"]);
    let o = run(train(&dir, &["--lr", "1e30"]));
    assert_refused_before_work(&o, &["train.weight_decay", "lr = 1e30", ">= 1"]);
    let o = run(train(&dir, &["--set", "model.dropout=-0.1"]));
    assert_refused_before_work(&o, &["model.dropout", "[0, 1)"]);
    let o = run(train(&dir, &["--set", "train.beta2=NaN"]));
    assert_refused_before_work(&o, &["train.beta2"]);
    let o = run(train(&dir, &["--set", "model.n_embd=0"]));
    assert_refused_before_work(&o, &["model.n_embd", "at least 1"]);
    // BERT rows need [CLS], a token and [SEP].
    let o = run(train(
        &dir,
        &["--model", "bert", "--set", "model.block_size=2"],
    ));
    assert_refused_before_work(&o, &["model.block_size", "at least 3"]);
    // A config file's value, too.
    let cfg = dir.join("big.toml");
    std::fs::write(&cfg, "[train]\nseed = 9223372036854775808\n").unwrap();
    let o = run(train(&dir, &["--config", cfg.to_str().unwrap()]));
    assert_refused_before_work(&o, &["big.toml", "train.seed"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn outputs_that_cannot_be_written_are_refused_before_work() {
    let dir = tmpdir("checks-output");
    // A regular file where a directory must go (refused even for root, unlike permissions).
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let out = file.join("run");
    let o = run(train(
        &dir,
        &["--out", out.to_str().unwrap(), "--steps", "1"],
    ));
    assert_refused_before_work(&o, &["output directory", out.to_str().unwrap(), "--out"]);
    let o = run(train(
        &dir,
        &["--out", file.to_str().unwrap(), "--steps", "1"],
    ));
    assert_refused_before_work(&o, &["output directory", file.to_str().unwrap()]);
    // The metrics file: its directory under a file, or a directory itself.
    let metrics = file.join("m.jsonl");
    let o = run(train(
        &dir,
        &["--metrics", metrics.to_str().unwrap(), "--steps", "1"],
    ));
    assert_refused_before_work(&o, &["metrics", file.to_str().unwrap()]);
    let o = run(train(
        &dir,
        &["--metrics", dir.to_str().unwrap(), "--steps", "1"],
    ));
    assert_refused_before_work(&o, &["metrics file", "is a directory"]);
    // Parallel layouts and BERT check the same, before starting their ranks.
    for extra in [["--layout", "dp=2"], ["--model", "bert"]] {
        let mut args = vec!["--out", file.to_str().unwrap(), "--steps", "1"];
        args.extend(extra);
        let o = run(train(&dir, &args));
        assert_refused_before_work(&o, &["output directory", file.to_str().unwrap()]);
    }
    // The probe leaves nothing behind in a writable directory.
    let ok = dir.join("ok");
    let o = run(train(
        &dir,
        &[
            "--out",
            ok.to_str().unwrap(),
            "--steps",
            "1",
            "--data",
            "/nonexistent/data.txt",
        ],
    ));
    assert_refused_before_work(&o, &["/nonexistent/data.txt"]);
    assert_eq!(std::fs::read_dir(&ok).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn memory_is_checked_before_allocating() {
    let dir = tmpdir("checks-memory");
    let started = Instant::now();
    // Each of these used to panic ("capacity overflow"), abort on a failed allocation or grow
    // for minutes.
    let cases: &[&[&str]] = &[
        &["--set", "model.n_embd=1000000", "--set", "model.n_head=1"],
        &["--set", "model.n_layer=100000000"],
        &["--set", "train.batch_size=100000000"],
        &["--set", "model.vocab_size=100000000000"],
        &["--set", "model.n_embd=1000000", "--layout", "fsdp=2"],
        &[
            "--set",
            "model.n_embd=1000000",
            "--set",
            "model.n_layer=2",
            "--layout",
            "pp=2",
        ],
        &["--set", "model.n_embd=1000000", "--model", "bert"],
    ];
    for args in cases {
        let mut args = args.to_vec();
        args.extend(["--steps", "1"]);
        let o = run(train(&dir, &args));
        if cfg!(target_os = "linux") {
            assert_refused_before_work(
                &o,
                &[
                    "not enough memory for this run: it needs about",
                    "is available",
                ],
            );
        } else {
            assert!(!o.status.success());
        }
    }
    // Sizes whose product overflows 64 bits are refused on any machine.
    let o = run(train(
        &dir,
        &[
            "--set",
            "model.n_layer=1000000000000000000",
            "--set",
            "model.n_embd=1000000",
            "--set",
            "model.n_head=1",
        ],
    ));
    assert_refused_before_work(&o, &["not enough memory", "more than 16 EiB"]);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the refusals are fast: {:?}",
        started.elapsed()
    );

    // The default run passes, even with fewer steps than the default warm-up (30).
    let o = bin()
        .args(["train", "--steps", "5", "--out"])
        .arg(dir.join("default"))
        .args([
            "--set",
            "train.eval_batches=1",
            "--set",
            "train.sample_tokens=0",
        ])
        .output()
        .unwrap();
    assert_ok(&o);

    // A checkpoint whose config.json claims a huge model: refused before it is built.
    let o = run(train(&dir, &["--steps", "1"]));
    assert_ok(&o);
    let ckpt = dir.join("out");
    let cfg_path = ckpt.join("config.json");
    let mut cfg = common::read_json(&cfg_path);
    cfg["n_embd"] = serde_json::json!(100_000_000);
    cfg["n_head"] = serde_json::json!(1);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let data = dir.join("d.txt");
    std::fs::write(&data, "x".repeat(100)).unwrap();
    let needles = ["not enough memory for checkpoint", ckpt.to_str().unwrap()];
    if cfg!(target_os = "linux") {
        assert_one_line_error(&eval(&ckpt, &data), &needles);
        let o = bin()
            .args(["generate", "--prompt", "a", "--checkpoint"])
            .arg(&ckpt)
            .output()
            .unwrap();
        assert_one_line_error(&o, &needles);
    }
    // A negative layer-norm epsilon in config.json: refused, naming the key.
    cfg["n_embd"] = serde_json::json!(32);
    cfg["n_head"] = serde_json::json!(2);
    cfg["layer_norm_epsilon"] = serde_json::json!(-1e-5);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert_one_line_error(&eval(&ckpt, &data), &["layer_norm_epsilon", "positive"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn generate_checks_its_arguments_streams_and_stops_on_nan() {
    let dir = tmpdir("checks-generate");
    let o = run(train(&dir, &["--steps", "1"]));
    assert_ok(&o);
    let ckpt = dir.join("out");
    let generate = |args: &[&str]| {
        bin()
            .args(["generate", "--prompt", "It"])
            .arg("--checkpoint")
            .arg(&ckpt)
            .args(args)
            .output()
            .unwrap()
    };
    for (args, needles) in [
        (
            &["--temperature", "-1"][..],
            &["--temperature", "finite number >= 0", "-1"][..],
        ),
        (&["--temperature", "NaN"], &["--temperature", "NaN"]),
        (&["--temperature", "inf"], &["--temperature", "inf"]),
        (&["--top-k", "0"], &["--top-k", "at least 1"]),
        (
            &["--max-new-tokens", "0"],
            &["--max-new-tokens", "at least 1"],
        ),
    ] {
        let o = generate(args);
        assert_one_line_error(&o, needles);
        assert!(text(&o).0.is_empty(), "{args:?}");
    }

    // The text, then `ids=` last; the text is the ids' bytes (byte-level model).
    let o = generate(&["--max-new-tokens", "20", "--temperature", "0"]);
    assert_ok(&o);
    let (out, _) = text(&o);
    let last = out.lines().last().unwrap();
    let ids: Vec<u32> = last
        .strip_prefix("ids=")
        .unwrap()
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 20);
    let body = meshgrad::generate::detokenize(&ids);
    assert_eq!(out, format!("{body}\n{last}\n"));

    // Streaming: the first text arrives while the process is still generating.
    let mut child = bin()
        .args(["generate", "--prompt", "It", "--temperature", "0"])
        .args(["--max-new-tokens", "1000000", "--checkpoint"])
        .arg(&ckpt)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut first = [0u8; 8];
        // The pipe goes back with the bytes: dropping it here would end the child (EPIPE)
        // before it is asked whether it still runs.
        let r = stdout.read_exact(&mut first).map(|()| first);
        tx.send((r, stdout)).ok();
    });
    let first = rx.recv_timeout(Duration::from_secs(30));
    let running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(running, "the process should still be generating");
    assert!(
        matches!(first, Ok((Ok(_), _))),
        "no text within 30 s: {:?}",
        first.map(|(r, _)| r)
    );

    // NaN weights: the logits are NaN at the first step.
    let model = meshgrad::train::load_checkpoint(&ckpt).unwrap();
    let nan =
        meshgrad::tensor::Tensor::from_vec(vec![f32::NAN; 32], 32, meshgrad::tensor::Device::Cpu)
            .unwrap();
    meshgrad::nn::state::load_state_dict(&model, &[("ln_f.weight".to_string(), nan)], false)
        .unwrap();
    let bad = dir.join("nan");
    meshgrad::nn::state::hf_gpt2::save_gpt2(&model, &bad).unwrap();
    let o = bin()
        .args(["generate", "--prompt", "It", "--max-new-tokens", "5"])
        .arg("--checkpoint")
        .arg(&bad)
        .output()
        .unwrap();
    assert_one_line_error(&o, &["logits are not finite", "step 1 of 5"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn divergence_stops_training_and_metrics_survive_a_kill() {
    let dir = tmpdir("checks-training");
    // A learning rate that blows the weights up (without weight decay, which would refuse it):
    // the second step's loss is NaN, on one device and on every kind of layout (the loop is
    // shared).
    for extra in [
        &[][..],
        &["--layout", "dp=2"],
        &["--layout", "fsdp=2"],
        &["--layout", "tp=2"],
        &["--layout", "pp=2"],
        &["--model", "bert"],
    ] {
        let mut args = vec!["--lr", "1e30", "--steps", "5", "--set", "model.n_layer=2"];
        args.extend(["--set", "train.weight_decay=0"]);
        args.extend(extra);
        let o = run(train(&dir, &args));
        assert_one_line_error(&o, &["training diverged", "NaN", "at step 2"]);
    }

    // Metrics lines are flushed as they are written: kill -9 once the log shows step 3, and the
    // file holds at least those three steps (a buffered file would still be empty).
    let metrics = dir.join("m.jsonl");
    let mut child = train(
        &dir,
        &[
            "--steps",
            "100000",
            "--metrics",
            metrics.to_str().unwrap(),
            "--set",
            "train.log_interval=1",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    for line in stdout.lines() {
        if line.unwrap().trim_start().starts_with("step     3/") {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let lines = std::fs::read_to_string(&metrics).unwrap();
    let steps: Vec<u64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(steps.len() >= 3, "{lines}");
    assert_eq!(steps[..3], [1, 2, 3]);
    std::fs::remove_dir_all(&dir).ok();
}
