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

use meshgrad::nn::{Gpt, GptConfig};
use meshgrad::parallel::memory_report::{memory_report, MemoryReportConfig, MemoryStrategy};

fn main() -> anyhow::Result<()> {
    let world = match std::env::args().nth(1) {
        Some(w) => w
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("WORLD must be a number of ranks, got '{w}'"))?,
        None => 4,
    };
    // A 6-layer GPT (n_embd 128, 4 heads, vocab 512, context 64, 1.26 M parameters), global
    // batch 8 x 64 tokens, 3 steps.
    let cfg = MemoryReportConfig {
        model: GptConfig {
            vocab_size: 512,
            block_size: 64,
            n_layer: 6,
            n_head: 4,
            n_embd: 128,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        },
        world,
        global_batch: 8,
        seq_len: 64,
        steps: 3,
        seed: 1,
    };
    let report = memory_report::<Gpt>(&cfg, &MemoryStrategy::all(world)?)?;
    print!("{}", report.to_markdown());
    Ok(())
}
