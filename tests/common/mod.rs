//! Helpers shared by the CLI integration tests: running the `meshgrad` binary, temporary
//! folders, checking a run's outcome, and reading the metrics and losses it writes.
//!
//! Each test module (and `cli_launch`, its own binary) uses only some of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The `meshgrad` binary built for these tests, run in a fresh, empty working folder of its
/// own: what a command writes to a relative default path (`runs/latest` when `--out` is left
/// out) lands there, never in the checkout, and no test sees what the main job, an example, a
/// user or another test left behind.
pub fn bin() -> Command {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let cwd = std::env::temp_dir().join(format!("meshgrad-cli-cwd-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cwd);
    std::fs::create_dir_all(&cwd).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_meshgrad"));
    cmd.current_dir(cwd);
    cmd
}

/// A fresh, empty `meshgrad-cli-<name>-<pid>` folder under the system temp dir.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// (stdout, stderr) of a run.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The number a successful run printed after `key` (`peak_memory_per_rank_mib=`) on the first
/// stdout line that starts with it.
pub fn printed_number(o: &Output, key: &str) -> f64 {
    let (out, err) = text(o);
    assert!(o.status.success(), "{err}");
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} line: {out}"))
        .parse()
        .unwrap()
}

/// Asserts a successful run, showing its stdout and stderr otherwise.
pub fn assert_ok(o: &Output) {
    let (out, err) = text(o);
    assert!(o.status.success(), "{out}\n{err}");
}

/// Asserts a failed run: non-zero exit, a single `error:` line containing every needle, no
/// panic trace.
pub fn assert_one_line_error(o: &Output, needles: &[&str]) {
    let (_, err) = text(o);
    assert!(!o.status.success(), "expected failure, stderr: {err}");
    assert!(
        !err.contains("panicked"),
        "panic instead of an error: {err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "{n:?} not in {err}");
    }
}

/// `meshgrad train --steps <steps>` into `dir/<tag>` with metrics in `dir/<tag>.jsonl`, one
/// `--set` per entry of `sets` (in order), then `extra`.
pub fn train(dir: &Path, tag: &str, steps: usize, sets: &[&str], extra: &[&str]) -> Output {
    train_on(None, dir, tag, steps, sets, extra)
}

/// [`train`] as `processes` processes of `meshgrad launch` (one rank each, over TCP) when given.
pub fn train_on(
    processes: Option<usize>,
    dir: &Path,
    tag: &str,
    steps: usize,
    sets: &[&str],
    extra: &[&str],
) -> Output {
    let out = dir.join(tag);
    let metrics = dir.join(format!("{tag}.jsonl"));
    let mut cmd = bin();
    if let Some(n) = processes {
        cmd.args(["launch", "--nproc-per-node", &n.to_string(), "--"]);
    }
    cmd.args(["train", "--steps", &steps.to_string()])
        .args(["--out", out.to_str().unwrap()])
        .args(["--metrics", metrics.to_str().unwrap()]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.args(extra).output().unwrap()
}

/// `meshgrad eval --checkpoint <ckpt> --data <data>`.
pub fn eval(ckpt: &Path, data: &Path) -> Output {
    bin()
        .args(["eval", "--checkpoint", ckpt.to_str().unwrap()])
        .args(["--data", data.to_str().unwrap()])
        .output()
        .unwrap()
}

/// A tiny Mixtral's experts (with the tests' `model.*` sizes): 4 experts of width 16, 2 per
/// token, load-balancing coefficient 0.05.
pub const TINY_EXPERTS: [&str; 4] = [
    "model.intermediate_size=16",
    "model.n_experts=4",
    "model.experts_per_token=2",
    "model.router_aux_loss_coef=0.05",
];

/// A tiny Mixtral whose experts often get no token on a rank: 16 experts, one per token, rows
/// of 4 tokens (`--set` flags).
pub const IDLE_EXPERTS: [&str; 6] = [
    "--set",
    "model.n_experts=16",
    "--set",
    "model.experts_per_token=1",
    "--set",
    "model.block_size=4",
];

/// The value of the first `loss=` line of stdout.
pub fn loss_line(o: &Output) -> f64 {
    let (out, _) = text(o);
    let line = out.lines().find(|l| l.starts_with("loss=")).expect("loss=");
    line["loss=".len()..].parse().unwrap()
}

/// The `loss=` value of the last stdout line.
pub fn last_loss(o: &Output) -> f64 {
    let (out, _) = text(o);
    let last = out.lines().last().unwrap_or("");
    last.strip_prefix("loss=")
        .unwrap_or_else(|| panic!("last line is not loss=: {out}"))
        .parse()
        .unwrap()
}

/// A JSON file (a checkpoint's config.json, say).
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// One line of a metrics file.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    /// The step number (from 1).
    pub step: usize,
    pub loss: f64,
    /// Present on the steps that evaluate.
    pub val_loss: Option<f64>,
    /// NaN when the line has none.
    pub grad_norm: f64,
}

/// The lines of `dir/<tag>.jsonl`.
pub fn metrics(dir: &Path, tag: &str) -> Vec<Step> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Step {
                step: v["step"].as_u64().unwrap() as usize,
                loss: v["loss"].as_f64().unwrap(),
                val_loss: v["val_loss"].as_f64(),
                grad_norm: v["grad_norm"].as_f64().unwrap_or(f64::NAN),
            }
        })
        .collect()
}

