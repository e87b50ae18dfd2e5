//! `meshgrad train --layout` with sharded data parallelism: zero1=2, zero2=2, fsdp=2 (with
//! gradient accumulation), hsdp=2x2 and dp=2,zero2=2 (hybrid ZeRO-2) give the single-device
//! losses on the same global batch (within 1e-5 relative, train and validation; gradient norms
//! within 1e-4), and rank 0 writes the metrics and a checkpoint holding the single device's
//! weights to rounding (1e-5 of each tensor's scale).

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, metrics, tmpdir};

/// Trains a tiny model for 4 steps into `dir/<tag>`.
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
        "train.min_lr=1e-4",
    ];
    common::train(dir, tag, 4, &sets, &[&["--lr", "1e-3"], extra].concat())
}

#[test]
fn sharded_layouts_match_single_device() {
    let dir = tmpdir("zero-lockstep");
    let o = train(&dir, "single", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let single = metrics(&dir, "single");
    assert_eq!(single.len(), 4);
    for (tag, extra) in [
        ("zero1", &["--layout", "zero1=2"][..]),
        ("zero2", &["--layout", "zero2=2"][..]),
        ("fsdp", &["--layout", "fsdp=2", "--microbatches", "2"][..]),
        ("hsdp", &["--layout", "hsdp=2x2"][..]),
        // Hybrid ZeRO-2: sharded over 2 ranks, replicated twice.
        ("dp2zero2", &["--layout", "dp=2,zero2=2"][..]),
    ] {
        let o = train(&dir, tag, extra);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            out.contains(&format!("layout {}", extra[1])),
            "{tag}: {out}"
        );
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
        assert!(dir.join(tag).join("model.safetensors").exists(), "{tag}");
    }
    // The checkpoints written from gathered shards hold the single device's weights.
    common::assert_checkpoints_match(
        &dir,
        &["zero1", "zero2", "fsdp", "hsdp", "dp2zero2"],
        "single",
    );
}

/// The `peak_memory_per_rank_mib=` line `meshgrad train` prints last.
fn peak_mib(o: &Output) -> f64 {
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("peak_memory_per_rank_mib="),
        "last line {last:?}"
    );
    common::printed_number(o, "peak_memory_per_rank_mib=")
}

#[test]
fn every_run_ends_with_its_largest_ranks_peak_memory() {
    let dir = tmpdir("zero-peak");
    // Model states (about 7 MiB replicated) outweigh the activations, so sharding them shows.
    let sets = [
        "model.n_layer=2",
        "model.n_embd=128",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=8",
        "train.eval_batches=1",
        "train.sample_tokens=0",
    ];
    let run = |tag: &str, layout: &[&str]| peak_mib(&common::train(&dir, tag, 2, &sets, layout));
    let single = run("single", &[]);
    let dp = run("dp2", &["--layout", "dp=2"]);
    let fsdp = run("fsdp2", &["--layout", "fsdp=2"]);
    // Parameters, gradients and AdamW's two moments in f32: at least 4 x 4 bytes per parameter.
    let params = 2.0 * 12.0 * 128.0 * 128.0;
    let states_mib = 16.0 * params / (1024.0 * 1024.0);
    assert!(
        single > states_mib && dp > states_mib,
        "{single} {dp} vs {states_mib}"
    );
    assert!(
        fsdp < dp - 0.3 * states_mib,
        "fsdp=2 {fsdp} MiB not below dp=2 {dp} MiB"
    );
}
