//! `meshgrad train --layout` with expert parallelism: a tiny Mixtral-style Llama (4 experts, top
//! 2) under ep=2, ep=4, dp=4,ep=2, fsdp=4,ep=2, hsdp=2x2,ep=2, zero1=4,ep=2, zero2=4,ep=2,
//! fsdp=2,ep=2, pp=2,ep=2, tp=2 and tp=2,ep=2, the last two also with sequence parallelism
//! (under ZeRO the experts sharded over the ranks holding the same ones) gives the single-device losses on the same global batch
//! (within 1e-5 relative, train and validation; gradient norms within 1e-4) for 4 steps, and
//! the same for ep=2 as two processes of `meshgrad launch` over TCP; its Hugging Face folder holds the single device's weights within 1e-5 relative L2 over all
//! parameters (every expert gathered under its full name); fsdp=4 and hsdp=2x2 without ep, and
//! fsdp=4,ep=2 and zero2=4,ep=2, with 8 experts some of which get no tokens on some ranks, also
//! train in lockstep, and so does fsdp=16,ep=8 with 16 experts, one per token, where a rank's
//! two experts often get no tokens at all while their other holder's do. Bad input is
//! refused in one line: ep
//! that does not divide the experts or the data-parallel ranks, ep on a model without experts.
//!
//! Reference mode (`--reference`) under ep=2, ep=4, dp=4,ep=2, fsdp=4,ep=2, hsdp=2x2,ep=2,
//! zero1=4,ep=2, zero2=4,ep=2, fsdp=2,ep=2, tp=2,ep=2 (also with sequence parallelism) and
//! pp=2,ep=2 gives one device's reference run bit for bit: every metrics value
//! and the weights file; and a checkpoint moves between one device and ep=2 / ep=4 / dp=4,ep=2
//! / fsdp=4,ep=2 (and from zero1=4,ep=2 to hsdp=2x2,ep=2 and zero2=4,ep=2, from fsdp=4,ep=2 to
//! fsdp=2,ep=2) with the resumed run continuing the
//! uninterrupted one bit for bit (weights and optimizer state restored).

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, assert_one_line_error, metric_lines, metrics, tmpdir};

/// Trains a tiny Mixtral (or `model`) for 4 steps: 8 rows of 16 tokens, 4 experts, top 2.
fn train(dir: &Path, model: &str, tag: &str, extra: &[&str]) -> Output {
    train_on(dir, model, tag, None, extra)
}

/// [`train`] as `n` processes of `meshgrad launch` (over TCP) when `n` is given, else as the
/// ranks' threads of one process.
fn train_on(dir: &Path, model: &str, tag: &str, n: Option<usize>, extra: &[&str]) -> Output {
    let mut sets = vec![
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=16",
        "model.dropout=0",
        "train.batch_size=8",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
        "train.min_lr=1e-4",
    ];
    if model != "gpt" {
        sets.push("model.n_kv_head=2");
    }
    if model == "mixtral" {
        sets.extend(common::TINY_EXPERTS);
    }
    let mut c = common::bin();
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        c.env_remove(v);
    }
    c.env_remove("MESHGRAD_BACKEND");
    if let Some(n) = n {
        c.args(["launch", "--nproc-per-node", &n.to_string(), "--"]);
    }
    c.args(["train", "--steps", "4"])
        .args(["--out", dir.join(tag).to_str().unwrap()])
        .args([
            "--metrics",
            dir.join(format!("{tag}.jsonl")).to_str().unwrap(),
        ]);
    for s in sets {
        c.args(["--set", s]);
    }
    c.args(["--model", model, "--lr", "1e-3"])
        .args(extra)
        .output()
        .unwrap()
}

fn assert_lockstep_layouts(dir: &Path, layouts: &[(&str, &str)], extra: &[&str]) {
    assert_lockstep_on(dir, layouts, None, extra)
}

