//! `meshgrad bench`: times the GPT training step (forward + backward + AdamW) on random tokens
//! and prints one `key=value` line comparable with `benches/pytorch_gpt.py`.
//!
//! FLOPs per step follow `shared/notes/anchors.md`: `6 * params * tokens + 12 * layers * n_embd *
//! seq * tokens`. With `--profile` it also prints where the step time goes (per op, forward and
//! backward, optimizer, and the rest) and the fraction of a plain sgemm ceiling the step reaches,
//! measured in the same invocation on the step's own linear-layer shapes.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use meshgrad_kernels::cpu::matmul::matmul;
use meshgrad_kernels::ops::MatrixLayout;
use meshgrad_nn::optim::{AdamW, AdamWConfig, Optimizer, ParamGroup};
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_tensor::profile::{self, Phase};
use meshgrad_tensor::{alloc, DType, Device, Tensor};

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

/// The benchmark model configs of `shared/notes/anchors.md`: `(config, batch)`.
pub fn bench_config(name: &str) -> Result<(GptConfig, usize)> {
    let (n_layer, n_head, n_embd, seq) = match name {
        "tiny-gpt" => (4, 4, 256, 128),
        "small-gpt" => (6, 6, 384, 256),
        "gpt2-124m" => (12, 12, 768, 1024),
        other => {
            bail!("bench: unknown model {other:?} (expected tiny-gpt, small-gpt or gpt2-124m)")
        }
    };
    // GPT-2's 50257 tokens padded to a multiple of 128 (anchors.md); byte-level for the others.
    let vocab_size = if name == "gpt2-124m" { 50304 } else { 256 };
    Ok((
        GptConfig {
            vocab_size,
            block_size: seq,
            n_layer,
            n_head,
            n_embd,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        },
        8,
    ))
}

/// FLOPs of one training step (forward + backward) by the anchors' formula.
pub fn step_flops(cfg: &GptConfig, params: usize, batch: usize) -> f64 {
    let tokens = (batch * cfg.block_size) as f64;
    6.0 * params as f64 * tokens
        + 12.0 * (cfg.n_layer * cfg.n_embd * cfg.block_size) as f64 * tokens
}

/// A fixed pseudo-random token stream (xorshift64*), ids below `vocab`.
fn random_tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % vocab as u32
        })
        .collect()
}

/// CPU time (seconds) consumed so far by all threads of this process, from
/// `/proc/self/task/*/schedstat` (Linux; `None` elsewhere). Under a shared machine's load this
/// is steadier than wall time for comparing the work a step does.
fn process_cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for e in std::fs::read_dir("/proc/self/task").ok()? {
        let path = e.ok()?.path().join("schedstat");
        let s = std::fs::read_to_string(path).ok()?;
        ns += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// The gemm shapes `(m, n, k, b_transposed, count)` of one training step's linear layers
/// (forward `x Wᵀ`, input gradient `dy W`, weight gradient `dyᵀ x`) and the tied head.
fn step_gemms(cfg: &GptConfig, batch: usize) -> Vec<(usize, usize, usize, bool, usize)> {
    let rows = batch * cfg.block_size;
    let c = cfg.n_embd;
    let mut linears = vec![(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
        .into_iter()
        .map(|(i, o)| (i, o, cfg.n_layer))
        .collect::<Vec<_>>();
    linears.push((c, cfg.vocab_size, 1));
    let mut out = Vec::new();
    for (inf, outf, count) in linears {
        out.push((rows, outf, inf, true, count)); // forward: [rows, in] x [in, out] (W read transposed)
        out.push((rows, inf, outf, false, count)); // dx: [rows, out] x [out, in]
        out.push((outf, inf, rows, false, count)); // dW: [out, rows] x [rows, in] (dyᵀ strided)
    }
    out
}

/// The FLOP-weighted sgemm rate (GFLOP/s) over the step's linear-layer shapes: each shape timed
/// alone (best of 5 after a warm-up) through the same kernel the ops use.
pub fn sgemm_ceiling(cfg: &GptConfig, batch: usize) -> f64 {
    let (mut flops, mut secs) = (0.0, 0.0);
    for (m, n, k, bt, count) in step_gemms(cfg, batch) {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i % 89) as f32 - 44.0) * 1e-2)
            .collect();
        let mut c = vec![0f32; m * n];
        let al = MatrixLayout {
            offset: 0,
            batch_stride: 0,
            row_stride: k,
            col_stride: 1,
        };
        let bl = if bt {
            MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: 1,
                col_stride: k,
            }
        } else {
            MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: n,
                col_stride: 1,
            }
        };
        let cl = MatrixLayout {
            offset: 0,
            batch_stride: 0,
            row_stride: n,
            col_stride: 1,
        };
        let mut run = || matmul(1, m, n, k, &a, al, &b, bl, &mut c, cl, false);
        run();
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        let f = 2.0 * (m * n * k) as f64 * count as f64;
        flops += f;
        secs += best * count as f64;
    }
    flops / secs / 1e9
}

