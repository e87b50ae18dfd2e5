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
    /// `tiny-gpt` or `small-gpt`.
    pub model: String,
    /// Timed steps (after 2 warm-up steps).
    pub steps: usize,
    /// Rayon threads.
    pub threads: usize,
    /// Print the per-op breakdown and the sgemm ceiling.
    pub profile: bool,
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
}

impl BenchResult {
    /// The `key=value` line (the same keys as the PyTorch reference script prints).
    pub fn line(&self) -> String {
        format!(
            "params={} step_median_s={:.6} tokens_per_s={:.1} gflops={:.2} peak_bytes={}",
            self.params, self.step_median_s, self.tokens_per_s, self.gflops, self.peak_bytes
        )
    }
}

/// The benchmark model configs of `shared/notes/anchors.md`: `(config, batch)`.
pub fn bench_config(name: &str) -> Result<(GptConfig, usize)> {
    let (n_layer, n_head, n_embd, seq) = match name {
        "tiny-gpt" => (4, 4, 256, 128),
        "small-gpt" => (6, 6, 384, 256),
        other => bail!("bench: unknown model {other:?} (expected tiny-gpt or small-gpt)"),
    };
    Ok((
        GptConfig {
            vocab_size: 256,
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
    let (cfg, batch) = bench_config(&opts.model)?;
    let model = Gpt::new(cfg, 1337, DType::F32, Device::Cpu)?;
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
    let ids = Tensor::from_vec(inputs, (batch, t), Device::Cpu)?;
    let targets = Tensor::from_vec(targets, (batch, t), Device::Cpu)?;

    let step = |opt: &mut AdamW| -> Result<f64> {
        let loss = model.loss(&ids, &targets, None)?;
        opt.zero_grad();
        loss.backward()?;
        {
            let _p = profile::phase(Phase::Optimizer);
            opt.step(1e-3)?;
        }
        Ok(loss.tensor().item()?)
    };
    let mut first_loss = f64::NAN;
    for i in 0..2 {
        let l = step(&mut opt).context("bench warm-up step")?;
        if i == 0 {
            first_loss = l;
        }
    }
    alloc::reset_peak(Device::Cpu);
    profile::reset();
    profile::set_enabled(opts.profile);
    let mut times = Vec::with_capacity(opts.steps);
    let mut last_loss = f64::NAN;
    let cpu0 = process_cpu_seconds();
    for _ in 0..opts.steps {
        let t0 = Instant::now();
        last_loss = step(&mut opt)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    profile::set_enabled(false);
    let cpu_per_step = cpu0
        .zip(process_cpu_seconds())
        .map(|(a, b)| (b - a) / opts.steps as f64);
    let peak_bytes = alloc::memory_stats(Device::Cpu).peak;
    if !last_loss.is_finite() {
        bail!("bench: the loss is {last_loss}");
    }
    let step_median_s = median(&times);
    let tokens = (batch * t) as f64;
    let flops = step_flops(&cfg, params, batch);
    let res = BenchResult {
        params,
        step_median_s,
        tokens_per_s: tokens / step_median_s,
        gflops: flops / step_median_s / 1e9,
        peak_bytes,
    };
    println!(
        "meshgrad bench {}: {} layers, {} heads, n_embd {}, seq {}, batch {}, {} rayon threads; loss {:.4} -> {:.4}; step times (s): min {:.4} median {:.4} max {:.4}",
        opts.model,
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
    if let Some(c) = cpu_per_step {
        let wall = times.iter().sum::<f64>() / times.len() as f64;
        println!(
            "cpu time per step: {c:.4} s over {wall:.4} s of wall time ({:.2} cores busy on average)",
            c / wall
        );
    }
    if opts.profile {
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