fn assert_lockstep_on(dir: &Path, layouts: &[(&str, &str)], n: Option<usize>, extra: &[&str]) {
    let single = metrics(dir, "single");
    assert_eq!(single.len(), 4);
    let single_w = common::hf_folder_weights(dir, "single");
    for (tag, layout) in layouts {
        let o = train_on(
            dir,
            "mixtral",
            tag,
            n,
            &[&["--layout", layout][..], extra].concat(),
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_lockstep(tag, &metrics(dir, tag), &single, true);
        common::assert_weights_close(tag, &common::hf_folder_weights(dir, tag), &single_w);
    }
}

#[test]
fn mixtral_trains_in_lockstep_under_expert_parallelism() {
    let dir = tmpdir("ep-lockstep");
    common::assert_ok(&train(&dir, "mixtral", "single", &[]));
    assert_lockstep_layouts(
        &dir,
        &[("ep2", "ep=2"), ("ep4", "ep=4"), ("dp4ep2", "dp=4,ep=2")],
        &[],
    );
    // Tensor parallelism splits the attention; the mixtures of experts stay whole on both
    // tensor-parallel ranks (routing the same tokens), alone and with ep=2 (4 ranks); under
    // sequence parallelism they gather the sequence first.
    assert_lockstep_layouts(&dir, &[("tp2", "tp=2"), ("tp2ep2", "tp=2,ep=2")], &[]);
    assert_lockstep_layouts(
        &dir,
        &[("tp2sp", "tp=2"), ("tp2ep2sp", "tp=2,ep=2")],
        &["--sequence-parallel"],
    );
    // Sharded data parallelism: the other parameters sharded over the 4 ranks (ZeRO-3,
    // hybrid, ZeRO-1, ZeRO-2), each expert sharded at the same stage over the 2 ranks that
    // hold it; and over 2 ranks (fsdp=2,ep=2), where no other rank holds the same experts.
    assert_lockstep_layouts(
        &dir,
        &[
            ("fsdp4ep2", "fsdp=4,ep=2"),
            ("hsdp2x2ep2", "hsdp=2x2,ep=2"),
            ("zero1ep2", "zero1=4,ep=2"),
            ("zero2ep2", "zero2=4,ep=2"),
            ("fsdp2ep2", "fsdp=2,ep=2"),
        ],
        &[],
    );
    // Two pipeline stages, each with its expert-parallel pair, two microbatches per rank.
    assert_lockstep_layouts(&dir, &[("pp2ep2", "pp=2,ep=2")], &["--microbatches", "2"]);
    // Two processes over TCP (`meshgrad launch`): the all-to-alls over sockets.
    assert_lockstep_on(&dir, &[("ep2tcp", "ep=2")], Some(2), &[]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ZeRO-3 without expert parallelism shards the experts with the rest; with 8 experts some get
/// no tokens on some ranks in a step, so a block's unit completes its gradients on one rank and
/// not on another: its reduction must wait for the backward's end on every rank, or the ranks'
/// reduce-scatters and all-gathers interleave differently (mismatched collectives). With
/// expert parallelism the experts are sharded over the ranks holding the same ones, in units of
/// their own: the same holds for them, and a rank whose experts of a block got no tokens still
/// gathers them when the others do.
#[test]
fn mixtral_trains_in_lockstep_under_fsdp_with_experts_left_unused() {
    let dir = tmpdir("ep-fsdp-unused");
    let more = ["--set", "model.n_experts=8", "--set", "model.n_layer=4"];
    common::assert_ok(&train(&dir, "mixtral", "single", &more));
    assert_lockstep_layouts(
        &dir,
        &[
            ("fsdp4", "fsdp=4"),
            ("hsdp2x2", "hsdp=2x2"),
            ("fsdp4ep2", "fsdp=4,ep=2"),
            ("zero2ep2", "zero2=4,ep=2"),
        ],
        &more,
    );
    std::fs::remove_dir_all(&dir).unwrap();
    // 16 experts, one per token, rows of 4 tokens: under fsdp=16,ep=8 a rank holds 2 experts,
    // sharded over the 2 ranks holding them, and often neither gets a token on one of the two
    // while the other's do. Both still gather them, in the forward and in the backward (without
    // that, measured: the ranks' collectives mismatch and the run times out).
    let dir = tmpdir("ep-fsdp-no-tokens");
    let more = [
        &common::IDLE_EXPERTS[..],
        &["--set", "train.batch_size=16", "--collective-timeout", "30"],
    ]
    .concat();
    common::assert_ok(&train(&dir, "mixtral", "single", &more));
    assert_lockstep_layouts(&dir, &[("fsdp16ep8", "fsdp=16,ep=8")], &more);
    // Gradient accumulation (2 microbatches of one row per rank, the first with sync off): a
    // unit whose experts got no tokens in one microbatch's backward does not complete there,
    // and the gradients its experts got with sync off are still added (they were lost before,
    // measured: fsdp=8 and zero1=8 0.0043% off in the loss at step 4), and it stays gathered
    // until the others' is (released on completion on one rank only, the next forward gathered
    // it there alone and the collectives mismatched).
    let accumulate = [&more[..], &["--microbatches", "2"]].concat();
    assert_lockstep_layouts(
        &dir,
        &[
            ("fsdp8mb2", "fsdp=8"),
            ("zero1x8mb2", "zero1=8"),
            ("fsdp8ep4mb2", "fsdp=8,ep=4"),
            ("zero1x8ep4mb2", "zero1=8,ep=4"),
        ],
        &accumulate,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mixtral_reference_runs_are_bit_identical_to_one_device_under_expert_parallelism() {
    let dir = tmpdir("ep-reference");
    // 8 row groups of one row: 4 per rank under ep=2, 2 under ep=4, 2 per rank and 4 per
    // expert-parallel pair under dp=4,ep=2.
    let reference = ["--reference", "--set", "train.row_group=1"];
    common::assert_ok(&train(&dir, "mixtral", "single", &reference));
    let want = metric_lines(&dir, "single");
    assert_eq!(want.len(), 4);
    assert!(want.iter().all(|l| l.contains("\"expert_tokens_max\"")));
    let weights = std::fs::read(dir.join("single").join("model.safetensors")).unwrap();
    for (tag, layout) in [
        ("ep2", "ep=2"),
        ("ep4", "ep=4"),
        ("dp4ep2", "dp=4,ep=2"),
        ("fsdp4ep2", "fsdp=4,ep=2"),
        ("hsdp2x2ep2", "hsdp=2x2,ep=2"),
        ("zero1ep2", "zero1=4,ep=2"),
        ("zero2ep2", "zero2=4,ep=2"),
        ("fsdp2ep2", "fsdp=2,ep=2"),
        ("tp2ep2", "tp=2,ep=2"),
        ("tp2ep2sp", "tp=2,ep=2 --sequence-parallel"),
        ("pp2ep2", "pp=2,ep=2"),
    ] {
        // A layout, then any flags.
        let mut words = layout.split(' ');
        let layout = ["--layout", words.next().unwrap()];
        let flags: Vec<&str> = layout.into_iter().chain(words).collect();
        common::assert_ok(&train(
            &dir,
            "mixtral",
            tag,
            &[&reference[..], &flags].concat(),
        ));
        assert_eq!(metric_lines(&dir, tag), want, "{tag}: metrics differ");
        let got = std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
        assert!(got == weights, "{tag}: weights differ from one device's");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn checkpoints_move_between_one_device_and_expert_parallelism() {
    let dir = tmpdir("ep-resume");
    // Reference mode: a resumed run must continue the uninterrupted one bit for bit.
    let reference = ["--reference", "--set", "train.row_group=1"];
    let go = |tag: &str, extra: &[&str]| {
        common::assert_ok(&train(
            &dir,
            "mixtral",
            tag,
            &[&reference[..], extra].concat(),
        ))
    };
    go("single", &[]);
    go("saved_ep2", &["--layout", "ep=2", "--save-every", "2"]);
    go("saved_single", &["--save-every", "2"]);
    // Under a sharding entry the dense parameters are saved as ZeRO segments, the experts as
    // segments of their own wrapper's (sharded over the 2 ranks holding them), each with its
    // optimizer state.
    go(
        "saved_fsdp4ep2",
        &["--layout", "fsdp=4,ep=2", "--save-every", "2"],
    );
    go(
        "saved_zero1ep2",
        &["--layout", "zero1=4,ep=2", "--save-every", "2"],
    );
    let step2 = |tag: &str| {
        let ck = dir.join(tag).join("checkpoints").join("step-000002");
        ck.to_str().unwrap().to_string()
    };
    // Every expert is saved under its global name: ep=2's checkpoint resumes on one device,
    // and one device's under ep=4 and dp=4,ep=2.
    go("ep2_to_single", &["--resume", &step2("saved_ep2")]);
    go(
        "single_to_ep4",
        &["--layout", "ep=4", "--resume", &step2("saved_single")],
    );
    go(
        "ep2_to_dp4ep2",
        &["--layout", "dp=4,ep=2", "--resume", &step2("saved_ep2")],
    );
    go(
        "fsdp4ep2_to_single",
        &["--resume", &step2("saved_fsdp4ep2")],
    );
    go(
        "fsdp4ep2_to_dp4ep2",
        &[
            "--layout",
            "dp=4,ep=2",
            "--resume",
            &step2("saved_fsdp4ep2"),
        ],
    );
    go(
        "single_to_fsdp4ep2",
        &[
            "--layout",
            "fsdp=4,ep=2",
            "--resume",
            &step2("saved_single"),
        ],
    );
    go(
        "zero1ep2_to_hsdp2x2ep2",
        &[
            "--layout",
            "hsdp=2x2,ep=2",
            "--resume",
            &step2("saved_zero1ep2"),
        ],
    );
    // The experts' shards move to other shardings of them: whole on their one holder
    // (fsdp=2,ep=2), ZeRO-2 over their 2 holders.
    go(
        "fsdp4ep2_to_fsdp2ep2",
        &[
            "--layout",
            "fsdp=2,ep=2",
            "--resume",
            &step2("saved_fsdp4ep2"),
        ],
    );
    go(
        "zero1ep2_to_zero2ep2",
        &[
            "--layout",
            "zero2=4,ep=2",
            "--resume",
            &step2("saved_zero1ep2"),
        ],
    );
    let want = metric_lines(&dir, "single");
    let weights = |tag: &str| std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    for tag in ["saved_fsdp4ep2", "saved_zero1ep2"] {
        assert_eq!(metric_lines(&dir, tag), want, "{tag}: metrics differ");
    }
    for tag in [
        "ep2_to_single",
        "single_to_ep4",
        "ep2_to_dp4ep2",
        "fsdp4ep2_to_single",
        "fsdp4ep2_to_dp4ep2",
        "single_to_fsdp4ep2",
        "zero1ep2_to_hsdp2x2ep2",
        "fsdp4ep2_to_fsdp2ep2",
        "zero1ep2_to_zero2ep2",
    ] {
        assert_eq!(
            metric_lines(&dir, tag),
            want[2..],
            "{tag}: steps 3 and 4 differ"
        );
        assert!(weights(tag) == weights("single"), "{tag}: weights differ");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn expert_parallelism_refuses_bad_layouts_in_one_line() {
    let dir = tmpdir("ep-refusals");
    // 4 experts over 3 ranks (12 rows split over them).
    let rows = ["--set", "train.batch_size=12"];
    let o = train(
        &dir,
        "mixtral",
        "e3",
        &[&rows[..], &["--layout", "dp=3,ep=3"]].concat(),
    );
    assert_one_line_error(&o, &["ep = 3 does not divide the 4 experts"]);
    // ep=2 over 3 data-parallel ranks.
    let o = train(&dir, "mixtral", "d3", &["--layout", "dp=3,ep=2"]);
    assert_one_line_error(&o, &["ep = 2 does not divide the 3 data-parallel ranks"]);
    // A model without experts.
    let o = train(&dir, "llama", "llama", &["--layout", "ep=2"]);
    assert_one_line_error(&o, &["expert parallelism (ep) needs a model with experts"]);
    let o = train(&dir, "gpt", "gpt", &["--layout", "ep=2"]);
    assert_one_line_error(&o, &["expert parallelism (ep) needs a model with experts"]);
    // Reference mode needs each expert-parallel group's row groups to form a subtree.
    let o = train(
        &dir,
        "mixtral",
        "ref",
        &["--layout", "dp=6,ep=3", "--reference"]
            .iter()
            .chain(&["--set", "train.batch_size=12", "--set", "model.n_experts=3"])
            .copied()
            .collect::<Vec<_>>(),
    );
    assert_one_line_error(&o, &["ep = 3", "must be a power of two"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
