//! `meshgrad train --precision` and `--device`.
//!
//! * bf16 (bf16 weights and activations, f32 master weights and AdamW state) tracks the f32
//!   run's losses within 5e-3 relative over 20 steps (measured: 4.3e-4 relative, 1.8e-3
//!   absolute, on this tiny GPT); the training checkpoint holds bf16 parameters and f32
//!   masters and moments; the resolved config records the precision; a bf16 checkpoint is
//!   refused by an f32 `--resume`.
//! * f16 with dynamic loss scaling: an initial scale of 2^24 overflows the f16 gradients, the
//!   steps are skipped (parameters and optimizer state byte-identical in the checkpoints) with
//!   the scale halved each time until steps succeed, and the run still converges (measured:
//!   7 skips over 30 steps, 6 in a row from 2^24 down to 2^18, then one more at 2^18 a step
//!   later; the scale settles at 2^17).
//! * bf16 with `--layout dp=2` stays within 1e-3 relative of bf16 on one device (measured:
//!   1.7e-5 over these 10 steps, 7e-5 over 20). Not bit-identical: each rank's bf16 gradient is the mean over its own
//!   rows, rounded to bf16, and the ranks' gradients are averaged and rounded again, where one
//!   device rounds the whole batch's gradient once.
//! * Tensor parallelism runs through the same master weights on every rank: bf16 `tp=2` within
//!   5e-3 relative of bf16 on one device (measured: 2.2e-3; the row-parallel outputs are summed
//!   across ranks from bf16 partial products, and bf16 keeps 8 bits of mantissa), f16
//!   `dp=2,tp=2` within 1e-3 of f16 on one device (measured: 4.8e-5). The model the leader
//!   gathers and exports keeps the run's precision (GPT and BERT), as one device's does.
//! * ZeRO layouts train bf16 through the wrapper's own f32 master shards: `fsdp=2` within 1e-3
//!   of one device (measured: 1.7e-5), and a one-device bf16 checkpoint resumes under
//!   `zero1=2` within 1e-4 of the uninterrupted run (measured: 9.0e-6; the wrapper's master
//!   shards take the checkpoint's f32 masters. Filled from the bf16 weights instead, as before,
//!   it was 2.4e-4).
//! * An f16 run resumed from a checkpoint continues its dynamic loss scale (the checkpoint holds
//!   it) and repeats the uninterrupted run; a resumed run that sets another
//!   `train.loss_scale_init` restarts the scale from it.
//! * Flags and config values are validated with one-line errors; `--device cuda` fails before
//!   any work on a machine without a GPU (or a build without `--features cuda`); layouts and
//!   models that cannot run in half precision or on CUDA are refused naming the reason.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_ok, assert_one_line_error, bin, metrics, rel, text, tmpdir};

const SETS: [&str; 9] = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.eval_batches=1",
    "train.sample_tokens=0",
    "train.log_interval=100",
];

fn train(dir: &Path, tag: &str, steps: usize, extra: &[&str]) -> Output {
    common::train(dir, tag, steps, &SETS, extra)
}

/// `(name, dtype)` of every tensor of a safetensors file.
fn dtypes(path: &Path) -> Vec<(String, String)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["dtype"].as_str().unwrap().to_string()))
        .collect()
}

