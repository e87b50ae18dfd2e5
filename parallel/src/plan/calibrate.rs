//! `--device-kind cpu`: this machine as a device kind, measured once and cached.
//!
//! `meshgrad train --layout` runs its ranks as threads of one process that share the cores and
//! the memory, so the measurement describes the machine for `ranks` such threads:
//!
//! * **matmul**: an f32 `n x n x n` product through the tensor crate's kernel for `n` = 128 and
//!   1024 (best of three). The large one's rate divided by the ranks (they share the cores) is
//!   the peak (`peak_fraction` 1); `half_dim` is solved so that the curve `(n / (n + h))^3`
//!   gives the small one's ratio. bf16 and fp8 are taken at the f32 rate.
//! * **memory bandwidth**: copying a 64 MiB buffer, divided by the ranks, over
//!   [`super::compute::STREAM_FRACTION`] (so that the cost model's streaming rate is the one
//!   measured).
//! * **collectives**: in-process all-reduces over `ranks` threads of 4 KiB (the latency) and
//!   16 MiB (the bandwidth, solved from the ring formula); the same figures serve both levels.
//! * **memory**: what the machine has available now.
//!
//! The result is written as a device file to `$XDG_CACHE_HOME/meshgrad` (or
//! `~/.cache/meshgrad`) under a name made of the CPU model, the core count and the ranks, and
//! read back by later runs.

use std::path::PathBuf;
use std::time::Instant;

use meshgrad_tensor::{DType, Device, Tensor};

use super::device::{DeviceError, DeviceKind};
use crate::comm::{run_ranks, ReduceOp, RunOptions};

fn err(e: impl std::fmt::Display) -> DeviceError {
    DeviceError(format!("cpu calibration: {e}"))
}

/// The best of three timings of `f`, seconds.
fn best_of_three(mut f: impl FnMut() -> Result<(), DeviceError>) -> Result<f64, DeviceError> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// FLOP/s of an `n`-cube f32 matmul.
fn matmul_rate(n: usize) -> Result<f64, DeviceError> {
    let a = Tensor::randn([n, n], 1).map_err(err)?;
    let b = Tensor::randn([n, n], 2).map_err(err)?;
    let t = best_of_three(|| a.matmul(&b).map(|_| ()).map_err(err))?;
    Ok(2.0 * (n * n * n) as f64 / t)
}

/// Bytes per second of copying a large buffer (read and write counted).
fn copy_rate() -> Result<f64, DeviceError> {
    let src = vec![1.0f32; 16 << 20];
    let mut dst = vec![0.0f32; 16 << 20];
    let t = best_of_three(|| {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    Ok(2.0 * (src.len() * 4) as f64 / t)
}

/// Seconds of an in-process all-reduce of `values` f32 over `ranks` threads.
fn all_reduce_time(ranks: usize, values: usize) -> Result<f64, DeviceError> {
    let times = run_ranks(ranks, &RunOptions::default(), |ctx| {
        let x = Tensor::zeros([values], DType::F32, Device::Cpu)?;
        let mut best = f64::INFINITY;
        for _ in 0..4 {
            let t = Instant::now();
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    })
    .map_err(err)?;
    Ok(times.into_iter().fold(0.0, f64::max))
}

/// The file this machine's calibration for `ranks` ranks is cached in.
fn cache_file(ranks: usize) -> Option<PathBuf> {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown")
        .trim()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "-");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some(
        dir.join("meshgrad")
            .join(format!("cpu-{model}-{cores}cores-{ranks}ranks.toml")),
    )
}

/// Measures this machine for `ranks` ranks (see the [module docs](self)) as a device file.
pub fn measure(ranks: usize) -> Result<String, DeviceError> {
    let ranks = ranks.max(1);
    let (small, large) = (matmul_rate(128)?, matmul_rate(1024)?);
    // (n / (n + h))^3 for n = 128 over n = 1024 equals small / large: bisect h.
    let ratio = (small / large).min(1.0);
    let curve = |h: f64| ((128.0 / (128.0 + h)) / (1024.0 / (1024.0 + h))).powi(3);
    let (mut lo, mut hi) = (0.0f64, 4096.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if curve(mid) > ratio {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let half_dim = 0.5 * (lo + hi);
    let peak = large / (1024.0 / (1024.0 + half_dim)).powi(3) / ranks as f64 / 1e12;
    let bandwidth = copy_rate()? / ranks as f64 / super::compute::STREAM_FRACTION / 1e9;
    let (alpha, beta) = if ranks > 1 {
        let n = ranks as f64;
        let small_t = all_reduce_time(ranks, 1024)?;
        let big_t = all_reduce_time(ranks, 4 << 20)?;
        let alpha = small_t / (2.0 * (n - 1.0));
        let beta = 2.0 * (n - 1.0) / n * (16u64 << 20) as f64 / (big_t - small_t).max(1e-9);
        (alpha * 1e6, beta / 1e9)
    } else {
        (1.0, 1e3)
    };
    let memory = available_gib();
    Ok(format!(
        "# This machine for {ranks} rank thread(s), measured by meshgrad plan --device-kind cpu.\n\
         name = \"cpu\"\nmemory_gib = {memory:.3}\nmemory_bandwidth_gbps = {bandwidth:.3}\n\
         devices_per_node = {ranks}\n[peak_tflops]\nf32 = {peak:.6}\nbf16 = {peak:.6}\n\
         fp8 = {peak:.6}\n[matmul]\npeak_fraction = 1.0\nhalf_dim = {half_dim:.1}\n\
         [intra_node]\nbandwidth_gbps = {beta:.3}\nlatency_us = {alpha:.3}\n\
         [inter_node]\nbandwidth_gbps = {beta:.3}\nlatency_us = {alpha:.3}\n"
    ))
}

/// `MemAvailable`, GiB (16 when it cannot be read).
fn available_gib() -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(16.0, |kb| kb / (1 << 20) as f64)
}

/// This machine for `ranks` rank threads: the cached calibration, or a new one (written to the
/// cache when it can be).
pub fn cpu_device(ranks: usize) -> Result<DeviceKind, DeviceError> {
    let file = cache_file(ranks);
    if let Some(text) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return DeviceKind::parse(&text, &file.unwrap().display().to_string());
    }
    let text = measure(ranks)?;
    if let Some(f) = &file {
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::write(f, &text);
    }
    DeviceKind::parse(&text, "the cpu calibration")
}
