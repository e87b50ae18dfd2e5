//! `train --init-from DIR`: fine-tuning from a model folder. A run started from a folder
//! validates, before its first step, at the loss the run that wrote the folder ended with (the
//! same validation batches), under every layout; a transformers-written Llama folder trains
//! under tensor and pipeline parallelism in lockstep with one device; a flag that changes the
//! model's shape, a missing folder and a malformed config are refused in one line.
//! (`tests/hf_gpt2_finetune_check.py` checks the steps against PyTorch's.)

use crate::common;

use std::path::{Path, PathBuf};

use common::*;

/// The first (step 0) validation loss a run printed.
fn initial_val(o: &std::process::Output) -> f64 {
    let (out, _) = text(o);
    let line = out
        .lines()
        .find(|l| l.starts_with("step 0: val_loss="))
        .unwrap_or_else(|| panic!("no step 0 line in {out}"));
    line["step 0: val_loss=".len()..].parse().unwrap()
}

/// The last validation loss of a run's metrics.
fn final_val(dir: &Path, tag: &str) -> f64 {
    metrics(dir, tag).last().unwrap().val_loss.unwrap()
}

const SMALL: [&str; 4] = [
    "model.n_layer=2",
    "model.block_size=32",
    "train.sample_tokens=0",
    "train.eval_batches=2",
];

#[test]
fn a_run_from_a_folder_starts_where_the_folder_s_run_ended_under_every_layout() {
    let dir = tmpdir("init-from-gpt");
    assert_ok(&train(&dir, "source", 12, &SMALL, &["--save-every", "12"]));
    let ended = final_val(&dir, "source");
    let source = dir.join("source");
    let layouts: [&[&str]; 5] = [
        &[],
        &["--layout", "tp=2"],
        &["--layout", "fsdp=2"],
        &["--layout", "pp=2", "--microbatches", "2"],
        &["--layout", "dp=2,tp=2"],
    ];
    for (i, layout) in layouts.iter().enumerate() {
        let tag = format!("ft{i}");
        let extra = [&["--init-from", source.to_str().unwrap()], *layout].concat();
        let o = train(
            &dir,
            &tag,
            2,
            &["train.sample_tokens=0", "train.eval_batches=2"],
            &extra,
        );
        assert_ok(&o);
        // Printed with 4 decimals.
        assert!(
            (initial_val(&o) - ended).abs() < 6e-5,
            "{layout:?}: starts at {} but the folder's run ended at {ended}",
            initial_val(&o)
        );
    }
    // From the run's training checkpoint too.
    let ckpt = source.join("checkpoints");
    let o = train(
        &dir,
        "from_ckpt",
        1,
        &["train.sample_tokens=0", "train.eval_batches=2"],
        &["--init-from", ckpt.to_str().unwrap()],
    );
    assert_ok(&o);
    assert!((initial_val(&o) - ended).abs() < 6e-5);
    // The folder fixes the model: a shape flag is refused; dropout is the run's to choose.
    let o = train(
        &dir,
        "bad",
        1,
        &["model.n_layer=3"],
        &["--init-from", source.to_str().unwrap()],
    );
    assert_one_line_error(
        &o,
        &["--init-from", "model.n_layer is 2 in the folder but 3"],
    );
    let o = train(
        &dir,
        "bert",
        1,
        &[],
        &["--init-from", source.to_str().unwrap(), "--model", "bert"],
    );
    assert_one_line_error(&o, &["model.kind is gpt in the folder but bert"]);
    let o = train(
        &dir,
        "dropout",
        1,
        &["model.dropout=0.1", "train.sample_tokens=0"],
        &["--init-from", source.to_str().unwrap()],
    );
    assert_ok(&o);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn llama_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("nn/tests/fixtures/hf_llama/gqa_untied")
}

#[test]
fn a_transformers_llama_folder_fine_tunes_in_lockstep_under_tp_and_pp() {
    let dir = tmpdir("init-from-llama");
    // Its vocabulary is 64 ids: the data is raw little-endian u16 ids below 64.
    let ids: Vec<u8> = (0..4000u32)
        .flat_map(|i| (((i * 7 + i / 13) % 64) as u16).to_le_bytes())
        .collect();
    let data = dir.join("ids.bin");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&data, ids).unwrap();
    let sets = [
        "train.sample_tokens=0",
        "train.eval_interval=2",
        "train.batch_size=8",
    ];
    let fixture = llama_fixture();
    let base = [
        "--init-from",
        fixture.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    let o = train(&dir, "single", 4, &sets, &base);
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("Llama (2 kv heads of 4, MLP 48"), "{out}");
    let want = metrics(&dir, "single");
    for (tag, layout) in [("tp2", "tp=2"), ("pp2", "pp=2"), ("fsdp2", "fsdp=2")] {
        let o = train(
            &dir,
            tag,
            4,
            &sets,
            &[&base[..], &["--layout", layout]].concat(),
        );
        assert_ok(&o);
        assert_lockstep(tag, &metrics(&dir, tag), &want, true);
    }
    // The folder's own context length (max_position_embeddings 32) is the run's.
    assert_eq!(
        read_json(&dir.join("single/config.json"))["max_position_embeddings"],
        32
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_folders_are_refused_in_one_line() {
    let dir = tmpdir("init-from-bad");
    let missing = dir.join("nowhere");
    let o = train(
        &dir,
        "a",
        1,
        &[],
        &["--init-from", missing.to_str().unwrap()],
    );
    assert_one_line_error(&o, &["--init-from", "no such folder"]);
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let o = train(&dir, "b", 1, &[], &["--init-from", empty.to_str().unwrap()]);
    assert_one_line_error(&o, &["--init-from", "config.json"]);
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("config.json"), "{ not json").unwrap();
    let o = train(
        &dir,
        "c",
        1,
        &[],
        &["--init-from", broken.to_str().unwrap()],
    );
    assert_one_line_error(&o, &["--init-from"]);
    let o = train(
        &dir,
        "d",
        1,
        &[],
        &[
            "--init-from",
            empty.to_str().unwrap(),
            "--resume",
            empty.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    std::fs::remove_dir_all(&dir).unwrap();
}
