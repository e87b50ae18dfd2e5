//! `meshgrad train --reference`: runs under every layout that splits the batch (data parallel,
//! ZeRO-1/2/3, hybrid sharding, micro-batches; for BERT also pipelines, whose GPT runs
//! `tests/reference_pipeline.rs` checks) write the same metrics strings (loss, validation
//! loss, gradient norm) and byte-identical weights as the single-device reference run, for the
//! GPT and for BERT; what reference mode does not cover is refused in one line.

use crate::common;

use common::{assert_ok, assert_one_line_error, tmpdir, train};
use std::path::Path;

/// A small model, 10 steps, validation after steps 5 and 10, clipping on (the default 1.0).
const SETS: &[&str] = &[
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.block_size=16",
    "train.batch_size=8",
    "train.eval_interval=5",
    "train.eval_batches=2",
    "train.sample_tokens=0",
    "train.warmup_steps=1",
];

/// The loss, validation loss and gradient norm of every metrics line, as the file writes them.
fn metric_strings(dir: &Path, tag: &str) -> Vec<[String; 3]> {
    std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            ["loss", "val_loss", "grad_norm"].map(|k| v[k].to_string())
        })
        .collect()
}

/// Steps of every run.
const STEPS: usize = 10;

/// Trains `tag` with `extra` flags (reference mode) and checks that it succeeded.
fn run(dir: &Path, tag: &str, sets: &[&str], extra: &[&str]) {
    let mut args = vec!["--reference"];
    args.extend_from_slice(extra);
    let o = train(dir, tag, STEPS, sets, &args);
    assert_ok(&o);
}

/// Every run in `tags` equals `reference` bit for bit: metrics strings and weight file bytes.
fn assert_identical(dir: &Path, tags: &[&str], reference: &str) {
    let want = metric_strings(dir, reference);
    assert_eq!(want.len(), STEPS);
    // Each step logged a loss and a gradient norm; validation after steps 5 and 10.
    assert!(want.iter().all(|m| m[0] != "null" && m[2] != "null"));
    let validated: Vec<usize> = (0..STEPS).filter(|&i| want[i][1] != "null").collect();
    assert_eq!(validated, [4, 9]);
    let weights = std::fs::read(dir.join(reference).join("model.safetensors")).unwrap();
    for tag in tags {
        assert_eq!(metric_strings(dir, tag), want, "{tag}: metrics differ");
        let got = std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
        assert!(got == weights, "{tag}: weights differ from {reference}'s");
    }
}

#[test]
fn gpt_is_bit_identical_under_every_batch_layout() {
    let dir = tmpdir("reference_gpt");
    run(&dir, "single", SETS, &[]);
    let layouts: &[(&str, &[&str])] = &[
        ("micro2", &["--microbatches", "2"]),
        ("micro4", &["--microbatches", "4"]),
        ("dp2", &["--layout", "dp=2"]),
        ("dp4", &["--layout", "dp=4"]),
        ("zero1", &["--layout", "zero1=4"]),
        ("zero2", &["--layout", "zero2=4"]),
        ("fsdp4", &["--layout", "fsdp=4"]),
        ("hsdp", &["--layout", "hsdp=2x2"]),
        (
            "dp2zero1",
            &["--layout", "dp=2,zero1=2", "--microbatches", "2"],
        ),
    ];
    for (tag, extra) in layouts {
        run(&dir, tag, SETS, extra);
    }
    // One rayon thread instead of the default pool: the kernels' sums do not depend on it.
    let out = dir.join("threads1");
    let o = common::bin()
        .env("RAYON_NUM_THREADS", "1")
        .args([
            "train",
            "--reference",
            "--steps",
            &STEPS.to_string(),
            "--layout",
            "dp=2",
        ])
        .args(["--out", out.to_str().unwrap()])
        .args(["--metrics", dir.join("threads1.jsonl").to_str().unwrap()])
        .args(SETS.iter().flat_map(|s| ["--set", s]))
        .output()
        .unwrap();
    assert_ok(&o);
    let mut tags: Vec<&str> = layouts.iter().map(|(t, _)| *t).collect();
    tags.push("threads1");
    assert_identical(&dir, &tags, "single");
    // Without the tensor-parallel chunked sums (the cheaper setting) the batch layouts agree
    // among themselves too.
    let plain = ["--set", "train.reference_chunks=1"];
    run(&dir, "plain_single", SETS, &plain);
    run(
        &dir,
        "plain_fsdp4",
        SETS,
        &[&plain[..], &["--layout", "fsdp=4"]].concat(),
    );
    run(
        &dir,
        "plain_hsdp",
        SETS,
        &[&plain[..], &["--layout", "hsdp=2x2"]].concat(),
    );
    assert_identical(&dir, &["plain_fsdp4", "plain_hsdp"], "plain_single");
}

