//! `meshgrad train --layout pp=P` (pipeline parallelism): every schedule (gpipe, 1f1b,
//! interleaved with 2 chunks, zb) at pp=2 and pp=4, and the compositions dp=2,tp=2,pp=2 and
//! fsdp=2,pp=2, and pp=2 with one stage recomputing its activations, give the single-device losses on the same global batch (within 1e-5 relative,
//! train and validation; gradient norms within 1e-4) and a checkpoint with the single device's
//! weights (the single device accumulating gradients over the same number of microbatches); the
//! BERT too. Each run prints the `pipeline: partition=... schedule=...
//! predicted_slowest_ms=... simulated_idle=... measured_idle=...` line; `--trace` writes a
//! Chrome trace with one track per rank; bad pipeline flags are refused in one line.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, assert_one_line_error, metrics, tmpdir};

/// Trains a tiny GPT (8 blocks, so pp=4 with 2 chunks has a block per virtual stage) for 4
/// steps into `dir/<tag>`.
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=8",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=16",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
        "train.min_lr=1e-4",
    ];
    common::train(dir, tag, 4, &sets, &[&["--lr", "1e-3"], extra].concat())
}

const GPT_LAYOUTS: [(&str, &[&str]); 11] = [
    ("pp2", &["--layout", "pp=2", "--microbatches", "2"]),
    (
        "pp2gpipe",
        &[
            "--layout",
            "pp=2",
            "--schedule",
            "gpipe",
            "--microbatches",
            "4",
        ],
    ),
    (
        "pp4",
        &[
            "--layout",
            "pp=4",
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
        ],
    ),
    (
        "pp4gpipe",
        &[
            "--layout",
            "pp=4",
            "--schedule",
            "gpipe",
            "--microbatches",
            "4",
        ],
    ),
    (
        "pp2interleaved",
        &[
            "--layout",
            "pp=2",
            "--schedule",
            "interleaved",
            "--chunks",
            "2",
            "--microbatches",
            "4",
        ],
    ),
    (
        "pp4interleaved",
        &[
            "--layout",
            "pp=4",
            "--schedule",
            "interleaved",
            "--chunks",
            "2",
            "--microbatches",
            "4",
        ],
    ),
    (
        "pp2zb",
        &[
            "--layout",
            "pp=2",
            "--schedule",
            "zb",
            "--microbatches",
            "4",
        ],
    ),
    (
        "pp4zb",
        &[
            "--layout",
            "pp=4",
            "--schedule",
            "zb",
            "--microbatches",
            "4",
            "--partition",
            "even",
        ],
    ),
    (
        "dp2tp2pp2",
        &["--layout", "dp=2,tp=2,pp=2", "--microbatches", "2"],
    ),
    (
        "pp2ckpt1",
        &[
            "--layout",
            "pp=2",
            "--microbatches",
            "2",
            "--activation-checkpointing",
            "1",
        ],
    ),
    (
        "fsdp2pp2",
        &[
            "--layout",
            "fsdp=2,pp=2",
            "--schedule",
            "zb",
            "--microbatches",
            "2",
        ],
    ),
];

/// Asserts that the checkpoint `dir/<tag>` holds the weights of `dir/<reference>`: over all
/// parameters the L2 norm of the difference is within 1e-5 of the weights' norm, and every
/// tensor is within 1e-4 of its own largest magnitude (small tensors such as biases, a few
/// AdamW steps from zero, carry the rounding of gradient sums taken in a different order:
/// AdamW normalises a gradient, so its relative rounding reaches the update unscaled).
fn assert_weights_close(dir: &Path, tag: &str, reference: &str) {
    let got = common::checkpoint_weights(dir, tag);
    let want = common::checkpoint_weights(dir, reference);
    assert_eq!(got.len(), want.len(), "{tag}");
    let (mut diff2, mut norm2) = (0f64, 0f64);
    for ((n, a), (wn, b)) in got.iter().zip(&want) {
        assert_eq!(n, wn, "{tag}");
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut worst = 0f32;
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
            diff2 += f64::from(x - y).powi(2);
            norm2 += f64::from(*y).powi(2);
        }
        assert!(
            worst <= 1e-4 * scale,
            "{tag}: {n}: {worst:e} vs scale {scale:e}"
        );
    }
    let rel = (diff2 / norm2).sqrt();
    eprintln!("{tag}: weights within {rel:.2e} (L2, relative) of {reference}");
    assert!(
        rel <= 1e-5,
        "{tag}: weights {rel:e} (L2, relative) from {reference}"
    );
}