/// The raw metrics lines of run `tag`.
fn lines(dir: &Path, tag: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn checkpoint_file(dir: &Path, tag: &str, step: usize) -> Vec<u8> {
    std::fs::read(
        dir.join(tag)
            .join("checkpoints")
            .join(format!("step-{step:06}"))
            .join("rank-00000.safetensors"),
    )
    .unwrap()
}

#[test]
fn bf16_tracks_f32_with_f32_master_weights() {
    let dir = tmpdir("precision-bf16");
    let steps = 20;
    assert_ok(&train(&dir, "f32", steps, &[]));
    assert_ok(&train(
        &dir,
        "bf16",
        steps,
        &["--precision", "bf16", "--save-every", "20"],
    ));
    let (a, b) = (metrics(&dir, "f32"), metrics(&dir, "bf16"));
    assert_eq!(a.len(), steps);
    assert_eq!(b.len(), steps);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| rel(y.loss, x.loss))
        .fold(0.0, f64::max);
    assert!(
        worst < 5e-3,
        "bf16 vs f32: max relative loss difference {worst}"
    );
    assert!(
        b[steps - 1].loss < b[0].loss - 1.0,
        "bf16 did not train: {b:?}"
    );
    // bf16 needs no loss scale: its metrics lines have none.
    assert!(lines(&dir, "bf16")[0].get("loss_scale").is_none());

    // The training checkpoint: bf16 parameters, f32 master weights and moments.
    let ck = dir.join("bf16/checkpoints/step-000020/rank-00000.safetensors");
    let types = dtypes(&ck);
    let of = |pred: &dyn Fn(&str) -> bool| -> Vec<&str> {
        types
            .iter()
            .filter(|(k, _)| pred(k))
            .map(|(_, d)| d.as_str())
            .collect()
    };
    let masters = of(&|k| k.contains("adamw.master."));
    let moments = of(&|k| k.contains("adamw.m.") || k.contains("adamw.v."));
    let params = of(&|k| !k.starts_with("optim/"));
    assert!(
        !masters.is_empty() && masters.iter().all(|d| *d == "F32"),
        "{types:?}"
    );
    assert!(
        !moments.is_empty() && moments.iter().all(|d| *d == "F32"),
        "{types:?}"
    );
    assert!(
        !params.is_empty() && params.iter().all(|d| *d == "BF16"),
        "{types:?}"
    );
    assert_eq!(masters.len(), params.len(), "one master per parameter");
    // The exported model keeps the bf16 weights; the resolved config records the precision.
    let exported = dtypes(&dir.join("bf16/model.safetensors"));
    assert!(exported.iter().all(|(_, d)| d == "BF16"), "{exported:?}");
    let toml = std::fs::read_to_string(dir.join("bf16/meshgrad.toml")).unwrap();
    assert!(toml.contains("precision = \"bf16\""), "{toml}");
    assert!(toml.contains("device = \"cpu\""), "{toml}");

    // A bf16 checkpoint does not resume in f32 (its optimizer state has master weights);
    // without --precision the resumed run takes the checkpoint's.
    let resume = dir.join("bf16");
    let o = train(
        &dir,
        "again",
        steps + 2,
        &["--resume", resume.to_str().unwrap(), "--precision", "f32"],
    );
    assert_one_line_error(
        &o,
        &["train.precision is bf16 in the checkpoint but f32 in this run"],
    );
}

/// The metrics lines of `tag` without their timing fields (which differ from run to run).
fn lines_without_timing(dir: &Path, tag: &str) -> Vec<serde_json::Value> {
    lines(dir, tag)
        .into_iter()
        .map(|mut l| {
            let m = l.as_object_mut().unwrap();
            m.retain(|k, _| !k.contains("time") && !k.contains("tok") && !k.ends_with("_s"));
            l
        })
        .collect()
}

#[test]
fn an_f16_run_resumes_with_its_loss_scale() {
    let dir = tmpdir("precision-f16-resume");
    // From 2^20 the first steps overflow and halve the scale; the checkpoint after step 3 is
    // taken in the middle of that, so a resumed run must continue from the halved scale (and
    // its count of good steps) to repeat the uninterrupted run, whose last steps are taken.
    let f16 = [
        "--precision",
        "f16",
        "--set",
        "train.loss_scale_init=1048576",
    ];
    assert_ok(&train(
        &dir,
        "whole",
        8,
        &[&f16[..], &["--save-every", "1"]].concat(),
    ));
    let whole = lines_without_timing(&dir, "whole");
    assert_eq!(whole.len(), 8);
    assert_eq!(
        whole[0]["skipped"], true,
        "2^20 overflows the first step: {whole:?}"
    );
    assert_eq!(
        whole[7]["skipped"], false,
        "the last step is taken: {whole:?}"
    );
    let ck = dir.join("whole/checkpoints/step-000003");
    assert_ok(&train(
        &dir,
        "resumed",
        8,
        &[&f16[..], &["--resume", ck.to_str().unwrap()]].concat(),
    ));
    assert_eq!(lines_without_timing(&dir, "resumed"), whole[3..]);
    let weights = |tag: &str| std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    assert!(weights("resumed") == weights("whole"));
}

