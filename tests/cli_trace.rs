//! `meshgrad train --trace` beyond pipelines: the Chrome trace of a context-parallel run holds
//! every ring attention hop (forward, backward and the hop that brings the keys' and values'
//! gradients home) and that of an expert-parallel run every all-to-all, as `collective` spans
//! inside the backward spans of the rank that made them.

use crate::common;

use std::path::Path;

use common::tmpdir;
use serde_json::Value;

/// Trains a tiny `model` (2 layers, 16 positions) for 2 steps with `extra` and `--trace`, and
/// returns the trace's complete events.
fn traced(dir: &Path, model: &str, extra: &[&str]) -> Vec<Value> {
    let trace = dir.join(format!("{model}.json"));
    let mut sets = vec![
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=4",
        "model.block_size=16",
        "model.dropout=0",
        "train.batch_size=4",
        "train.eval_interval=100",
        "train.sample_tokens=0",
    ];
    if model == "mixtral" {
        sets.extend([
            "model.n_kv_head=2",
            "model.intermediate_size=16",
            "model.n_experts=4",
            "model.experts_per_token=2",
        ]);
    }
    let o = common::train(
        dir,
        model,
        2,
        &sets,
        &[
            &["--model", model, "--trace", trace.to_str().unwrap()][..],
            extra,
        ]
        .concat(),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("trace: "), "{out}");
    let json = common::read_json(&trace);
    json["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["ph"] == "X")
        .cloned()
        .collect()
}

/// The `collective` spans of rank `rank` whose name contains `needle`.
fn collectives<'a>(events: &'a [Value], rank: u64, needle: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["cat"] == "collective" && e["tid"] == rank)
        .filter(|e| e["name"].as_str().unwrap().contains(needle))
        .collect()
}

/// Whether span `inner` lies within a span of category `cat` on the same rank.
fn inside(events: &[Value], inner: &Value, cat: &str) -> bool {
    let (ts, dur) = (
        inner["ts"].as_f64().unwrap(),
        inner["dur"].as_f64().unwrap(),
    );
    events.iter().any(|e| {
        e["cat"] == cat
            && e["tid"] == inner["tid"]
            && e["ts"].as_f64().unwrap() <= ts
            && ts + dur <= e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()
    })
}

#[test]
fn a_context_parallel_trace_shows_the_ring_hops() {
    let dir = tmpdir("trace-cp");
    let events = traced(&dir, "gpt", &["--layout", "cp=2"]);
    // Per rank, step and layer: one forward hop (2 ranks: 1 hop), one backward hop and the hop
    // home; 2 steps x 2 layers.
    for rank in 0..2u64 {
        let fwd = collectives(&events, rank, "ring hop 1/1 forward");
        let bwd = collectives(&events, rank, "ring hop 1/1 backward");
        let home = collectives(&events, rank, "ring hop home backward");
        assert!(fwd.len() >= 4, "rank {rank}: {} forward hops", fwd.len());
        assert_eq!(bwd.len(), 4, "rank {rank}: backward hops");
        assert_eq!(home.len(), 4, "rank {rank}: hops home");
        for e in fwd.iter().chain(&bwd).chain(&home) {
            assert!(e["name"].as_str().unwrap().starts_with("cp["), "{e}");
        }
        for e in bwd.iter().chain(&home) {
            assert!(
                inside(&events, e, "backward"),
                "not in a backward span: {e}"
            );
        }
    }
    assert!(collectives(&events, 0, "all_to_all").is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_expert_parallel_trace_shows_the_all_to_alls() {
    let dir = tmpdir("trace-ep");
    let events = traced(&dir, "mixtral", &["--layout", "ep=2"]);
    // Per rank, step and layer: the tokens go to their experts and come back (two all-to-alls
    // forward, two backward); 2 steps x 2 layers.
    for rank in 0..2u64 {
        let fwd = collectives(&events, rank, "all_to_all forward");
        let bwd = collectives(&events, rank, "all_to_all backward");
        assert!(
            fwd.len() >= 8,
            "rank {rank}: {} forward all-to-alls",
            fwd.len()
        );
        assert_eq!(bwd.len(), 8, "rank {rank}: backward all-to-alls");
        for e in fwd.iter().chain(&bwd) {
            assert!(e["name"].as_str().unwrap().starts_with("ep["), "{e}");
        }
        for e in &bwd {
            assert!(
                inside(&events, e, "backward"),
                "not in a backward span: {e}"
            );
        }
    }
    assert!(collectives(&events, 0, "ring hop").is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}
