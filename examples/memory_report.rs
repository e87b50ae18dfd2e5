//! The memory report: trains a 6-layer GPT (1.26 M parameters) for a few steps under DDP,
//! ZeRO-1, ZeRO-2 and ZeRO-3 on WORLD ranks (threads, default 4), then under tensor parallelism
//! (tp=2, tp=4, each with and without sequence parallelism, and fsdp=2 x tp=2 on 4 ranks), and
//! prints each rank's peak bytes of parameters, gradients, optimizer state and activations as a
//! Markdown table (the one in README.md), with the theory's figures, the ZeRO-3 target and what
//! sequence parallelism saves.
//!
//! ```text
//! cargo run --release --example memory_report [-- WORLD]
//! ```

use meshgrad::parallel::memory_report::{memory_report, MemoryReportConfig, MemoryStrategy};

fn main() -> anyhow::Result<()> {
    let world = match std::env::args().nth(1) {
        Some(w) => w
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("WORLD must be a number of ranks, got '{w}'"))?,
        None => 4,
    };
    let cfg = MemoryReportConfig::small_gpt(world);
    let report = memory_report(&cfg, &MemoryStrategy::all(world)?)?;
    print!("{}", report.to_markdown());
    Ok(())
}
