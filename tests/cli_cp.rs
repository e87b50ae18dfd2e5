//! `meshgrad train --layout` with context parallelism: GPT and Llama under cp=2, cp=4,
//! dp=2,cp=2, tp=2,cp=2 (also with sequence parallelism), pp=2,cp=2 and hsdp=2x2,cp=2 (GPT also
//! zero1=2,cp=2 and fsdp=2,cp=2), the Mixtral under the same but hsdp, plus fsdp=2,cp=2 and cp with ep (also with a capacity factor under cp=2, cp=4 and
//! dp=2,cp=2), and BERT (non-causal, masked LM) under cp=2, and with all-gather attention
//! (`--cp-mode allgather`: GPT under cp=2, cp=4, dp=2,cp=2, tp=2,cp=2 and pp=2,cp=2, Llama and
//! BERT under cp=2 and cp=4, the Mixtral under cp=2), and the GPT with dropout (under the ring
//! layouts and cp=2 all-gather), give the single-device losses on the same global batch (within 1e-5 relative, train and validation;
//! gradient norms within 1e-4), 4 steps of tiny models; GPT's gathered checkpoints hold the
//! single device's weights to rounding (1e-5 of each tensor's scale), Llama's and BERT's Hugging
//! Face folders within 1e-5 relative L2 over all parameters.
//!
//! Reference mode (`--reference` with `train.reference_positions=folded`) under cp=2 (also as two
//! processes of `meshgrad launch` over TCP), cp=4 and
//! dp=2,cp=2 gives one device's reference run (in the same order) bit for bit, GPT (with
//! dropout), Llama and Mixtral (also with a capacity factor): every metrics value and the
//! weights file.
//!
//! Bad input is refused in one line: a sequence that does not split into 2 x cp chunks, BERT's
//! dropout (on the attention probabilities), reference mode without the folded order or on a
//! layout it does not cover, `--cp-mode allgather` without cp.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_lockstep, assert_one_line_error, metric_lines, metrics, tmpdir};

/// Trains a tiny `model` (4 heads, 16 positions: 8 chunks of 2 under cp=4) for 4 steps.
fn train(dir: &Path, model: &str, tag: &str, extra: &[&str]) -> Output {
    train_on(None, dir, model, tag, extra)
}

/// [`train`] as `processes` processes of `meshgrad launch` (over TCP) when given.
fn train_on(
    processes: Option<usize>,
    dir: &Path,
    model: &str,
    tag: &str,
    extra: &[&str],
) -> Output {
    let mut sets = vec![
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=16",
        "model.dropout=0",
        "train.batch_size=4",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
        "train.min_lr=1e-4",
    ];
    if model == "llama" || model == "mixtral" {
        sets.push("model.n_kv_head=2");
    }
    if model == "mixtral" {
        sets.extend(common::TINY_EXPERTS);
    }
    let flags = [&["--model", model, "--lr", "1e-3"], extra].concat();
    common::train_on(processes, dir, tag, 4, &sets, &flags)
}

/// All-gather attention (`--cp-mode allgather`) instead of the ring.
const ALLGATHER: [(&str, &str); 5] = [
    ("cp2ag", "cp=2 --cp-mode allgather"),
    ("cp4ag", "cp=4 --cp-mode allgather"),
    ("dp2cp2ag", "dp=2,cp=2 --cp-mode allgather"),
    ("tp2cp2ag", "cp=2,tp=2 --cp-mode allgather"),
    ("pp2cp2ag", "pp=2,cp=2 --cp-mode allgather"),
];

const LAYOUTS: [(&str, &str); 6] = [
    ("cp2", "cp=2"),
    ("cp4", "cp=4"),
    ("dp2cp2", "dp=2,cp=2"),
    ("tp2cp2", "cp=2,tp=2"),
    ("tp2cp2sp", "cp=2,tp=2 --sequence-parallel"),
    ("pp2cp2", "pp=2,cp=2"),
];

fn lockstep(model: &str, layouts: &[(&str, &str)]) {
    lockstep_with(model, &[], layouts)
}

