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
//!   The same over a loopback TCP world of `ranks` threads gives the `[tcp]` link, the one of
//!   ranks that are processes (`meshgrad launch`).
//! * **memory**: what the machine has available now.
//!
//! The result is written as a device file to `$XDG_CACHE_HOME/meshgrad` (or
//! `~/.cache/meshgrad`) under a name made of the CPU model, the core count and the ranks, and
//! read back by later runs. The model's own compute is measured apart, by a per-layer profile
//! (`meshgrad`'s `cpu_profile`), as a [`super::compute::ComputeScale`].

use std::path::PathBuf;
use std::time::{Duration, Instant};

use meshgrad_tensor::{DType, Device, Tensor};

use super::device::{DeviceError, DeviceKind};
use crate::comm::tcp::run_loopback_ranks;
use crate::comm::{run_ranks, ReduceOp, RunOptions};
use crate::Communicator;

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

/// The fastest of four all-reduces of `values` f32 on `comm`, seconds.
fn timed_all_reduce(comm: &dyn Communicator, values: usize) -> meshgrad_tensor::Result<f64> {
    let x = Tensor::zeros([values], DType::F32, Device::Cpu)?;
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let t = Instant::now();
        comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Seconds of an all-reduce of `values` f32 over `ranks` threads (the slowest rank's best), on
/// the in-process backend or, with `tcp`, each thread its own rank of a loopback TCP world.
fn all_reduce_time(ranks: usize, values: usize, tcp: bool) -> Result<f64, DeviceError> {
    let times = if tcp {
        run_loopback_ranks(ranks, Duration::from_secs(60), |comm| {
            timed_all_reduce(&*comm, values)
        })
        .map_err(err)?
    } else {
        run_ranks(ranks, &RunOptions::default(), |ctx| {
            timed_all_reduce(&*ctx.comm, values)
        })
        .map_err(err)?
    };
    Ok(times.into_iter().fold(0.0, f64::max))
}

/// A link's latency (microseconds) and bandwidth (GB/s) solved from all-reduce times of 4 KiB
/// and 16 MiB over `ranks` by the ring formula.
fn link_of(ranks: usize, tcp: bool) -> Result<(f64, f64), DeviceError> {
    let n = ranks as f64;
    let small_t = all_reduce_time(ranks, 1024, tcp)?;
    let big_t = all_reduce_time(ranks, 4 << 20, tcp)?;
    let alpha = small_t / (2.0 * (n - 1.0));
    let beta = 2.0 * (n - 1.0) / n * (16u64 << 20) as f64 / (big_t - small_t).max(1e-9);
    Ok((alpha * 1e6, beta / 1e9))
}

/// The identity of this machine in cache file names: its CPU model and core count.
pub fn machine_id() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown")
        .trim()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "-");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model}-{cores}cores")
}

/// `name` in meshgrad's cache folder, `$XDG_CACHE_HOME/meshgrad` (or `~/.cache/meshgrad`);
/// `None` without either variable.
pub fn cache_path(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(dir.join("meshgrad").join(name))
}

/// The file this machine's calibration for `ranks` ranks is cached in (`v2`: with the `[tcp]`
/// link).
fn cache_file(ranks: usize) -> Option<PathBuf> {
    cache_path(&format!("cpu-v2-{}-{ranks}ranks.toml", machine_id()))
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
    let ((alpha, beta), (tcp_alpha, tcp_beta)) = if ranks > 1 {
        (link_of(ranks, false)?, link_of(ranks, true)?)
    } else {
        ((1.0, 1e3), (1.0, 1e3))
    };
    let memory = available_gib();
    Ok(format!(
        "# This machine for {ranks} rank thread(s), measured by meshgrad plan --device-kind cpu.\n\
         name = \"cpu\"\nmemory_gib = {memory:.3}\nmemory_bandwidth_gbps = {bandwidth:.3}\n\
         devices_per_node = {ranks}\n[peak_tflops]\nf32 = {peak:.6}\nbf16 = {peak:.6}\n\
         fp8 = {peak:.6}\n[matmul]\npeak_fraction = 1.0\nhalf_dim = {half_dim:.1}\n\
         [intra_node]\nbandwidth_gbps = {beta:.3}\nlatency_us = {alpha:.3}\n\
         [inter_node]\nbandwidth_gbps = {beta:.3}\nlatency_us = {alpha:.3}\n\
         [tcp]\nbandwidth_gbps = {tcp_beta:.3}\nlatency_us = {tcp_alpha:.3}\n"
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
        write_cache(f, &text);
    }
    DeviceKind::parse(&text, "the cpu calibration")
}

/// Writes a cache file atomically (a temporary file of this process, renamed over it), so that
/// the processes of one job calibrating at once never read a half-written file; a cache that
/// cannot be written is skipped (the next run measures again).
pub fn write_cache(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, text))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_file_is_replaced_whole_and_leaves_no_temporary_behind() {
        let dir = std::env::temp_dir().join(format!("meshgrad-cache-{}", std::process::id()));
        let file = dir.join("sub").join("cpu.toml");
        write_cache(&file, "a = 1\n");
        write_cache(&file, "a = 2\n");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "a = 2\n");
        let names: Vec<_> = std::fs::read_dir(dir.join("sub")).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_measurement_of_two_ranks_is_a_device_file_with_both_links() {
        let d = DeviceKind::parse(&measure(2).unwrap(), "measured").unwrap();
        let tcp = d.tcp.expect("a [tcp] link");
        // Loopback TCP goes through the kernel's socket buffers: slower than threads sharing
        // memory, and not free.
        assert!(tcp.latency_us > 0.0 && tcp.bandwidth_gbps > 0.0, "{tcp:?}");
        assert!(d.intra_node.bandwidth_gbps > 0.0, "{:?}", d.intra_node);
        assert_eq!(d.over_tcp().unwrap().intra_node, tcp);
    }
}
