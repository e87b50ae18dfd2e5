//! `meshgrad train --reference` with pipeline parallelism: pp=2 under every schedule (1f1b,
//! gpipe, interleaved, zb), pp=4 (gpipe, 1f1b), dp=2,pp=2 and fsdp=2,pp=2 give the single-device
//! reference run's losses, validation losses and gradient norms (the same f64 in the metrics
//! file) and the same final weights, bit for bit; so do dp=2,tp=2,pp=2 and fsdp=2,tp=2,pp=2. What reference mode cannot run with a pipeline
//! is refused in one line.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_ok, assert_one_line_error, checkpoint_weights, tmpdir};

/// Trains a tiny GPT (4 blocks, so pp=4 has one per stage) for 10 steps in reference mode into
/// `dir/<tag>`, validating after steps 5 and 10; gradients are clipped (the norm is above 1).
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=4",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=16",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "train.eval_batches=2",
        "train.eval_interval=5",
        "train.sample_tokens=0",
        "train.grad_clip=1.0",
    ];
    common::train(dir, tag, 10, &sets, &[&["--reference"], extra].concat())
}

/// The bits of each metrics line's loss, validation loss (when there is one) and gradient norm.
fn metric_bits(dir: &Path, tag: &str) -> Vec<[Option<u64>; 3]> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            ["loss", "val_loss", "grad_norm"].map(|k| v[k].as_f64().map(f64::to_bits))
        })
        .collect()
}

/// Asserts that run `tag` logged exactly the metrics of `want` and saved exactly its weights.
fn assert_identical(dir: &Path, tag: &str, want: &str) {
    let (got_m, want_m) = (metric_bits(dir, tag), metric_bits(dir, want));
    assert_eq!(got_m.len(), 10, "{tag}: one metrics line per step");
    assert_eq!(got_m, want_m, "{tag}: metrics differ from {want}'s");
    assert!(want_m.iter().all(|m| m[0].is_some() && m[2].is_some()));
    assert_eq!(want_m.iter().filter(|m| m[1].is_some()).count(), 2);
    let (got_w, want_w) = (checkpoint_weights(dir, tag), checkpoint_weights(dir, want));
    assert_eq!(got_w.len(), want_w.len(), "{tag}");
    for ((n, a), (wn, b)) in got_w.iter().zip(&want_w) {
        assert_eq!(n, wn, "{tag}");
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{tag}: {n} differs from {want}'s");
    }
}

const LAYOUTS: [(&str, &[&str]); 10] = [
    ("pp2", &["--layout", "pp=2"]),
    ("pp2gpipe", &["--layout", "pp=2", "--schedule", "gpipe"]),
    (
        "pp2interleaved",
        &["--layout", "pp=2", "--schedule", "interleaved"],
    ),
    ("pp2zb", &["--layout", "pp=2", "--schedule", "zb"]),
    ("pp4gpipe", &["--layout", "pp=4", "--schedule", "gpipe"]),
    (
        "pp4",
        &[
            "--layout",
            "pp=4",
            "--schedule",
            "1f1b",
            "--microbatches",
            "8",
        ],
    ),
    ("dp2pp2", &["--layout", "dp=2,pp=2"]),
    // With tensor parallelism inside the stages (its chunked sums: tests/reference_tp.rs).
    ("dp2tp2pp2", &["--layout", "dp=2,tp=2,pp=2"]),
    (
        "fsdp2tp2pp2",
        &["--layout", "fsdp=2,tp=2,pp=2", "--schedule", "zb"],
    ),
    ("fsdp2pp2", &["--layout", "fsdp=2,pp=2", "--schedule", "zb"]),
];

#[test]
fn pipelines_match_the_single_device_bit_for_bit() {
    let dir = tmpdir("reference-pipeline");
    assert_ok(&train(&dir, "one", &[]));
    std::thread::scope(|s| {
        let runs: Vec<_> = LAYOUTS
            .iter()
            .map(|(tag, extra)| {
                let dir = &dir;
                s.spawn(move || (tag, train(dir, tag, extra)))
            })
            .collect();
        for r in runs {
            let (tag, out) = r.join().unwrap();
            assert_ok(&out);
            assert_identical(&dir, tag, "one");
        }
    });
    // Two sequences per row group: 4 row groups, 2 microbatches per data-parallel rank.
    assert_ok(&train(&dir, "one_rg2", &["--row-group", "2"]));
    assert_ok(&train(
        &dir,
        "dp2pp2_rg2",
        &["--layout", "dp=2,pp=2", "--row-group", "2"],
    ));
    assert_identical(&dir, "dp2pp2_rg2", "one_rg2");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_reference_pipelines_cannot_run_is_refused_in_one_line() {
    let dir = tmpdir("reference-pipeline-refused");
    // The microbatches are the row groups (8 per rank here).
    let o = train(&dir, "mb4", &["--layout", "pp=2", "--microbatches", "4"]);
    assert_one_line_error(
        &o,
        &[
            "reference mode",
            "one microbatch per row group",
            "--row-group",
        ],
    );
    // Interleaving needs the row groups of a rank divisible by the stages.
    let o = train(
        &dir,
        "int",
        &[
            "--layout",
            "pp=4",
            "--schedule",
            "interleaved",
            "--row-group",
            "4",
        ],
    );
    assert_one_line_error(&o, &["interleaved", "reference mode", "--row-group"]);
    let _ = std::fs::remove_dir_all(&dir);
}