/// Runs the benchmark, printing the optional breakdown; returns the figures (the caller prints
/// the final line).
pub fn run_bench(opts: &BenchOptions) -> Result<BenchResult> {
    if opts.steps == 0 {
        bail!("bench: --steps must be at least 1");
    }
    let device = opts.device;
    device.check_available().context("bench")?;
    let (cfg, default_batch) = bench_config(&opts.model)?;
    let batch = opts.batch.unwrap_or(default_batch);
    if batch == 0 {
        bail!("bench: --batch must be at least 1");
    }
    if !matches!(opts.precision, DType::F32 | DType::BF16) {
        bail!(
            "bench: --precision {:?} is not supported (f32 or bf16)",
            opts.precision
        );
    }
    if opts.reference.is_some() && (device != Device::Cpu || opts.precision != DType::F32) {
        bail!("bench: --reference runs on the CPU in f32 (as reference-mode training does)");
    }
    let model = Gpt::new(cfg, 1337, opts.precision, device)?;
    if opts.reference.is_some() {
        // As reference-mode training builds it: the sums tensor parallelism would split are
        // trees over the model's chunk count, on one device too.
        let k = reference_chunk_count(&cfg, opts.reference_chunks)?;
        if k > 1 {
            Gpt::tp_plan().apply(&model, &meshgrad_nn::tp::TensorParallel::single_device(k))?;
        }
    }
    let params = model.num_parameters();
    if params != cfg.num_parameters() {
        bail!(
            "bench: the model has {params} parameters but its config counts {}",
            cfg.num_parameters()
        );
    }
    if opts.model == "tiny-gpt" && params != 3_257_856 {
        bail!("bench: tiny-gpt has {params} parameters, the anchor says 3,257,856");
    }
    let mut opt = AdamW::new(
        vec![ParamGroup::new(model.named_parameters(), 0.01)],
        AdamWConfig::default(),
    )?;
    let t = cfg.block_size;
    let toks = random_tokens(0x5eed, batch * (t + 1), cfg.vocab_size);
    let mut inputs = Vec::with_capacity(batch * t);
    let mut targets = Vec::with_capacity(batch * t);
    for r in 0..batch {
        let row = &toks[r * (t + 1)..(r + 1) * (t + 1)];
        inputs.extend_from_slice(&row[..t]);
        targets.extend_from_slice(&row[1..]);
    }
    let ids = Tensor::from_vec(inputs, (batch, t), Device::Cpu)?.to_device(device)?;
    let targets = Tensor::from_vec(targets, (batch, t), Device::Cpu)?.to_device(device)?;

    let vars = model.parameters();
    let groups = match opts.reference {
        None => Vec::new(),
        Some(r) if r == 0 || !batch.is_multiple_of(r) => {
            bail!("bench: --row-group {r} must divide the batch of {batch}")
        }
        Some(r) => crate::reference::row_groups(0..batch as u64, r)?,
    };
    // With `grad_norm`, the norm as training with clipping computes it (fast: an f64 sum per
    // parameter; reference: the exact sum).
    let step = |opt: &mut AdamW| -> Result<f64> {
        opt.zero_grad();
        let loss = if opts.reference.is_some() {
            let factor = 1.0 / groups.len() as f64;
            let sum = meshgrad_parallel::grad_tree::reference_step(&vars, &groups, factor, |r| {
                let n = (r.end - r.start) as usize;
                let ids = ids.narrow(0, r.start as usize, n)?;
                let targets = targets.narrow(0, r.start as usize, n)?;
                model.loss(&ids, &targets, None)
            })?;
            meshgrad_autograd::distributed::exact_grad_squares(&vars)?;
            sum * factor
        } else {
            let loss = model.loss(&ids, &targets, None)?;
            loss.backward()?;
            if opts.grad_norm {
                meshgrad_nn::optim::grad_norm(&vars)?;
            }
            loss.tensor().item()?
        };
        {
            let _p = profile::phase(Phase::Optimizer);
            opt.step(1e-3)?;
        }
        Ok(loss)
    };
    let mut first_loss = f64::NAN;
    for i in 0..2 {
        let l = step(&mut opt).context("bench warm-up step")?;
        if i == 0 {
            first_loss = l;
        }
    }
    alloc::reset_peak(device);
    let driver_allocs_before = cuda_driver_allocations(device)?;
    // On a GPU the ops are profiled in steps of their own (below): waiting for the device after
    // every op would slow the timed steps.
    let on_gpu = matches!(device, Device::Cuda(_));
    profile::reset();
    profile::set_enabled(opts.profile && !on_gpu);
    let mut times = Vec::with_capacity(opts.steps);
    let mut last_loss = f64::NAN;
    let cpu0 = process_cpu_seconds();
    for _ in 0..opts.steps {
        let t0 = Instant::now();
        last_loss = step(&mut opt)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    profile::set_enabled(false);
    let gpu_profile_times = if opts.profile && on_gpu {
        Some(profile_synced(device, opts.steps.min(5), || {
            step(&mut opt).map(|_| ())
        })?)
    } else {
        None
    };
    let cpu_per_step = cpu0
        .zip(process_cpu_seconds())
        .map(|(a, b)| (b - a) / opts.steps as f64);
    // Every step ends by reading the loss back to the host (`item`), which waits for the device:
    // the step times include all queued work.
    let peak_bytes = alloc::memory_stats(device).peak;
    if !last_loss.is_finite() {
        bail!("bench: the loss is {last_loss}");
    }
    let step_median_s = median(&times);
    let tokens = (batch * t) as f64;
    // GPT-2 124M follows the GPU anchors' convention (position embeddings not counted in N).
    let flops_params = if opts.model == "gpt2-124m" {
        params - cfg.block_size * cfg.n_embd
    } else {
        params
    };
    let flops = step_flops(&cfg, flops_params, batch);
    let res = BenchResult {
        params,
        step_median_s,
        tokens_per_s: tokens / step_median_s,
        gflops: flops / step_median_s / 1e9,
        peak_bytes,
        mfu: matches!(device, Device::Cuda(_))
            .then(|| flops / step_median_s / H100_BF16_DENSE_FLOPS),
    };
    println!(
        "meshgrad bench {}{} on {device} ({}): {} layers, {} heads, n_embd {}, seq {}, batch {}, {} rayon threads; loss {:.4} -> {:.4}; step times (s): min {:.4} median {:.4} max {:.4}",
        opts.model,
        match opts.reference {
            Some(r) => format!(
                " (reference mode, row groups of {r}, {} chunk(s))",
                reference_chunk_count(&cfg, opts.reference_chunks)?
            ),
            None => String::new(),
        },
        if opts.precision == DType::BF16 { "bf16, f32 master weights" } else { "f32" },
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        t,
        batch,
        rayon::current_num_threads(),
        first_loss,
        last_loss,
        times.iter().cloned().fold(f64::INFINITY, f64::min),
        step_median_s,
        times.iter().cloned().fold(0.0, f64::max),
    );
    if let Some(before) = driver_allocs_before {
        let after = cuda_driver_allocations(device)?.unwrap_or(before);
        println!(
            "cuda caching allocator: {} driver allocations during the {} timed steps (0 = nothing allocated inside the step after warm-up)",
            after - before,
            opts.steps
        );
    }
    if let Some(c) = cpu_per_step {
        let wall = times.iter().sum::<f64>() / times.len() as f64;
        println!(
            "cpu time per step: {c:.4} s over {wall:.4} s of wall time ({:.2} cores busy on average)",
            c / wall
        );
    }
    if let Some(synced) = &gpu_profile_times {
        println!(
            "per-op device times: {} more steps in which every op waits for the GPU (so each \
             op's time is its kernels' plus its launch; these steps are slower than the timed \
             ones)",
            synced.len()
        );
        print_profile(synced);
    } else if opts.profile {
        print_profile(&times);
        let ceiling = sgemm_ceiling(&cfg, batch);
        println!(
            "sgemm ceiling on this step's linear-layer shapes: {ceiling:.1} GFLOP/s; the step reaches {:.1} GFLOP/s = {:.0}% of it",
            res.gflops,
            100.0 * res.gflops / ceiling
        );
    }
    Ok(res)
}

/// The chunk count of `--reference-chunks` (0: the model's), checked as training checks it.
fn reference_chunk_count(cfg: &GptConfig, set: usize) -> Result<usize> {
    let model_k = meshgrad_nn::gpt::reference_chunks(cfg);
    match set {
        0 => Ok(model_k),
        k if k.is_power_of_two() && model_k.is_multiple_of(k) => Ok(k),
        k => bail!("bench: --reference-chunks {k} must be 0 or a power of two dividing {model_k}"),
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

/// Driver allocations made so far by the caching allocator of a CUDA `device` (`None` for the
/// CPU).
fn cuda_driver_allocations(device: Device) -> Result<Option<u64>> {
    match device {
        Device::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Ok(Some(
            meshgrad_tensor::cuda_memory_stats(device)?.driver_allocations,
        )),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Ok(None),
    }
}

/// Runs `steps` steps with the profiler on and every op waiting for `device` before its time is
/// taken (see `profile::set_sync`); returns the step times.
fn profile_synced(
    device: Device,
    steps: usize,
    mut step: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    #[cfg(feature = "cuda")]
    profile::set_sync(Some(std::sync::Arc::new(move || {
        // A failure here surfaces at the step's own next wait.
        let _ = meshgrad_tensor::cuda_synchronize(device);
    })));
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    profile::reset();
    profile::set_enabled(true);
    let mut times = Vec::with_capacity(steps);
    let r = (0..steps).try_for_each(|_| {
        let t0 = Instant::now();
        step()?;
        times.push(t0.elapsed().as_secs_f64());
        Ok(())
    });
    profile::set_enabled(false);
    profile::set_sync(None);
    r.map(|()| times)
}

fn print_profile(times: &[f64]) {
    let n = times.len() as f64;
    let total: f64 = times.iter().sum::<f64>() / n;
    let recs = profile::snapshot();
    println!(
        "per-op breakdown (mean per step over {} profiled steps, {:.2} ms per step):",
        times.len(),
        total * 1e3
    );
    println!(
        "  {:<10} {:<24} {:>8} {:>10} {:>7}",
        "phase", "op", "calls", "ms/step", "share"
    );
    let mut accounted = 0.0;
    for phase in [Phase::Forward, Phase::Backward, Phase::Optimizer] {
        let rows: Vec<_> = recs.iter().filter(|r| r.0 == phase).collect();
        let sub: f64 = rows.iter().map(|r| r.2.seconds).sum::<f64>() / n;
        for r in &rows {
            let s = r.2.seconds / n;
            println!(
                "  {:<10} {:<24} {:>8.0} {:>10.3} {:>6.1}%",
                phase.name(),
                r.1,
                r.2.calls as f64 / n,
                s * 1e3,
                100.0 * s / total
            );
        }
        println!(
            "  {:<10} {:<24} {:>8} {:>10.3} {:>6.1}%",
            phase.name(),
            "(total)",
            "",
            sub * 1e3,
            100.0 * sub / total
        );
        accounted += sub;
    }
    let other = total - accounted;
    println!(
        "  {:<10} {:<24} {:>8} {:>10.3} {:>6.1}%",
        "other",
        "(graph, engine, allocs)",
        "",
        other * 1e3,
        100.0 * other / total
    );
}

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

/// The ratio line printed last: meshgrad's tokens/s over each reference's.
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
    fn tokens_per_s_is_read_from_the_last_key_value_line() {
        let out = "pytorch 2.11 bench tiny-gpt (eager f32 cpu, 2 threads)\n\
                   params=1 step_median_s=0.5 tokens_per_s=2048.0 gflops=1.0 peak_bytes=3\n";
        assert_eq!(parse_tokens_per_s(out), Some(2048.0));
        assert_eq!(parse_tokens_per_s("nothing"), None);
        let refs = vec![("eager".to_owned(), 1000.0), ("compile".to_owned(), 4000.0)];
        assert_eq!(
            ratio_line(2000.0, &refs),
            "ratio_vs_pytorch_eager=2.000 ratio_vs_pytorch_compile=0.500"
        );
    }

    #[test]
    fn gpt2_124m_has_the_anchor_shape() {
        let (cfg, batch) = bench_config("gpt2-124m").unwrap();
        assert_eq!(
            (
                cfg.vocab_size,
                cfg.n_layer,
                cfg.n_head,
                cfg.n_embd,
                cfg.block_size,
                batch
            ),
            (50304, 12, 12, 768, 1024, 8)
        );
        // 124M parameters with the tied head (nanoGPT counts 124,475,904 with vocab 50304).
        assert_eq!(cfg.num_parameters(), 124_475_904);
    }
}