/// [`lockstep`] with `extra` flags in every run.
fn lockstep_with(model: &str, extra: &[&str], layouts: &[(&str, &str)]) {
    // Tests run concurrently in one process: a run with extra flags gets a folder of its own
    // (the Mixtral tests with and without a capacity shared one, and one could remove it while
    // the other read it).
    let flags = if extra.is_empty() { "" } else { "-flags" };
    let dir = tmpdir(&format!("cp-lockstep-{model}{flags}"));
    let o = train(&dir, model, "single", extra);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let single = metrics(&dir, "single");
    assert_eq!(single.len(), 4);
    for &(tag, layout) in layouts {
        // A layout, then any flags (`cp=2,tp=2 --sequence-parallel`).
        let mut words = layout.split(' ');
        let layout = words.next().unwrap();
        let flags: Vec<&str> = ["--layout", layout]
            .into_iter()
            .chain(words)
            .chain(extra.iter().copied())
            .collect();
        let o = train(&dir, model, tag, &flags);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{model} {tag}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains(&format!("layout {layout}")), "{tag}: {out}");
        assert_lockstep(tag, &metrics(&dir, tag), &single, true);
    }
    // Final weights: a GPT's GPT-2 checkpoints tensor by tensor, a Llama's or BERT's Hugging Face
    // folders within 1e-5 relative L2 over all parameters.
    if model == "gpt" {
        let tags: Vec<&str> = layouts.iter().map(|(t, _)| *t).collect();
        common::assert_checkpoints_match(&dir, &tags, "single");
    } else {
        let single = common::hf_folder_weights(&dir, "single");
        for (tag, _) in layouts {
            common::assert_weights_close(tag, &common::hf_folder_weights(&dir, tag), &single);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gpt_trains_in_lockstep_under_context_parallelism() {
    // Sharded data parallelism shards over the data-parallel and context-parallel ranks; hybrid
    // sharding (8 ranks) replicates those shards over its replica groups.
    let sharded = [
        ("zero1cp2", "zero1=2,cp=2"),
        ("fsdp2cp2", "fsdp=2,cp=2"),
        ("hsdp2x2cp2", "hsdp=2x2,cp=2"),
    ];
    lockstep("gpt", &[&LAYOUTS[..], &sharded, &ALLGATHER].concat());
}

#[test]
fn gpt_with_dropout_trains_in_lockstep_under_context_parallelism() {
    // Each local position draws its global position's mask (the dropout is on: its run is not
    // the run without it).
    let dropout = ["--set", "model.dropout=0.1"];
    let dir = tmpdir("cp-dropout-check");
    common::assert_ok(&train(&dir, "gpt", "with", &dropout));
    common::assert_ok(&train(&dir, "gpt", "without", &[]));
    let loss = |tag| metrics(&dir, tag)[0].loss;
    assert_ne!(
        loss("with"),
        loss("without"),
        "model.dropout=0.1 changed nothing"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    lockstep_with("gpt", &dropout, &[&LAYOUTS[..], &ALLGATHER[..1]].concat());
}

#[test]
fn llama_trains_in_lockstep_under_context_parallelism() {
    lockstep(
        "llama",
        &[
            &LAYOUTS[..],
            &[("hsdp2x2cp2", "hsdp=2x2,cp=2")],
            &ALLGATHER[..2],
        ]
        .concat(),
    );
}

#[test]
fn mixtral_trains_in_lockstep_under_context_parallelism() {
    // The load-balancing loss's counts are the whole sequences' (summed over the cp group);
    // with ep the experts are sharded over the cp ranks (dp=1,cp=2,ep=2) or over dp x cp.
    let more = [
        ("cp2ep2", "dp=1,cp=2,ep=2"),
        ("dp2cp2ep4", "dp=2,cp=2,ep=4"),
        ("fsdp2cp2", "fsdp=2,cp=2"),
        ALLGATHER[0],
    ];
    lockstep("mixtral", &[&LAYOUTS[..], &more].concat());
}

#[test]
fn mixtral_with_a_capacity_trains_in_lockstep_under_context_parallelism() {
    // The capacity keeps copies in the sequence's token order across the ranks' chunks: the
    // same copies are dropped as on one device (some are: 0.75 of an even share).
    let capacity = ["--set", "model.expert_capacity_factor=0.75"];
    lockstep_with(
        "mixtral",
        &capacity,
        &[("cp2", "cp=2"), ("cp4", "cp=4"), ("dp2cp2", "dp=2,cp=2")],
    );
}

#[test]
fn bert_trains_in_lockstep_under_context_parallelism() {
    lockstep("bert", &[("cp2", "cp=2"), ALLGATHER[0], ALLGATHER[1]]);
}

/// `model` in reference mode's folded order on one device, then under cp=2, cp=4 and
/// dp=2,cp=2: every metrics value and the weights file must be the same bits.
fn reference_is_bit_identical(tag: &str, model: &str, extra: &[&str]) {
    let dir = tmpdir(&format!("cp-reference-{tag}"));
    // 4 row groups of one row: 2 per rank under dp=2,cp=2.
    let reference = [
        &[
            "--reference",
            "--set",
            "train.row_group=1",
            "--set",
            "train.reference_positions=folded",
        ][..],
        extra,
    ]
    .concat();
    common::assert_ok(&train(&dir, model, "single", &reference));
    let want = metric_lines(&dir, "single");
    assert_eq!(want.len(), 4);
    let weights = |tag: &str| std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    let single = weights("single");
    for (tag, layout) in [("cp2", "cp=2"), ("cp4", "cp=4"), ("dp2cp2", "dp=2,cp=2")] {
        let o = train(
            &dir,
            model,
            tag,
            &[&reference[..], &["--layout", layout]].concat(),
        );
        common::assert_ok(&o);
        assert_eq!(
            metric_lines(&dir, tag),
            want,
            "{model} {tag}: metrics differ"
        );
        assert!(weights(tag) == single, "{model} {tag}: weights differ");
    }
    // cp=2 as two processes of `meshgrad launch`: the same bits over TCP.
    let layout = ["--layout", "cp=2"];
    let o = train_on(
        Some(2),
        &dir,
        model,
        "cp2tcp",
        &[&reference[..], &layout].concat(),
    );
    common::assert_ok(&o);
    assert_eq!(metric_lines(&dir, "cp2tcp"), want, "{model} cp=2 over TCP");
    assert!(
        weights("cp2tcp") == single,
        "{model} cp=2 over TCP: weights differ"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gpt_reference_runs_are_bit_identical_to_one_device_under_context_parallelism() {
    // With dropout: each local position draws its global position's mask.
    reference_is_bit_identical("gpt", "gpt", &["--set", "model.dropout=0.1"]);
}

#[test]
fn llama_reference_runs_are_bit_identical_to_one_device_under_context_parallelism() {
    // Four kv heads: the reference chunk count (4 position leaves) must divide by cp = 4.
    reference_is_bit_identical("llama", "llama", &["--set", "model.n_kv_head=4"]);
}

#[test]
fn mixtral_reference_runs_are_bit_identical_to_one_device_under_context_parallelism() {
    // The layer runs once per position leaf (router, experts and the leaf's part of the
    // load-balancing loss) after counting the whole sequences' routed copies.
    reference_is_bit_identical("mixtral", "mixtral", &["--set", "model.n_kv_head=4"]);
}

#[test]
fn mixtral_reference_runs_with_a_capacity_are_bit_identical_under_context_parallelism() {
    // Each leaf's two chunks start from the copies the sequence routed before them (counted
    // per fine chunk over the group): the copies one device keeps, in token order.
    let capacity = [
        "--set",
        "model.n_kv_head=4",
        "--set",
        "model.expert_capacity_factor=0.75",
    ];
    // The folded order drops the copies a plain one-device run drops (at the first step, from
    // the same weights), and some are dropped.
    let dir = tmpdir("cp-reference-capacity-drops");
    let folded = ["--reference", "--set", "train.reference_positions=folded"];
    common::assert_ok(&train(&dir, "mixtral", "plain", &capacity));
    common::assert_ok(&train(
        &dir,
        "mixtral",
        "folded",
        &[&capacity[..], &folded].concat(),
    ));
    let dropped = |tag: &str| -> f64 {
        let text = std::fs::read_to_string(dir.join(format!("{tag}.jsonl"))).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        first["expert_tokens_dropped"].as_f64().unwrap()
    };
    assert!(dropped("plain") > 0.0, "no copy dropped");
    assert_eq!(
        dropped("folded"),
        dropped("plain"),
        "copies dropped at step 1"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    reference_is_bit_identical("mixtral-capacity", "mixtral", &capacity);
}

#[test]
fn what_context_parallelism_does_not_support_is_refused_in_one_line() {
    let dir = tmpdir("cp-refusals");
    for (extra, needle) in [
        (
            &["--layout", "cp=3"][..],
            "sequence length 16 does not split into 2 x cp = 6 equal chunks",
        ),
        (
            &["--layout", "cp=2", "--reference"][..],
            "pass --set train.reference_positions=folded",
        ),
        (
            &["--layout", "dp=2", "--cp-mode", "allgather"][..],
            "--cp-mode allgather needs context parallelism",
        ),
        (
            &[
                "--layout",
                "cp=2,tp=2",
                "--reference",
                "--set",
                "train.reference_positions=folded",
            ][..],
            "train.reference_positions=folded covers dp and cp layouts, not",
        ),
    ] {
        assert_one_line_error(&train(&dir, "gpt", "refused", extra), &[needle]);
    }
    // BERT's dropout includes the attention probabilities, which the ring never forms.
    assert_one_line_error(
        &train(
            &dir,
            "bert",
            "refused-bert",
            &["--layout", "cp=2", "--set", "model.dropout=0.1"],
        ),
        &["BERT's attention-probability dropout (model.dropout = 0.1) does not run"],
    );
}