#[test]
fn f16_overflow_skips_steps_until_the_scale_fits() {
    let dir = tmpdir("precision-f16");
    // Three good steps at the default scale (2^16) build the optimizer state...
    let first = train(&dir, "f16", 3, &["--precision", "f16", "--save-every", "1"]);
    assert_ok(&first);
    assert!(lines(&dir, "f16")
        .iter()
        .all(|l| l["skipped"] == false && l["loss_scale"] == 65536.0));
    // ...then the run continues from a scale of 2^24, which overflows f16 gradients.
    let resume = dir.join("f16");
    let o = train(
        &dir,
        "f16",
        30,
        &[
            "--precision",
            "f16",
            "--save-every",
            "1",
            "--set",
            "train.loss_scale_init=16777216",
            "--resume",
            resume.to_str().unwrap(),
        ],
    );
    assert_ok(&o);
    let (out, _) = text(&o);
    let m = lines(&dir, "f16");
    assert_eq!(m.len(), 30);
    let skipped: Vec<usize> = m
        .iter()
        .filter(|l| l["skipped"] == true)
        .map(|l| l["step"].as_u64().unwrap() as usize)
        .collect();
    assert!(!skipped.is_empty(), "no step overflowed at 2^24: {m:?}");
    // The first resumed step overflows; every skip halves the scale (it only grows after 2000
    // good steps, so it stays put otherwise).
    assert_eq!(skipped[0], 4);
    let mut scale = 16777216.0;
    for l in &m[3..] {
        let s = l["step"].as_u64().unwrap() as usize;
        if l["skipped"] == false {
            assert_eq!(l["loss_scale"], scale, "step {s}");
            continue;
        }
        scale /= 2.0;
        assert_eq!(l["loss_scale"], scale, "step {s}");
        let msg =
            format!("step {s}: non-finite gradients in f16, step skipped, loss scale -> {scale}");
        assert!(out.contains(&msg), "{msg:?} not in {out}");
        // Parameters and optimizer state untouched: the checkpoint after the skipped step
        // holds the same bytes as the one before it.
        assert!(
            checkpoint_file(&dir, "f16", s) == checkpoint_file(&dir, "f16", s - 1),
            "step {s} changed the weights or the optimizer state"
        );
    }
    // Then the steps succeed at the lowered scale, and the run converges.
    let last = skipped[skipped.len() - 1];
    assert!(last < 20, "still skipping at step {last}");
    assert!(m[last..].iter().all(|l| l["skipped"] == false));
    assert!(checkpoint_file(&dir, "f16", last + 1) != checkpoint_file(&dir, "f16", last));
    let loss = |i: usize| m[i]["loss"].as_f64().unwrap();
    assert!(loss(29) < loss(0) - 1.0, "f16 did not train: {m:?}");
}

#[test]
fn bf16_data_parallel_tracks_one_device() {
    let dir = tmpdir("precision-dp");
    assert_ok(&train(&dir, "one", 10, &["--precision", "bf16"]));
    assert_ok(&train(
        &dir,
        "dp",
        10,
        &["--precision", "bf16", "--layout", "dp=2"],
    ));
    let (a, b) = (metrics(&dir, "one"), metrics(&dir, "dp"));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!(
            rel(y.loss, x.loss) < 1e-3,
            "step {}: dp=2 {} vs one device {}",
            x.step,
            y.loss,
            x.loss
        );
    }
}

#[test]
fn half_precision_tensor_parallel_tracks_one_device() {
    let dir = tmpdir("precision-tp");
    for p in ["bf16", "f16"] {
        assert_ok(&train(&dir, &format!("one-{p}"), 10, &["--precision", p]));
    }
    assert_ok(&train(
        &dir,
        "tp-bf16",
        10,
        &["--precision", "bf16", "--layout", "tp=2"],
    ));
    assert_ok(&train(
        &dir,
        "dptp-f16",
        10,
        &["--precision", "f16", "--layout", "dp=2,tp=2"],
    ));
    // The leader's gathered model keeps the run's precision, as one device's does.
    for (tag, dtype) in [("tp-bf16", "BF16"), ("dptp-f16", "F16")] {
        let exported = dtypes(&dir.join(tag).join("model.safetensors"));
        assert!(
            !exported.is_empty() && exported.iter().all(|(_, d)| d == dtype),
            "{tag}: {exported:?}"
        );
    }
    for (tag, one, tol) in [("tp-bf16", "one-bf16", 5e-3), ("dptp-f16", "one-f16", 1e-3)] {
        let (a, b) = (metrics(&dir, one), metrics(&dir, tag));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(
                rel(y.loss, x.loss) < tol,
                "{tag} step {}: {} vs one device {}",
                x.step,
                y.loss,
                x.loss
            );
        }
    }
}

