//! Runs that survive: `--save-every` / `--resume`.
//!
//! * Resuming on the same layout from a run's step-5 checkpoint writes the uninterrupted run's
//!   losses bit for bit and the same final weights (single device, fsdp=2, tp=2, pp=2).
//! * Resharding: saved under fsdp=4, resumed under dp=2,tp=2, one device and pp=2, the losses
//!   continue within 1e-5 of the uninterrupted run.
//! * SIGINT stops a run after a step with a checkpoint and a non-zero exit; `--resume` finishes
//!   it with the uninterrupted losses and weights.
//! * Fault injection: 20 `kill -9`s at random moments of a run with `--save-every 1` (start-up
//!   included); after each
//!   the latest checkpoint resumes, no temporary folders pile up, and the run that finally
//!   completes has the uninterrupted run's weights bit for bit.
//! * `eval`, `generate` and `export` read training checkpoints (saved as ZeRO-3 segments) and
//!   give what the run's final model gives; a BERT saved on one device resumes under dp=2.
//! * A resumed run must continue the same model and data; a folder holding a run is refused.
//! * `--resume` alone takes the model, seed and steps from the checkpoint's config (bit for bit
//!   the uninterrupted run), leaves the original run's metrics file alone, and still refuses a
//!   model flag that differs.

use crate::common;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, assert_one_line_error, bin, tmpdir};

const SETS: [&str; 9] = [
    "model.n_layer=4",
    "model.n_embd=32",
    "model.n_head=4",
    "model.block_size=16",
    "train.batch_size=8",
    "train.warmup_steps=3",
    "train.eval_batches=1",
    "train.eval_interval=5",
    "train.sample_tokens=0",
];

fn train_cmd(dir: &Path, tag: &str, steps: usize, extra: &[&str]) -> std::process::Command {
    let mut cmd = bin();
    cmd.args(["train", "--steps", &steps.to_string()])
        .args(["--out", dir.join(tag).to_str().unwrap()])
        .args([
            "--metrics",
            dir.join(format!("{tag}.jsonl")).to_str().unwrap(),
        ]);
    for s in SETS {
        cmd.args(["--set", s]);
    }
    cmd.args(extra);
    cmd
}

fn train(dir: &Path, tag: &str, steps: usize, extra: &[&str]) -> Output {
    train_cmd(dir, tag, steps, extra).output().unwrap()
}

/// `(step, loss)` of every metrics line of run `tag`.
fn losses(dir: &Path, tag: &str) -> Vec<(u64, f64)> {
    common::metrics(dir, tag)
        .iter()
        .map(|s| (s.step as u64, s.loss))
        .collect()
}

fn weights(dir: &Path, tag: &str) -> Vec<(String, Vec<f32>)> {
    common::checkpoint_weights(dir, tag)
}