#[test]
fn bert_is_bit_identical_under_every_batch_layout() {
    let dir = tmpdir("reference_bert");
    let mut sets = SETS.to_vec();
    sets.push("model.kind=bert");
    run(&dir, "single", &sets, &[]);
    let layouts: &[(&str, &[&str])] = &[
        ("micro2", &["--microbatches", "2"]),
        ("dp2", &["--layout", "dp=2"]),
        ("fsdp2", &["--layout", "fsdp=2"]),
        ("hsdp", &["--layout", "hsdp=2x2"]),
        ("pp2", &["--layout", "pp=2"]),
        ("dp2pp2zb", &["--layout", "dp=2,pp=2", "--schedule", "zb"]),
    ];
    for (tag, extra) in layouts {
        run(&dir, tag, &sets, extra);
    }
    let tags: Vec<&str> = layouts.iter().map(|(t, _)| *t).collect();
    assert_identical(&dir, &tags, "single");
}

#[test]
fn three_ranks_fit_when_each_owns_a_power_of_two_of_row_groups() {
    // 12 row groups: the tree splits them 8 + 4, and blocks of 4 are three of its nodes.
    let dir = tmpdir("reference_dp3");
    let mut sets = SETS.to_vec();
    sets.push("train.batch_size=12");
    run(&dir, "single", &sets, &[]);
    run(&dir, "dp3", &sets, &["--layout", "dp=3"]);
    assert_identical(&dir, &["dp3"], "single");
    // Two ranks would own 6 row groups each, which no node of the tree covers.
    let o = train(&dir, "dp2", 2, &sets, &["--reference", "--layout", "dp=2"]);
    assert_one_line_error(
        &o,
        &[
            "data-parallel degree 2",
            "power of two per rank",
            "12 row groups",
        ],
    );
}

#[test]
fn what_reference_mode_cannot_make_exact_is_refused() {
    let dir = tmpdir("reference_refused");
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--layout", "dp=3"],
            &[
                "data-parallel degree 3",
                "power of two per rank",
                "8 row groups",
            ],
        ),
        (&["--row-group", "3"], &["row_group 3 does not divide", "8"]),
        (&["--precision", "bf16"], &["reference mode trains in f32"]),
        (
            &["--set", "train.reference_chunks=3"],
            &["train.reference_chunks 3", "power of two dividing 4"],
        ),
        (
            &["--set", "train.reference_chunks=1", "--layout", "tp=2"],
            &["tp = 2", "1 reference chunk(s)", "train.reference_chunks 1"],
        ),
    ];
    for (i, (extra, needles)) in cases.iter().enumerate() {
        let mut args = vec!["--reference"];
        args.extend_from_slice(extra);
        let o = train(&dir, &format!("r{i}"), 2, SETS, &args);
        assert_one_line_error(&o, needles);
    }
}

#[test]
fn a_run_resumed_under_another_layout_continues_bit_for_bit() {
    let dir = tmpdir("reference_resume");
    let steps = 6;
    let sets = SETS.to_vec();
    let go = |tag: &str, extra: &[&str]| {
        let mut args = vec!["--reference"];
        args.extend_from_slice(extra);
        assert_ok(&train(&dir, tag, steps, &sets, &args));
    };
    go("single", &[]);
    go("saved", &["--layout", "fsdp=2", "--save-every", "3"]);
    let ck = dir.join("saved/checkpoints/step-000003");
    go(
        "resumed",
        &["--layout", "dp=4", "--resume", ck.to_str().unwrap()],
    );
    let (want, got) = (
        metric_strings(&dir, "single"),
        metric_strings(&dir, "resumed"),
    );
    assert_eq!(got.len(), 3, "the resumed run logs steps 4..6");
    assert_eq!(got, want[3..]);
    let weights = |tag: &str| std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    assert!(weights("resumed") == weights("single"));
}