#[test]
fn bf16_zero_layouts_keep_f32_master_shards() {
    let dir = tmpdir("precision-zero");
    let sets = ["--precision", "bf16"];
    assert_ok(&train(
        &dir,
        "one",
        10,
        &[sets[0], sets[1], "--save-every", "4"],
    ));
    assert_ok(&train(
        &dir,
        "fsdp",
        10,
        &[sets[0], sets[1], "--layout", "fsdp=2"],
    ));
    // A one-device bf16 checkpoint (bf16 parameters, f32 masters) resumes under zero1=2,
    // whose f32 master shards take the saved masters.
    let ck = dir.join("one/checkpoints/step-000004");
    assert_ok(&train(
        &dir,
        "resumed",
        10,
        &[
            sets[0],
            sets[1],
            "--layout",
            "zero1=2",
            "--resume",
            ck.to_str().unwrap(),
        ],
    ));
    let one = metrics(&dir, "one");
    for (tag, tol) in [("fsdp", 1e-3), ("resumed", 1e-4)] {
        let other = metrics(&dir, tag);
        assert_eq!(other.last().unwrap().step, 10, "{tag}");
        for y in &other {
            let x = &one[y.step - 1];
            assert!(
                rel(y.loss, x.loss) < tol,
                "{tag} step {}: {} vs one device {}",
                y.step,
                y.loss,
                x.loss
            );
        }
    }
}

/// f16 under ZeRO: the wrapper unscales its reduced gradient shards in f32 before the norm,
/// the clipping and the step. `fsdp=2` and `zero1=2` give `dp=2`'s losses (measured: equal; the
/// same per-rank backward, the same averaged gradients); from a scale of 2^20 the first steps
/// overflow and are skipped as on one device, then the run trains.
#[test]
fn f16_trains_under_zero_layouts() {
    let dir = tmpdir("precision-f16-zero");
    let f16 = ["--precision", "f16"];
    let go = |tag: &str, extra: &[&str]| {
        assert_ok(&train(&dir, tag, 12, &[&f16[..], extra].concat()));
        lines(&dir, tag)
    };
    let dp2 = go("dp2", &["--layout", "dp=2"]);
    for layout in ["fsdp=2", "zero1=2"] {
        let m = go(&layout.replace('=', ""), &["--layout", layout]);
        for (a, b) in m.iter().zip(&dp2) {
            let (x, y) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
            assert!(
                rel(x, y) < 1e-5,
                "{layout} step {}: {x} vs dp=2 {y}",
                a["step"]
            );
            assert_eq!(a["skipped"], b["skipped"], "{layout} step {}", a["step"]);
            // The norm of the unscaled gradients (a scaled one would be 2^16 times larger).
            if let (Some(x), Some(y)) = (a["grad_norm"].as_f64(), b["grad_norm"].as_f64()) {
                assert!(
                    rel(x, y) < 1e-4,
                    "{layout} step {}: norm {x} vs {y}",
                    a["step"]
                );
            }
        }
    }
    let hot = ["--set", "train.loss_scale_init=1048576"];
    let one = go("one_hot", &hot);
    let fsdp = go("fsdp_hot", &[&hot[..], &["--layout", "fsdp=2"]].concat());
    let skips =
        |m: &[serde_json::Value]| -> Vec<bool> { m.iter().map(|l| l["skipped"] == true).collect() };
    assert!(skips(&one)[0], "2^20 overflows the first step: {one:?}");
    assert_eq!(skips(&fsdp), skips(&one));
    let loss = |m: &[serde_json::Value], i: usize| m[i]["loss"].as_f64().unwrap();
    assert!(
        loss(&fsdp, 11) < loss(&fsdp, 0) - 0.5,
        "fsdp=2 f16 did not train: {fsdp:?}"
    );
}