fn checkpoint(dir: &Path, tag: &str, step: usize) -> String {
    dir.join(tag)
        .join("checkpoints")
        .join(format!("step-{step:06}"))
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn resuming_on_the_same_layout_is_bit_identical() {
    let dir = tmpdir("resume-same");
    for (tag, layout) in [
        ("single", &[][..]),
        ("fsdp2", &["--layout", "fsdp=2"][..]),
        ("tp2", &["--layout", "tp=2"][..]),
        ("pp2", &["--layout", "pp=2", "--microbatches", "2"][..]),
    ] {
        let full = format!("{tag}-full");
        assert_ok(&train(
            &dir,
            &full,
            10,
            &[layout, &["--save-every", "5"]].concat(),
        ));
        let resumed = format!("{tag}-resumed");
        let from = checkpoint(&dir, &full, 5);
        let o = train(&dir, &resumed, 10, &[layout, &["--resume", &from]].concat());
        assert_ok(&o);
        let want: Vec<(u64, f64)> = losses(&dir, &full).into_iter().skip(5).collect();
        let got = losses(&dir, &resumed);
        assert_eq!(got.len(), 5, "{tag}");
        for ((sa, a), (sb, b)) in got.iter().zip(&want) {
            assert_eq!(sa, sb, "{tag}");
            assert_eq!(a.to_bits(), b.to_bits(), "{tag} step {sa}: {a} vs {b}");
        }
        assert_eq!(weights(&dir, &resumed), weights(&dir, &full), "{tag}");
    }
}

#[test]
fn a_checkpoint_saved_under_fsdp_resumes_under_other_layouts() {
    let dir = tmpdir("resume-reshard");
    assert_ok(&train(&dir, "single", 10, &[]));
    assert_ok(&train(
        &dir,
        "fsdp4",
        10,
        &["--layout", "fsdp=4", "--save-every", "5"],
    ));
    let reference = losses(&dir, "single");
    let from = checkpoint(&dir, "fsdp4", 5);
    for (tag, layout) in [
        ("dp2tp2", &["--layout", "dp=2,tp=2"][..]),
        ("one", &[][..]),
        ("pp2", &["--layout", "pp=2", "--microbatches", "2"][..]),
    ] {
        let o = train(&dir, tag, 10, &[layout, &["--resume", &from]].concat());
        assert_ok(&o);
        let got = losses(&dir, tag);
        assert_eq!(got.len(), 5, "{tag}");
        for (step, loss) in got {
            let want = reference[step as usize - 1].1;
            assert!(
                common::rel(loss, want) <= 1e-5,
                "{tag} step {step}: {loss} vs {want}"
            );
        }
    }
}

/// Waits until `path` exists (or `limit` passes).
fn wait_for(path: &Path, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn signal(child: &Child, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

#[test]
fn sigint_saves_and_stops_and_resume_finishes_the_run() {
    let dir = tmpdir("resume-sigint");
    assert_ok(&train(&dir, "full", 60, &[]));
    let child = train_cmd(&dir, "run", 60, &["--save-every", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(wait_for(
        &dir.join("run/checkpoints/latest"),
        Duration::from_secs(60)
    ));
    signal(&child, "-INT");
    let o = child.wait_with_output().unwrap();
    let (_, err) = common::text(&o);
    if o.status.success() {
        // The run finished before the signal arrived: nothing to check beyond the end state.
        eprintln!("the run ended before SIGINT");
    } else {
        assert_one_line_error(&o, &["stopped by a signal after step", "--resume"]);
        assert!(err.contains("checkpoint"), "{err}");
    }
    let run = dir.join("run");
    let o = train(&dir, "run", 60, &["--resume", run.to_str().unwrap()]);
    assert_ok(&o);
    let (want, got) = (losses(&dir, "full"), losses(&dir, "run"));
    assert_eq!(got.len(), 60);
    for ((sa, a), (sb, b)) in got.iter().zip(&want) {
        assert_eq!(sa, sb);
        assert_eq!(a.to_bits(), b.to_bits(), "step {sa}: {a} vs {b}");
    }
    assert_eq!(weights(&dir, "run"), weights(&dir, "full"));
}

#[test]
fn kill_9_at_random_moments_never_loses_the_latest_checkpoint() {
    let dir = tmpdir("resume-kill9");
    let steps = 800;
    assert_ok(&train(&dir, "full", steps, &[]));
    let run = dir.join("run");
    let ckpts = run.join("checkpoints");
    // A fixed pseudo-random sequence of delays (the test is repeatable).
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut kills = 0;
    for attempt in 0..20 {
        let resume = ckpts.join("latest").exists();
        let mut extra = vec!["--save-every", "1", "--keep", "3"];
        let r = run.to_str().unwrap().to_string();
        if resume {
            extra.extend(["--resume", &r]);
        }
        let mut child = train_cmd(&dir, "run", steps, &extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100 + next() % 300));
        if child.try_wait().unwrap().is_some() {
            let o = child.wait_with_output().unwrap();
            assert_ok(&o);
            break;
        }
        signal(&child, "-9");
        let _ = child.wait();
        kills += 1;
        // At most the one folder of the save that was killed is left over; the next start
        // removes it.
        let tmp: Vec<String> = std::fs::read_dir(&ckpts)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(".tmp"))
                    .collect()
            })
            .unwrap_or_default();
        assert!(tmp.len() <= 1, "attempt {attempt}: {tmp:?}");
    }
    eprintln!("{kills} kill -9s landed during the run");
    // On a quiet machine all 20 land mid-run; timing varies with load, so at least 10 must.
    assert!(
        kills >= 10,
        "only {kills} of 20 kills landed during the run"
    );
    // Finish the run.
    let r = run.to_str().unwrap().to_string();
    let resume: Vec<&str> = if ckpts.join("latest").exists() {
        vec!["--resume", &r, "--save-every", "1", "--keep", "3"]
    } else {
        vec!["--save-every", "1", "--keep", "3", "--overwrite"]
    };
    let o = train(&dir, "run", steps, &resume);
    assert_ok(&o);
    let tmp = std::fs::read_dir(&ckpts)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .count();
    assert_eq!(tmp, 0);
    // --keep 3: the three newest checkpoints and the pointer.
    let kept = std::fs::read_dir(&ckpts).unwrap().flatten().count();
    assert_eq!(kept, 4, "checkpoints kept");
    assert_eq!(weights(&dir, "run"), weights(&dir, "full"));
    let (want, got) = (losses(&dir, "full"), losses(&dir, "run"));
    assert_eq!(got.len(), steps);
    for ((sa, a), (sb, b)) in got.iter().zip(&want) {
        assert_eq!(sa, sb);
        assert_eq!(a.to_bits(), b.to_bits(), "step {sa}");
    }
}

#[test]
fn a_resumed_run_must_continue_the_same_model() {
    let dir = tmpdir("resume-bad");
    assert_ok(&train(&dir, "a", 4, &["--save-every", "2"]));
    let a = dir.join("a");
    let o = train(
        &dir,
        "b",
        4,
        &["--resume", a.to_str().unwrap(), "--set", "model.n_layer=2"],
    );
    assert_one_line_error(&o, &["model.n_layer is 4 in the checkpoint but 2"]);
    let o = train(&dir, "c", 2, &["--resume", a.to_str().unwrap()]);
    assert_one_line_error(&o, &["past this run's 2 steps"]);
    let o = train(
        &dir,
        "d",
        4,
        &["--resume", dir.join("nothing").to_str().unwrap()],
    );
    assert_one_line_error(&o, &["--resume"]);
    let o = train(&dir, "a", 4, &[]);
    assert_one_line_error(&o, &["already holds a run", "--resume", "--overwrite"]);
    let o = train(&dir, "e", 4, &["--save-every", "0"]);
    assert_one_line_error(&o, &["--save-every must be at least 1"]);
}

#[test]
fn eval_generate_and_export_read_training_checkpoints() {
    let dir = tmpdir("resume-read");
    // Saved by two ZeRO-3 ranks: the checkpoint holds parameter segments, not whole tensors.
    assert_ok(&train(
        &dir,
        "gpt",
        4,
        &["--layout", "fsdp=2", "--save-every", "2"],
    ));
    let data = dir.join("eval.txt");
    std::fs::write(
        &data,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let run = dir.join("gpt");
    let last = checkpoint(&dir, "gpt", 4);
    // The final model the run wrote and its last checkpoint evaluate the same.
    let a = common::loss_line(&common::eval(&run, &data));
    let b = common::loss_line(&common::eval(Path::new(&last), &data));
    assert_eq!(a.to_bits(), b.to_bits(), "{a} vs {b}");
    // An earlier checkpoint is another model.
    let c = common::loss_line(&common::eval(Path::new(&checkpoint(&dir, "gpt", 2)), &data));
    assert_ne!(a, c);
    // generate reads it too.
    let gen = |ckpt: &Path| {
        let o = bin()
            .args(["generate", "--checkpoint", ckpt.to_str().unwrap()])
            .args([
                "--prompt-tokens",
                "10,20",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ])
            .output()
            .unwrap();
        assert_ok(&o);
        common::text(&o).0.lines().last().unwrap().to_string()
    };
    assert_eq!(gen(&run), gen(Path::new(&last)));
    // export writes a Hugging Face folder with the same weights.
    let hf = dir.join("hf");
    let o = bin()
        .args(["export", "--checkpoint", run.to_str().unwrap()])
        .args(["--out", hf.to_str().unwrap()])
        .output()
        .unwrap();
    assert_ok(&o);
    assert_eq!(weights(&dir, "hf"), weights(&dir, "gpt"));
    let o = bin()
        .args(["export", "--checkpoint", data.to_str().unwrap()])
        .args(["--out", dir.join("x").to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["not a meshgrad training checkpoint"]);
}

#[test]
fn bert_resumes_under_another_layout_and_eval_reads_its_checkpoint() {
    let dir = tmpdir("resume-bert");
    let bert = [
        "--model",
        "bert",
        "--set",
        "model.n_embd=48",
        "--set",
        "model.n_head=3",
    ];
    assert_ok(&train(
        &dir,
        "full",
        6,
        &[&bert[..], &["--save-every", "3"]].concat(),
    ));
    let from = checkpoint(&dir, "full", 3);
    let o = train(
        &dir,
        "resumed",
        6,
        &[&bert[..], &["--layout", "dp=2", "--resume", &from]].concat(),
    );
    assert_ok(&o);
    let want = losses(&dir, "full");
    let got = losses(&dir, "resumed");
    assert_eq!(got.len(), 3);
    for (step, loss) in got {
        let w = want[step as usize - 1].1;
        assert!(common::rel(loss, w) <= 1e-5, "step {step}: {loss} vs {w}");
    }
    // eval reads the BERT's training checkpoint.
    let data = dir.join("mlm.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [258, 10, 260, 12, 259], \"labels\": [-100, -100, 11, -100, -100]}\n",
    )
    .unwrap();
    let o = common::eval(Path::new(&checkpoint(&dir, "full", 6)), &data);
    assert_ok(&o);
    let e = common::eval(&dir.join("full"), &data);
    assert_eq!(
        common::loss_line(&o).to_bits(),
        common::loss_line(&e).to_bits()
    );
}

#[test]
fn resume_takes_the_model_and_schedule_from_the_checkpoint() {
    let dir = tmpdir("resume-config");
    assert_ok(&train(
        &dir,
        "full",
        10,
        &["--save-every", "5", "--seed", "7"],
    ));
    let from = checkpoint(&dir, "full", 5);
    let full_metrics = std::fs::read(dir.join("full.jsonl")).unwrap();
    // No model, data, seed or steps flag: all of it comes from the checkpoint's config.
    let resumed = |tag: &str, extra: &[&str]| {
        let mut cmd = bin();
        cmd.args(["train", "--resume", &from])
            .args(["--out", dir.join(tag).to_str().unwrap()])
            .args(extra);
        cmd.output().unwrap()
    };
    let metrics = dir.join("resumed.jsonl");
    assert_ok(&resumed(
        "resumed",
        &["--metrics", metrics.to_str().unwrap()],
    ));
    let want: Vec<(u64, f64)> = losses(&dir, "full").into_iter().skip(5).collect();
    let got = losses(&dir, "resumed");
    assert_eq!(got.len(), 5);
    for ((sa, a), (sb, b)) in got.iter().zip(&want) {
        assert_eq!(sa, sb);
        assert_eq!(a.to_bits(), b.to_bits(), "step {sa}: {a} vs {b}");
    }
    assert_eq!(weights(&dir, "resumed"), weights(&dir, "full"));
    // Into another --out without --metrics: the original run's metrics file is left alone.
    assert_ok(&resumed("elsewhere", &[]));
    assert_eq!(std::fs::read(dir.join("full.jsonl")).unwrap(), full_metrics);
    // A model flag that differs from the checkpoint is still refused, naming both values.
    let o = resumed("bad", &["--set", "model.n_layer=2"]);
    assert_one_line_error(&o, &["model.n_layer is 4 in the checkpoint but 2"]);
}
