//! `meshgrad bench --pytorch`: runs the PyTorch reference script beside the benchmark
//! ([`meshgrad_nn::bench`]) and reads its tokens/s.

use anyhow::{bail, Context, Result};
use meshgrad_nn::bench::{bench_config, BenchOptions};
use meshgrad_tensor::{DType, Device};

/// The PyTorch reference runs of `meshgrad bench --pytorch`: `benches/pytorch_gpt.py` with the
/// same model, device, batch, step count and precision (bf16: autocast with f32 parameters),
/// eager and (on a GPU) `torch.compile`. Returns `(mode, tokens_per_s)` per run; each run's own lines are printed.
pub fn run_pytorch_reference(
    opts: &BenchOptions,
    python: &str,
    script: &std::path::Path,
) -> Result<Vec<(String, f64)>> {
    if !script.is_file() {
        bail!(
            "bench --pytorch: the reference script {} does not exist (run from the repository root or pass --pytorch-script)",
            script.display()
        );
    }
    let device = match opts.device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
    };
    let batch = opts.batch.unwrap_or(bench_config(&opts.model)?.1);
    let mut modes = vec![("eager", false)];
    if device == "cuda" {
        modes.push(("compile", true));
    }
    let mut out = Vec::new();
    for (mode, compile) in modes {
        let mut cmd = std::process::Command::new(python);
        cmd.arg(script)
            .args(["--model", &opts.model, "--device", device])
            .args(["--steps", &opts.steps.to_string()])
            .args(["--threads", &opts.threads.to_string()])
            .args(["--batch", &batch.to_string()])
            .args([
                "--precision",
                if opts.precision == DType::BF16 {
                    "bf16"
                } else {
                    "f32"
                },
            ]);
        if compile {
            cmd.arg("--compile");
        }
        let o = cmd
            .output()
            .with_context(|| format!("bench --pytorch: running {python} {}", script.display()))?;
        let stdout = String::from_utf8_lossy(&o.stdout);
        if !o.status.success() {
            bail!(
                "bench --pytorch: the {mode} reference failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("no output")
            );
        }
        print!("{stdout}");
        let tps = parse_tokens_per_s(&stdout).with_context(|| {
            format!("bench --pytorch: no tokens_per_s= in the {mode} reference's output")
        })?;
        out.push((mode.to_owned(), tps));
    }
    Ok(out)
}

/// `tokens_per_s=` of the last line that has it.
fn parse_tokens_per_s(stdout: &str) -> Option<f64> {
    stdout.lines().rev().find_map(|l| {
        l.split_whitespace()
            .find_map(|kv| kv.strip_prefix("tokens_per_s="))
            .and_then(|v| v.parse().ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_per_s_is_read_from_the_last_key_value_line() {
        let out = "pytorch 2.11 bench tiny-gpt (eager f32 cpu, 2 threads)\n\
                   params=1 step_median_s=0.5 tokens_per_s=2048.0 gflops=1.0 peak_bytes=3\n";
        assert_eq!(parse_tokens_per_s(out), Some(2048.0));
        assert_eq!(parse_tokens_per_s("nothing"), None);
    }
}