/// Pipelines train in bf16 and f16: the stages are built in the run's precision, the f16 loss
/// scale seeds every microbatch's backward, and the step unscales and clips in f32 with the norm
/// over every stage. Measured over these 12 steps: `pp=2` gives one device's losses (equal, in
/// bf16 and f16, including the skipped first steps from a scale of 2^20), `dp=2,pp=2` and
/// `fsdp=2,pp=2` under zb within 5e-5 (bf16), `fsdp=2,pp=2` within 5e-6 (f16), and BERT `pp=2` in
/// bf16 equals BERT in bf16 on one device.
#[test]
fn half_precision_pipelines_track_one_device() {
    let dir = tmpdir("precision-pipeline");
    let go = |tag: &str, extra: &[&str]| {
        let sets = ["model.n_layer=2", "train.batch_size=8"];
        let sets: Vec<&str> = SETS.iter().copied().chain(sets).collect();
        assert_ok(&common::train(&dir, tag, 12, &sets, extra));
        lines(&dir, tag)
    };
    let worst = |a: &[serde_json::Value], b: &[serde_json::Value]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| rel(x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap()))
            .fold(0f64, f64::max)
    };
    let skips =
        |m: &[serde_json::Value]| -> Vec<bool> { m.iter().map(|l| l["skipped"] == true).collect() };
    let bf16 = ["--precision", "bf16"];
    let one = go("bf16", &bf16);
    for (tag, layout, tol) in [
        ("bf16_pp2", &["--layout", "pp=2"][..], 1e-6),
        ("bf16_dp2pp2", &["--layout", "dp=2,pp=2"][..], 1e-3),
        (
            "bf16_fsdp2pp2",
            &["--layout", "fsdp=2,pp=2", "--schedule", "zb"][..],
            1e-3,
        ),
    ] {
        let m = go(tag, &[&bf16[..], layout].concat());
        assert!(worst(&m, &one) < tol, "{tag}: {}", worst(&m, &one));
    }
    let f16 = [
        "--precision",
        "f16",
        "--set",
        "train.loss_scale_init=1048576",
    ];
    let one = go("f16", &f16);
    assert!(skips(&one)[0], "2^20 overflows the first step: {one:?}");
    for (tag, layout, tol) in [
        ("f16_pp2", &["--layout", "pp=2"][..], 1e-6),
        ("f16_fsdp2pp2", &["--layout", "fsdp=2,pp=2"][..], 1e-4),
    ] {
        let m = go(tag, &[&f16[..], layout].concat());
        assert!(worst(&m, &one) < tol, "{tag}: {}", worst(&m, &one));
        assert_eq!(skips(&m), skips(&one), "{tag}");
        assert!(m.iter().all(|l| l["loss_scale"].is_number()), "{tag}");
    }
    let bert = ["--precision", "bf16", "--model", "bert"];
    let one = go("bert", &bert);
    let pp2 = go("bert_pp2", &[&bert[..], &["--layout", "pp=2"]].concat());
    assert!(worst(&pp2, &one) < 1e-6, "BERT pp=2: {}", worst(&pp2, &one));
}

