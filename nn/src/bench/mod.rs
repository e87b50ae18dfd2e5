//! The GPT training-step benchmark behind `meshgrad bench`: times the step (forward + backward +
//! AdamW) on random tokens and gives one `key=value` line comparable with
//! `benches/pytorch_gpt.py`.
//!
//! FLOPs per step follow `shared/notes/anchors.md`: `6 * params * tokens + 12 * layers * n_embd *
//! seq * tokens`. With [`BenchOptions::profile`] it also prints where the step time goes (per op,
//! forward and backward, optimizer, and the rest) and the fraction of a plain sgemm ceiling the
//! step reaches, measured in the same invocation on the step's own linear-layer shapes.
//!
//! * [`config`]: the benchmark models and the FLOPs of their step.
//! * [`run`]: the timed steps ([`run_bench`]).
//! * [`profile`]: the per-op breakdown.
//! * [`sgemm`]: the sgemm ceiling.

pub mod config;
pub mod profile;
pub mod run;
pub mod sgemm;

pub use config::{bench_config, step_flops};
pub use run::{run_bench, ReferenceStep};
pub use sgemm::sgemm_ceiling;

use meshgrad_tensor::{DType, Device};

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// `tiny-gpt`, `small-gpt` or `gpt2-124m`.
    pub model: String,
    /// The device the step runs on.
    pub device: Device,
    /// Sequences per step (default: the config's, see [`bench_config`]).
    pub batch: Option<usize>,
    /// Parameter and activation dtype: f32, or bf16 with f32 master weights and optimizer state
    /// (AdamW keeps them for half-precision parameters).
    pub precision: DType,
    /// Timed steps (after 2 warm-up steps).
    pub steps: usize,
    /// Rayon threads.
    pub threads: usize,
    /// Print the per-op breakdown and the sgemm ceiling.
    pub profile: bool,
    /// Time reference mode's step instead (`Some(row_group)`: sequences per row group): one
    /// forward and backward pass per row group, gradients added over the row groups' tree, the
    /// exact gradient norm.
    pub reference: Option<usize>,
    /// Reference mode's chunk count (`train.reference_chunks`: 0 the model's, 1 none).
    pub reference_chunks: usize,
    /// Compute the gradient norm every step, as training with clipping does (`--reference`
    /// sets it for both of its steps, so their ratio includes the norms; off, the step matches
    /// the PyTorch reference's, which has none).
    pub grad_norm: bool,
}

/// The figures of one run.
#[derive(Clone, Debug)]
pub struct BenchResult {
    /// Parameter count.
    pub params: usize,
    /// Median step time, seconds.
    pub step_median_s: f64,
    /// Tokens per second at the median step time.
    pub tokens_per_s: f64,
    /// GFLOP/s at the median step time.
    pub gflops: f64,
    /// Peak bytes allocated during the timed steps.
    pub peak_bytes: usize,
    /// On a GPU: model FLOP utilisation against [`H100_BF16_DENSE_FLOPS`].
    pub mfu: Option<f64>,
}

/// The H100's dense bf16 peak (FLOP/s) that MFU is measured against (anchors.md).
pub const H100_BF16_DENSE_FLOPS: f64 = 989e12;

impl BenchResult {
    /// The `key=value` line (the same keys as the PyTorch reference script prints).
    pub fn line(&self) -> String {
        let mut line = format!(
            "params={} step_median_s={:.6} tokens_per_s={:.1} gflops={:.2} peak_bytes={}",
            self.params, self.step_median_s, self.tokens_per_s, self.gflops, self.peak_bytes
        );
        if let Some(m) = self.mfu {
            line.push_str(&format!(" mfu={m:.4}"));
        }
        line
    }
}

/// The last line of `bench --reference`: reference mode's median step time and peak bytes over
/// fast mode's, measured in the same invocation.
pub fn reference_cost_line(fast: &BenchResult, reference: &BenchResult) -> String {
    format!(
        "reference_slowdown={:.3} reference_memory_ratio={:.3}",
        reference.step_median_s / fast.step_median_s,
        reference.peak_bytes as f64 / fast.peak_bytes.max(1) as f64
    )
}

/// The ratio line printed last by `bench --pytorch`: meshgrad's tokens/s over each reference's
/// `(mode, tokens_per_s)`.
pub fn ratio_line(meshgrad_tokens_per_s: f64, references: &[(String, f64)]) -> String {
    let parts: Vec<String> = references
        .iter()
        .map(|(mode, tps)| format!("ratio_vs_pytorch_{mode}={:.3}", meshgrad_tokens_per_s / tps))
        .collect();
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_line_divides_by_each_reference() {
        let refs = vec![("eager".to_owned(), 1000.0), ("compile".to_owned(), 4000.0)];
        assert_eq!(
            ratio_line(2000.0, &refs),
            "ratio_vs_pytorch_eager=2.000 ratio_vs_pytorch_compile=0.500"
        );
    }
}