/// |a - b| relative to |b|.
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// Asserts that run `tag` went step by step like `want`: losses within 1e-5 relative, gradient
/// norms (when `grad_norms`) within 1e-4, validation losses at the same steps within 1e-5.
pub fn assert_lockstep(tag: &str, got: &[Step], want: &[Step], grad_norms: bool) {
    assert_eq!(got.len(), want.len(), "{tag}: one metrics line per step");
    for (step, (a, b)) in got.iter().zip(want).enumerate() {
        let (la, lb) = (a.loss, b.loss);
        assert!(rel(la, lb) <= 1e-5, "{tag} step {step}: loss {la} vs {lb}");
        if grad_norms {
            let (na, nb) = (a.grad_norm, b.grad_norm);
            assert!(
                rel(na, nb) <= 1e-4,
                "{tag} step {step}: grad norm {na} vs {nb}"
            );
        }
        assert_eq!(a.val_loss.is_some(), b.val_loss.is_some());
        if let (Some(va), Some(vb)) = (a.val_loss, b.val_loss) {
            assert!(rel(va, vb) <= 1e-5, "{tag} step {step}: val {va} vs {vb}");
        }
    }
}

/// The weights of the GPT checkpoint `dir/<tag>`, by name.
pub fn checkpoint_weights(dir: &Path, tag: &str) -> Vec<(String, Vec<f32>)> {
    let m = meshgrad::train::load_checkpoint(&dir.join(tag)).unwrap();
    meshgrad::nn::state::state_dict(&m)
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f32().unwrap()))
        .collect()
}

/// The parameters of the Hugging Face Llama, Mixtral or BERT folder `dir/<tag>` (a run's
/// `--out`), by name.
pub fn hf_folder_weights(dir: &Path, tag: &str) -> Vec<(String, Vec<f64>)> {
    use meshgrad::nn::state::{hf_bert, hf_llama, hf_mixtral, state_dict};
    use meshgrad::tensor::{DType, Device};
    let folder = dir.join(tag);
    let values = |m: &dyn meshgrad::nn::Module| {
        state_dict(m)
            .into_iter()
            .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
            .collect()
    };
    if hf_bert::is_bert_checkpoint(&folder) {
        return values(&hf_bert::load_bert(&folder, DType::F32, Device::Cpu).unwrap());
    }
    let m = if hf_mixtral::is_mixtral_folder(&folder) {
        hf_mixtral::load_mixtral(&folder, DType::F32, Device::Cpu)
    } else {
        hf_llama::load_llama(&folder, DType::F32, Device::Cpu)
    }
    .unwrap();
    values(&m)
}

/// Asserts that the final weights `got` equal `want` (the same names, in order) within 1e-5
/// relative L2 over all parameters together.
pub fn assert_weights_close(tag: &str, got: &[(String, Vec<f64>)], want: &[(String, Vec<f64>)]) {
    assert_eq!(got.len(), want.len(), "{tag}: parameter count");
    let (mut diff, mut norm) = (0.0, 0.0);
    for ((n, a), (m, b)) in got.iter().zip(want) {
        assert_eq!(n, m, "{tag}");
        assert_eq!(a.len(), b.len(), "{tag}: {n}");
        for (x, y) in a.iter().zip(b) {
            diff += (x - y) * (x - y);
            norm += y * y;
        }
    }
    let r = (diff / norm).sqrt();
    assert!(r <= 1e-5, "{tag}: weights differ by {r:e} (relative L2)");
}

/// Asserts that the GPT checkpoint of every run in `tags` holds the weights of the checkpoint
/// `reference` to rounding: each tensor within 1e-5 of its largest magnitude. The key
/// projection's bias (the middle third of `c_attn.bias`) has a gradient that is zero up to
/// rounding (softmax ignores a constant shift of the scores), which AdamW turns into lr-sized
/// steps of arbitrary sign: it cannot match a run that sums differently, whatever the layout, so
/// only the query and value parts are compared.
pub fn assert_checkpoints_match(dir: &Path, tags: &[&str], reference: &str) {
    let want = checkpoint_weights(dir, reference);
    for tag in tags {
        let got = checkpoint_weights(dir, tag);
        assert_eq!(got.len(), want.len(), "{tag}");
        for ((n, a), (wn, b)) in got.iter().zip(&want) {
            assert_eq!(n, wn, "{tag}");
            let (a, b): (Vec<f32>, Vec<f32>) = if n.ends_with("attn.c_attn.bias") {
                let c = a.len() / 3;
                a.iter()
                    .zip(b)
                    .enumerate()
                    .filter(|(i, _)| !(c..2 * c).contains(i))
                    .map(|(_, (x, y))| (*x, *y))
                    .unzip()
            } else {
                (a.clone(), b.clone())
            };
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff <= 1e-5 * scale,
                "{tag}: {n}: {diff:e} vs scale {scale:e}"
            );
        }
    }
}

/// A run's metrics lines without their timing (`tokens_per_s`): every loss, validation loss,
/// gradient norm, auxiliary loss and expert load, as the JSON text writes them.
pub fn metric_lines(dir: &Path, tag: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("tokens_per_s");
            v.to_string()
        })
        .collect()
}
