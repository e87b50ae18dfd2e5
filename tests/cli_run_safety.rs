//! Runs that cannot be lost: sizes bounded before anything is allocated, no destruction before
//! the checks, one writer per folder, `latest` naming the newest state, atomic files, failing
//! fast instead of waiting, and the wrong answers found by trying the CLI as a user would. One
//! test per class, each with the example that exposed it.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

/// A tiny, fast GPT run.
const TINY: [&str; 5] = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "train.sample_tokens=0",
    "train.eval_batches=1",
];

/// Every file under `dir` (relative name, bytes), sorted.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let name = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((name, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn sizes_from_flags_are_bounded_before_anything_is_allocated() {
    let o = bin()
        .args(["schedule", "--kind", "gpipe", "--stages", "100000"])
        .args(["--microbatches", "100000"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["100000 stages x 100000 microbatches", "too large"]);
    // Printable schedules still print; large ones print their summary without the grid.
    let o = bin()
        .args(["schedule", "--kind", "1f1b", "--stages", "64"])
        .args(["--microbatches", "2000"])
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("grid omitted"), "{out}");
    assert!(out.trim_end().ends_with("deadlock=no"), "{out}");

    let dir = tmpdir("bounds");
    let huge = u64::MAX.to_string();
    let o = train(
        &dir,
        "chunks",
        1,
        &TINY,
        &[
            "--layout",
            "pp=2",
            "--schedule",
            "interleaved",
            "--chunks",
            &huge,
        ],
    );
    assert_one_line_error(&o, &["chunk(s)", "too large"]);
    let o = train(&dir, "micro", 1, &TINY, &["--microbatches", &huge]);
    assert_one_line_error(&o, &["micro-batches"]);
    let tok = dir.join("tok.json");
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/corpus.txt");
    let o = bin()
        .args(["tokenizer", "train", "--kind", "bpe", "--vocab-size", &huge])
        .args(["--data", corpus.to_str().unwrap()])
        .args(["--out", tok.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["vocab size", "too large"]);
    assert!(!tok.exists());
    let o = bin()
        .args(["launch", "--nproc-per-node", "100000", "--", "launch-probe"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--nproc-per-node 100000"]);
    let o = bin()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--nnodes",
            &huge,
            "--",
            "train",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--nnodes"]);
    let o = train(&dir, "threads", 1, &TINY, &["--layout", "dp=4096"]);
    assert_one_line_error(&o, &["4096 ranks", "threads"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn overwrite_refused_by_a_later_check_leaves_the_old_run_byte_identical() {
    let dir = tmpdir("overwrite");
    let o = train(&dir, "run", 3, &TINY, &["--save-every", "2"]);
    assert_ok(&o);
    let run = dir.join("run");
    let before = snapshot(&run);
    assert!(before.iter().any(|(n, _)| n == "model.safetensors"));
    // Each refusal comes from a check after the folder check: data, tokenizer, microbatches,
    // tensor-parallel sizes, the memory estimate.
    let big = "model.n_embd=1000000";
    let refusals: [(&[&str], &[&str], &str); 5] = [
        (
            &["--data", "/nonexistent/meshgrad.txt"],
            &[],
            "/nonexistent",
        ),
        (&["--tokenizer", "/nonexistent/tok.json"], &[], "tok.json"),
        (&["--microbatches", "3"], &[], "micro-batches"),
        (&["--layout", "tp=3"], &[], "3"),
        (&[], &[big], "not enough memory"),
    ];
    for (extra, sets, needle) in refusals {
        let mut all_sets = TINY.to_vec();
        all_sets.extend_from_slice(sets);
        let mut args = vec!["--overwrite"];
        args.extend_from_slice(extra);
        let o = train(&dir, "run", 3, &all_sets, &args);
        assert_one_line_error(&o, &[needle]);
        assert_eq!(
            snapshot(&run),
            before,
            "{extra:?} {sets:?} changed the old run"
        );
    }
    // A run that passes every check replaces it.
    let o = train(&dir, "run", 2, &TINY, &["--overwrite"]);
    assert_ok(&o);
    assert!(!run.join("checkpoints").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn one_writer_per_folder() {
    let dir = tmpdir("lock");
    let out = dir.join("run");
    let start = |steps: &str| {
        let mut cmd = bin();
        cmd.args(["train", "--steps", steps, "--out", out.to_str().unwrap()]);
        for s in TINY {
            cmd.args(["--set", s]);
        }
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Two runs started together into one fresh folder: exactly one runs.
    let a = start("60");
    let b = start("60");
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let ok = [&a, &b].iter().filter(|o| o.status.success()).count();
    assert_eq!(ok, 1, "{:?}\n{:?}", text(&a), text(&b));
    let refused = if a.status.success() { &b } else { &a };
    assert_one_line_error(refused, &["in use by another run", "pid "]);
    // The lock is gone with its run, and a stale one (its process gone) is taken over.
    assert!(!out.join(".meshgrad.lock").exists());
    std::fs::write(out.join(".meshgrad.lock"), "pid 1 on host elsewhere\n").unwrap();
    let o = train(&dir, "run", 2, &TINY, &["--overwrite"]);
    assert_ok(&o);
    // A run in progress refuses an export into its folder; so does a finished run's folder
    // with checkpoints, and a folder holding a model unless --overwrite.
    let o = train(&dir, "ck", 2, &TINY, &["--save-every", "1"]);
    assert_ok(&o);
    let running = {
        let mut cmd = bin();
        cmd.args(["train", "--steps", "100000", "--out", out.to_str().unwrap()])
            .arg("--overwrite");
        for s in TINY {
            cmd.args(["--set", s]);
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let lock = out.join(".meshgrad.lock");
    let t0 = Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|s| s.starts_with("pid ")) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the run never locked"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let export = |to: &Path, extra: &[&str]| {
        bin()
            .args(["export", "--checkpoint", dir.join("ck").to_str().unwrap()])
            .args(["--out", to.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = export(&out, &["--overwrite"]);
    assert_one_line_error(&o, &["in use by another run"]);
    let mut running = running;
    running.kill().unwrap();
    running.wait().unwrap();
    let o = export(&dir.join("ck"), &["--overwrite"]);
    assert_one_line_error(&o, &["holds a run's checkpoints"]);
    let hf = dir.join("hf");
    assert_ok(&export(&hf, &[]));
    assert_one_line_error(&export(&hf, &[]), &["already holds a model", "--overwrite"]);
    // A stale tokenizer.json (the new model has none) goes on re-export.
    std::fs::write(hf.join("tokenizer.json"), "{}").unwrap();
    assert_ok(&export(&hf, &["--overwrite"]));
    assert!(!hf.join("tokenizer.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn latest_names_the_final_state_after_a_resume_without_save_every() {
    let dir = tmpdir("latest");
    assert_ok(&train(&dir, "run", 2, &TINY, &["--save-every", "2"]));
    let run = dir.join("run");
    let o = train(&dir, "run", 5, &TINY, &["--resume", run.to_str().unwrap()]);
    assert_ok(&o);
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-000005");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn weights_that_are_not_finite_are_never_published() {
    let dir = tmpdir("nonfinite");
    // No clipping and an absurd learning rate: the first step sends the weights to infinity
    // while the loss, computed before the step, is still finite.
    let o = train(
        &dir,
        "run",
        3,
        &TINY,
        &[
            "--lr",
            "1e39",
            "--set",
            "train.grad_clip=0",
            "--set",
            "train.weight_decay=0",
            "--save-every",
            "1",
        ],
    );
    assert_one_line_error(
        &o,
        &["training diverged", "NaN or infinite", "after step 1"],
    );
    assert!(!dir.join("run/checkpoints/step-000001").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn late_checks_come_before_the_work() {
    let dir = tmpdir("late");
    // A --trace path that cannot be written: refused before training, not after.
    let o = train(
        &dir,
        "trace",
        2,
        &TINY,
        &["--layout", "pp=2", "--trace", dir.to_str().unwrap()],
    );
    assert_one_line_error(&o, &["--trace", "is a directory"]);
    assert!(!dir.join("trace/model.safetensors").exists());
    // A token id outside the vocabulary, late in a shard: refused when the data is opened.
    let mut ids: Vec<u16> = (0..5000).map(|i| (i % 256) as u16).collect();
    ids[4321] = 300;
    let shard = dir.join("data.bin");
    meshgrad::nn::data::write_shard(&shard, &ids).unwrap();
    let o = train(
        &dir,
        "oov",
        100000,
        &TINY,
        &["--data", shard.to_str().unwrap()],
    );
    assert_one_line_error(&o, &["data.bin", "300", "4321"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn launch_fails_fast_and_its_ranks_die_with_it() {
    let o = bin()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--",
        ])
        .arg("launch-probe")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--master-port 0"]);
    let t0 = Instant::now();
    let o = bin()
        .args(["launch", "--nproc-per-node", "2"])
        .args([
            "--master-addr",
            "no-such-host.invalid",
            "--",
            "launch-probe",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["no-such-host.invalid", "does not resolve"]);
    assert!(t0.elapsed() < Duration::from_secs(60));
    // A launcher killed with SIGKILL cannot stop its ranks: they stop themselves.
    let mut launcher = bin()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "launch-probe",
            "--sleep",
            "120",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(launcher.stdout.take().unwrap());
    let mut pids = Vec::new();
    let mut line = String::new();
    while pids.len() < 2 {
        line.clear();
        let n = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(n > 0, "the probes printed no pids");
        if let Some(p) = line.split_whitespace().find_map(|w| w.strip_prefix("pid=")) {
            pids.push(p.trim().to_string());
        }
    }
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let t0 = Instant::now();
    while pids.iter().any(|p| Path::new("/proc").join(p).exists()) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "ranks {pids:?} outlived their launcher"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn eval_takes_a_gpt_whose_vocabulary_is_padded() {
    let dir = tmpdir("padded");
    let mut sets = TINY.to_vec();
    sets.push("model.vocab_multiple=100");
    assert_ok(&train(&dir, "run", 2, &sets, &[]));
    let data = dir.join("d.txt");
    std::fs::write(&data, "It is a truth universally acknowledged, ".repeat(20)).unwrap();
    let o = eval(&dir.join("run"), &data);
    assert_ok(&o);
    let loss = loss_line(&o);
    // Two steps from a random start: about ln(300) = 5.70 over the 300 padded logits.
    assert!(loss.is_finite() && (4.0..6.5).contains(&loss), "{loss}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compare_reports_a_nan_weight_as_an_infinite_difference() {
    use meshgrad::tensor::{Device, Tensor};
    let dir = tmpdir("compare-nan");
    let m = dir.join("m.jsonl");
    std::fs::write(&m, "{\"step\":1,\"loss\":5.0}\n").unwrap();
    let a = dir.join("a.safetensors");
    let b = dir.join("b.safetensors");
    let t = |v: Vec<f32>| Tensor::from_vec(v, 3, Device::Cpu).unwrap();
    meshgrad::nn::state::save_safetensors(&a, &[("w".into(), t(vec![1.0, 2.0, 3.0]))], None)
        .unwrap();
    meshgrad::nn::state::save_safetensors(&b, &[("w".into(), t(vec![1.0, f32::NAN, 3.0]))], None)
        .unwrap();
    let o = bin()
        .args(["compare", m.to_str().unwrap(), m.to_str().unwrap()])
        .args(["--weights", a.to_str().unwrap(), b.to_str().unwrap()])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains("largest_relative_weight_difference=inf"),
        "{out}"
    );
    assert!(err.contains("NaN or infinite"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