/// The values of the `pipeline:` line of a run's output, by key.
fn pipeline_line(out: &str) -> Vec<(String, String)> {
    let line = out
        .lines()
        .find(|l| l.starts_with("pipeline: "))
        .unwrap_or_else(|| panic!("no pipeline line in:\n{out}"));
    line["pipeline: ".len()..]
        .split(' ')
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// The single-device reference of a layout: gradient accumulation over as many microbatches
/// as the layout runs in all (its `--microbatches` on each of its data-parallel ranks), so each
/// microbatch's loss is scaled and accumulated the same way.
fn reference_tag(extra: &[&str]) -> String {
    let arg = |flag: &str| extra.iter().position(|a| *a == flag).map(|i| extra[i + 1]);
    let m: usize = arg("--microbatches").map_or(1, |v| v.parse().unwrap());
    let dp: usize = arg("--layout")
        .unwrap()
        .split(',')
        .filter_map(|e| e.strip_prefix("dp=").or(e.strip_prefix("fsdp=")))
        .map(|v| v.parse::<usize>().unwrap())
        .product();
    format!("single_m{}", m * dp)
}

#[test]
fn pipeline_schedules_and_compositions_match_single_device() {
    let dir = tmpdir("pp-lockstep");
    let mut refs: Vec<String> = GPT_LAYOUTS.iter().map(|(_, e)| reference_tag(e)).collect();
    refs.sort();
    refs.dedup();
    for r in &refs {
        let m = &r["single_m".len()..];
        let o = train(&dir, r, &["--microbatches", m]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(metrics(&dir, r).len(), 4);
    }
    for (tag, extra) in GPT_LAYOUTS {
        let reference = reference_tag(extra);
        let single = metrics(&dir, &reference);
        let o = train(&dir, tag, extra);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
        let kv = pipeline_line(&out);
        let keys: Vec<&str> = kv.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "partition",
                "schedule",
                "predicted_slowest_ms",
                "simulated_idle",
                "measured_idle"
            ],
            "{tag}: {out}"
        );
        let schedule = extra
            .iter()
            .position(|a| *a == "--schedule")
            .map_or("1f1b", |i| extra[i + 1]);
        assert_eq!(kv[1].1, schedule, "{tag}");
        // One first block per virtual stage, starting at 0.
        let pp: usize = extra[1]
            .split(',')
            .find_map(|e| e.strip_prefix("pp="))
            .unwrap()
            .parse()
            .unwrap();
        let chunks = if schedule == "interleaved" { 2 } else { 1 };
        let firsts: Vec<usize> = kv[0].1.split(',').map(|b| b.parse().unwrap()).collect();
        assert_eq!(firsts.len(), pp * chunks, "{tag}: {}", kv[0].1);
        assert_eq!(firsts[0], 0, "{tag}");
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{tag}");
        for (k, v) in &kv[2..] {
            let x: f64 = v.parse().unwrap_or_else(|_| panic!("{tag}: {k}={v}"));
            assert!(x.is_finite() && x >= 0.0, "{tag}: {k}={v}");
            if k.ends_with("idle") {
                assert!(x < 1.0, "{tag}: {k}={v}");
            }
        }
    }
    for (tag, extra) in GPT_LAYOUTS {
        assert_weights_close(&dir, tag, &reference_tag(extra));
    }
}