/// BERT in mixed precision: bf16 and f16 track f32 (measured over these 20 steps: 4.8e-4 and
/// 2.3e-5 relative), bf16 `dp=2` tracks bf16 on one device (1.5e-4), f16 carries its loss scale
/// in the metrics, and the exported model keeps bf16 weights.
#[test]
fn bert_trains_in_bf16_and_f16() {
    let dir = tmpdir("precision-bert");
    let bert = |tag: &str, extra: &[&str]| {
        let sets = [
            "model.kind=bert",
            "model.n_layer=2",
            "model.n_embd=64",
            "model.n_head=4",
            "model.block_size=64",
            "train.batch_size=8",
            "train.eval_interval=10",
            "train.eval_batches=2",
        ];
        assert_ok(&common::train(&dir, tag, 20, &sets, extra));
        metrics(&dir, tag)
    };
    let f32 = bert("f32", &[]);
    let worst = |a: &[common::Step], b: &[common::Step]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| rel(x.loss, y.loss))
            .fold(0f64, f64::max)
    };
    let bf16 = bert("bf16", &["--precision", "bf16"]);
    assert!(
        worst(&bf16, &f32) < 2e-3,
        "bf16 vs f32: {}",
        worst(&bf16, &f32)
    );
    let f16 = bert("f16", &["--precision", "f16"]);
    assert!(
        worst(&f16, &f32) < 1e-4,
        "f16 vs f32: {}",
        worst(&f16, &f32)
    );
    assert!(lines(&dir, "f16")
        .iter()
        .all(|l| l["loss_scale"].is_number()));
    let dp2 = bert("bf16_dp2", &["--precision", "bf16", "--layout", "dp=2"]);
    assert!(
        worst(&dp2, &bf16) < 1e-3,
        "bf16 dp=2: {}",
        worst(&dp2, &bf16)
    );
    assert!(
        f32[19].loss < f32[0].loss - 1.0,
        "BERT did not train: {f32:?}"
    );
    let tp2 = bert(
        "bf16_tp2",
        &[
            "--precision",
            "bf16",
            "--layout",
            "tp=2",
            "--set",
            "model.vocab_multiple=2",
        ],
    );
    assert!(
        worst(&tp2, &bf16) < 5e-3,
        "bf16 tp=2: {}",
        worst(&tp2, &bf16)
    );
    for tag in ["bf16", "bf16_tp2"] {
        let exported = dtypes(&dir.join(tag).join("model.safetensors"));
        assert!(
            !exported.is_empty() && exported.iter().all(|(_, d)| d == "BF16"),
            "{tag}: {exported:?}"
        );
    }
}

#[test]
fn precision_and_device_errors_are_one_line() {
    let dir = tmpdir("precision-errors");
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec!["--precision", "fp8"],
            vec!["train.precision", "\"f32\", \"bf16\" or \"f16\"", "fp8"],
        ),
        (
            vec!["--device", "gpu"],
            vec!["train.device", "\"cpu\", \"cuda\" or \"cuda:N\"", "gpu"],
        ),
        (
            vec!["--set", "train.loss_scale_init=0"],
            vec!["train.loss_scale_init", "> 0"],
        ),
        (
            vec!["--device", "cuda", "--layout", "dp=2"],
            vec!["--device cuda with layout dp=2: the ranks of a layout compute on the CPU"],
        ),
        (
            vec!["--device", "cuda:1", "--layout", "pp=2"],
            vec!["--device cuda:1 with layout pp=2", "drop --device"],
        ),
    ];
    for (i, (args, needles)) in cases.iter().enumerate() {
        let o = train(&dir, &format!("e{i}"), 2, args);
        assert_one_line_error(&o, needles);
        assert!(!dir.join(format!("e{i}")).exists(), "{args:?} did work");
    }
}

/// Without a GPU (or without `--features cuda`) `--device cuda` fails before any work, with
/// the backend's reason on one line, for GPT and BERT alike.
#[test]
fn device_cuda_fails_early_without_a_gpu() {
    if std::env::var_os("MESHGRAD_REQUIRE_CUDA").is_some() {
        return; // a GPU machine: the run would train
    }
    let dir = tmpdir("precision-cuda");
    let o = train(&dir, "cuda", 2, &["--device", "cuda"]);
    assert_one_line_error(&o, &["--device cuda: "]);
    let (_, err) = text(&o);
    if !cfg!(feature = "cuda") {
        assert!(err.contains("built without CUDA"), "{err}");
    }
    assert!(!dir.join("cuda").exists(), "--device cuda did work: {err}");
    assert!(!dir.join("cuda.jsonl").exists());
    // BERT trains on a CUDA device too (f32, one device): the same early failure here, for
    // the same reason (not a refusal of the model).
    let o = train(
        &dir,
        "bert-cuda",
        2,
        &["--model", "bert", "--device", "cuda"],
    );
    assert_one_line_error(&o, &["--device cuda: "]);
    let (_, err) = text(&o);
    assert!(!err.contains("only GPT"), "{err}");
    if !cfg!(feature = "cuda") {
        assert!(err.contains("built without CUDA"), "{err}");
    }
    assert!(
        !dir.join("bert-cuda").exists(),
        "--device cuda did work: {err}"
    );
    assert!(!dir.join("bert-cuda.jsonl").exists());
    // The flag's value is checked by the config's validation.
    let o = bin()
        .args(["train", "--device", "cuda:x"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["train.device", "cuda:x"]);
}
