//! The timed training steps of `meshgrad bench` ([`run_bench`]) and the lines printed about them.

use std::ops::Range;
use std::time::Instant;

use meshgrad_autograd::Var;
use meshgrad_tensor::profile::{self, Phase};
use meshgrad_tensor::{alloc, bail, DType, Device, Error, Result, Tensor};

use super::config::{bench_config, reference_chunk_count, step_flops};
use super::profile::{print_profile, profile_synced};
use super::sgemm::sgemm_ceiling;
use super::{BenchOptions, BenchResult, H100_BF16_DENSE_FLOPS};
use crate::optim::{AdamW, AdamWConfig, Optimizer, ParamGroup};
use crate::{Gpt, Module};

/// Reference mode's forward and backward over the row groups (`meshgrad_parallel`'s
/// `grad_tree::reference_step`, which this crate sits below): the parameters, the row groups,
/// the factor each row group's loss is scaled by and each row group's loss; leaves the
/// tree-added gradients in the parameters' `.grad` and returns the tree-added loss.
pub type ReferenceStep =
    fn(&[Var], &[Range<u64>], f64, &mut dyn FnMut(&Range<u64>) -> Result<Var>) -> Result<f64>;

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

/// The median of `v` (the mean of the middle two for an even count).
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

/// Prefixes an error with what failed, in one line.
fn context(what: &str) -> impl FnOnce(Error) -> Error + '_ {
    move |e| Error::msg(format!("{what}: {e}"))
}

/// Runs the benchmark, printing its summary line and the optional breakdown; returns the figures
/// (the caller prints [`BenchResult::line`]). `reference_step` runs reference mode's step (only
/// called when [`BenchOptions::reference`] is set).
pub fn run_bench(opts: &BenchOptions, reference_step: ReferenceStep) -> Result<BenchResult> {
    if opts.steps == 0 {
        bail!("bench: --steps must be at least 1");
    }
    let device = opts.device;
    device.check_available().map_err(context("bench"))?;
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
            Gpt::tp_plan().apply(&model, &crate::tp::TensorParallel::single_device(k))?;
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
    // Row groups of `r` consecutive sequences, as reference-mode training cuts its rows.
    let groups: Vec<Range<u64>> = match opts.reference {
        None => Vec::new(),
        Some(r) if r == 0 || !batch.is_multiple_of(r) => {
            bail!("bench: --row-group {r} must divide the batch of {batch}")
        }
        Some(r) => (0..(batch / r) as u64)
            .map(|g| g * r as u64..(g + 1) * r as u64)
            .collect(),
    };
    // With `grad_norm`, the norm as training with clipping computes it (fast: an f64 sum per
    // parameter; reference: the exact sum).
    let step = |opt: &mut AdamW| -> Result<f64> {
        opt.zero_grad();
        let loss = if opts.reference.is_some() {
            let factor = 1.0 / groups.len() as f64;
            let sum = reference_step(&vars, &groups, factor, &mut |r: &Range<u64>| {
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
                crate::optim::grad_norm(&vars)?;
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
        let l = step(&mut opt).map_err(context("bench warm-up step"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
