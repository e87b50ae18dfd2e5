//! The sharded-data-parallel memory report: trains a 6-layer GPT (1.26 M parameters) for a few
//! steps on WORLD ranks (threads, default 4) under DDP, ZeRO-1, ZeRO-2 and ZeRO-3 and prints each
//! rank's peak bytes of parameters, gradients and optimizer state as a Markdown table (the one in
//! README.md), with the ZeRO-3 target.
//!
//! ```text
//! cargo run --release --example memory_report [-- WORLD]
//! ```

use meshgrad::parallel::zero::memory::{memory_report, MemoryReportConfig, MemoryStrategy};

fn main() -> anyhow::Result<()> {
    let world = match std::env::args().nth(1) {
        Some(w) => w
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("WORLD must be a number of ranks, got '{w}'"))?,
        None => 4,
    };
    let cfg = MemoryReportConfig::small_gpt(world);
    let report = memory_report(&cfg, &MemoryStrategy::ALL)?;
    print!("{}", report.to_markdown());
    Ok(())
}