#[test]
fn explicit_and_even_partitions_are_used_as_given() {
    let dir = tmpdir("pp-partition");
    let o = train(
        &dir,
        "explicit",
        &[
            "--layout",
            "pp=2",
            "--partition",
            "0,3",
            "--microbatches",
            "2",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(pipeline_line(&out)[0].1, "0,3");
    let o = train(
        &dir,
        "even",
        &[
            "--layout",
            "pp=4",
            "--partition",
            "even",
            "--microbatches",
            "4",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(pipeline_line(&out)[0].1, "0,2,4,6");
}

#[test]
fn trace_has_one_track_per_rank_and_a_span_per_action() {
    let dir = tmpdir("pp-trace");
    let trace = dir.join("trace.json");
    let o = train(
        &dir,
        "traced",
        &[
            "--layout",
            "pp=2",
            "--schedule",
            "gpipe",
            "--microbatches",
            "2",
            "--trace",
            trace.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json = common::read_json(&trace);
    let events = json["traceEvents"].as_array().expect("traceEvents");
    let complete: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let tracks: std::collections::BTreeSet<String> = complete
        .iter()
        .map(|e| format!("{}/{}", e["pid"], e["tid"]))
        .collect();
    assert_eq!(tracks.len(), 2, "one track per rank: {tracks:?}");
    // GPipe, 2 ranks, 2 microbatches, 4 steps: per step and rank 2 forwards, 2 backwards,
    // 2 sends and 2 receives (activations one way, gradients the other), and 2 optimizer spans
    // (the gradient reduction and the step).
    for cat in ["forward", "backward", "send", "recv", "optimizer"] {
        let n = complete.iter().filter(|e| e["cat"] == cat).count();
        assert_eq!(n, 2 * 2 * 4, "{cat} spans");
    }
}

/// Trains a tiny BERT (3 heads of 16, sequence 18, 4 layers) for 4 steps into `dir/<tag>`.
fn train_bert(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=4",
        "model.n_embd=48",
        "model.n_head=3",
        "model.block_size=18",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
    ];
    common::train(
        dir,
        tag,
        4,
        &sets,
        &[&["--model", "bert", "--lr", "1e-3"], extra].concat(),
    )
}

#[test]
fn bert_trains_in_lockstep_under_pipeline_parallelism() {
    let dir = tmpdir("pp-bert");
    let o = train_bert(&dir, "single", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let single = metrics(&dir, "single");
    for (tag, extra) in [
        ("pp2", &["--layout", "pp=2", "--microbatches", "2"][..]),
        (
            "pp2interleaved",
            &[
                "--layout",
                "pp=2",
                "--schedule",
                "interleaved",
                "--microbatches",
                "2",
            ][..],
        ),
        (
            "dp2tp3pp2zb",
            &[
                "--layout",
                "dp=2,tp=3,pp=2",
                "--schedule",
                "zb",
                "--microbatches",
                "2",
            ][..],
        ),
        (
            "fsdp2pp2",
            &[
                "--layout",
                "fsdp=2,pp=2",
                "--schedule",
                "gpipe",
                "--microbatches",
                "2",
            ][..],
        ),
    ] {
        let o = train_bert(&dir, tag, extra);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains("pipeline: partition="), "{tag}: {out}");
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
    }
}

#[test]
fn bad_pipeline_flags_are_refused_in_one_line() {
    let dir = tmpdir("pp-bad");
    for (extra, needle) in [
        (&["--schedule", "zb"][..], "need pipeline parallelism"),
        (
            &["--layout", "dp=2", "--partition", "even"][..],
            "need pipeline parallelism",
        ),
        (
            &["--layout", "pp=2", "--schedule", "1f1b", "--chunks", "2"][..],
            "--chunks is only for the interleaved schedule",
        ),
        (
            &[
                "--layout",
                "pp=4",
                "--schedule",
                "interleaved",
                "--microbatches",
                "2",
            ][..],
            "divisible by the stages",
        ),
        (
            &["--layout", "pp=16"][..],
            "16 virtual stages, but the GPT has only 8 blocks",
        ),
        (
            &["--layout", "pp=2", "--partition", "0,9"][..],
            "--partition 0,9",
        ),
        (
            &["--layout", "pp=2", "--partition", "fastest"][..],
            "--partition fastest",
        ),
        (
            &["--activation-checkpointing", "0"][..],
            "stage indices needs pipeline parallelism",
        ),
        (
            &["--layout", "pp=2", "--activation-checkpointing", "2"][..],
            "stage 2 does not exist",
        ),
        (
            &["--layout", "pp=2", "--max-stage-memory", "1KiB"][..],
            "fits the per-stage memory limit of 1.00 KiB",
        ),
        (
            &["--layout", "pp=2", "--max-stage-memory", "3 apples"][..],
            "unknown unit",
        ),
        (
            &["--layout", "pp=2", "--microbatches", "3"][..],
            "do not split evenly into 3 micro-batches",
        ),
    ] {
        let o = train(&dir, "bad", extra);
        assert_one_line_error(&o, &[needle]);
    }
}
