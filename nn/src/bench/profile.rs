//! The per-op breakdown of `bench --profile`: profiled steps and the table printed from them.

use std::time::Instant;

use meshgrad_tensor::profile::{self, Phase};
use meshgrad_tensor::{Device, Result};

/// Runs `steps` steps with the profiler on and every op waiting for `device` before its time is
/// taken (see `profile::set_sync`); returns the step times.
pub fn profile_synced(
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

/// Prints the profiler's records as a per-op table (mean per step over the profiled steps'
/// `times`): each phase's ops and total, and the time no op accounts for.
pub fn print_profile(times: &[f64]) {
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
