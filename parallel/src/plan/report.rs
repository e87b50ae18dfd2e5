//! What `meshgrad plan` prints: a table of ranked candidates, the one-line summary that ends
//! every plan (`plan: layout=... fits=yes`), and the same as JSON.

use serde_json::{json, Value};

use super::cost::Estimate;

const GIB: f64 = (1u64 << 30) as f64;

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The last line of a plan: `plan: layout=<spec> sequence_parallel=yes|no schedule=<kind>
/// chunks=<v> microbatch_size=<m> step_s=<x> tokens_per_s_per_device=<x> mfu=<x>
/// memory_per_device_gib=<x> fits=yes|no`.
pub fn plan_line(e: &Estimate) -> String {
    let c = &e.candidate;
    format!(
        "plan: layout={} sequence_parallel={} schedule={} chunks={} microbatch_size={} \
         step_s={:.4} tokens_per_s_per_device={:.1} mfu={:.3} memory_per_device_gib={:.2} \
         fits={}",
        c.layout,
        yes(c.sequence_parallel),
        c.schedule,
        c.chunks,
        c.microbatch_size,
        e.time.step,
        e.tokens_per_s_per_device,
        e.mfu,
        e.memory.per_rank as f64 / GIB,
        yes(e.fits)
    )
}

/// A table of `rows`, one line each after a header: the candidate, its memory per device
/// (parameters, gradients, optimizer state, activations, all in GiB), its step split by cause
/// (seconds), tokens/s per device, MFU and the bottleneck.
pub fn table(rows: &[Estimate]) -> String {
    let mut out = format!(
        "{:>2} {:<28} {:>3} {:>11} {:>2} {:>3} {:>4} | {:>7} {:>6} {:>6} {:>6} {:>6} | {:>9} \
         {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>9} {:>5}  bottleneck\n",
        "#",
        "layout",
        "sp",
        "schedule",
        "v",
        "mb",
        "ckpt",
        "mem GiB",
        "params",
        "grads",
        "optim",
        "activ",
        "step s",
        "compute",
        "tp",
        "shard",
        "pp",
        "cp",
        "ep",
        "bubble",
        "dp",
        "optim",
        "tok/s/dev",
        "mfu"
    );
    for (i, e) in rows.iter().enumerate() {
        let c = &e.candidate;
        let m = &e.memory;
        let t = &e.time;
        let g = |b: u64| b as f64 / GIB;
        out += &format!(
            "{:>2} {:<28} {:>3} {:>11} {:>2} {:>3} {:>4} | {:>7.2} {:>6.2} {:>6.2} {:>6.2} \
             {:>6.2} | {:>9.4} {:>8.4} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>7.4} \
             {:>7.4} | \
             {:>9.1} {:>5.3}  {}{}\n",
            i + 1,
            layout_label(c),
            yes(c.sequence_parallel),
            c.schedule.to_string(),
            c.chunks,
            c.microbatch_size,
            if c.recompute { "all" } else { "none" },
            g(m.per_rank),
            g(m.params),
            g(m.grads),
            g(m.optimizer),
            g(m.activations),
            t.step,
            t.compute,
            t.tp,
            t.shard,
            t.pp,
            t.cp,
            t.ep,
            t.bubble,
            t.dp,
            t.optimizer,
            e.tokens_per_s_per_device,
            e.mfu,
            e.bottleneck(),
            if e.fits { "" } else { "; does not fit" }
        );
    }
    out
}

/// The layout as the table shows it: its spec, and `allgather` under all-gather attention.
fn layout_label(c: &super::cost::Candidate) -> String {
    match (c.layout.cp() > 1, c.cp_mode) {
        (true, super::cost::CpMode::AllGather) => format!("{} allgather", c.layout),
        _ => c.layout.to_string(),
    }
}

/// One estimate as JSON.
pub fn to_json(e: &Estimate) -> Value {
    let c = &e.candidate;
    let m = &e.memory;
    let t = &e.time;
    json!({
        "layout": c.layout.to_string(),
        "sequence_parallel": c.sequence_parallel,
        "cp_mode": c.cp_mode.as_str(),
        "schedule": c.schedule.to_string(),
        "chunks": c.chunks,
        "microbatch_size": c.microbatch_size,
        "microbatches": e.microbatches,
        "activation_checkpointing": if c.recompute { "all" } else { "none" },
        "fits": e.fits,
        "memory_bytes": {
            "per_device": m.per_rank,
            "parameters": m.params,
            "gradients": m.grads,
            "optimizer": m.optimizer,
            "activations": m.activations,
        },
        "time_s": {
            "step": t.step,
            "compute": t.compute,
            "tp": t.tp,
            "shard": t.shard,
            "pp": t.pp,
            "cp": t.cp,
            "ep": t.ep,
            "bubble": t.bubble,
            "dp": t.dp,
            "optimizer": t.optimizer,
        },
        "tokens_per_s_per_device": e.tokens_per_s_per_device,
        "mfu": e.mfu,
        "flops_per_device": e.flops_per_device,
        "bottleneck": e.bottleneck(),
    })
}

/// The whole plan as JSON: `{"candidates": [...], "plan": {...}}`, `plan` the first candidate.
pub fn plan_json(rows: &[Estimate]) -> Value {
    json!({
        "candidates": rows.iter().map(to_json).collect::<Vec<_>>(),
        "plan": rows.first().map(to_json),
    })
}
