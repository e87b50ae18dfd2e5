//! The flight recorder in the `meshgrad` binary (the recorder itself is
//! [`meshgrad_parallel::comm::flight`]): `meshgrad train` dumps every rank's recent
//! communication calls to `OUT/flight/rank-R.json` on a watchdog timeout, on SIGUSR1 and when a
//! rank fails, and `meshgrad flight DIR` reads the dumps and names the rank that is behind and
//! the first call where the ranks disagree.
//!
//! Test hook: `MESHGRAD_TEST_SIGSTOP=R:S` makes rank `R` of a training run stop itself with
//! SIGSTOP at the start of step `S` (counted from 0), after printing `rank R: test hook:
//! stopping pid P with SIGSTOP at step S` on stderr: a hang made on purpose, deterministic,
//! for the tests of the recorder. Never set it otherwise.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, Result};
use meshgrad_parallel::comm::flight;

/// The variable of the SIGSTOP test hook (see the [module docs](self)).
pub const TEST_SIGSTOP_VAR: &str = "MESHGRAD_TEST_SIGSTOP";

/// Sets up the recorder's dumps for a run writing to `out`: they go to `out/flight/`, and
/// SIGUSR1 dumps them (a thread waits for the signal; the handler itself only wakes it).
/// Installing again only moves the folder.
pub fn install(out: &Path) -> Result<()> {
    flight::set_dump_dir(Some(out.join("flight")));
    static SIGUSR1: OnceLock<()> = OnceLock::new();
    if SIGUSR1.get().is_some() {
        return Ok(());
    }
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
        .context("installing the SIGUSR1 handler of the flight recorder")?;
    std::thread::Builder::new()
        .name("meshgrad-flight-sigusr1".into())
        .spawn(move || {
            for _ in signals.forever() {
                flight::report(flight::dump_all("SIGUSR1"), true);
            }
        })
        .context("starting the flight recorder's SIGUSR1 thread")?;
    let _ = SIGUSR1.set(());
    Ok(())
}

/// Dumps the recorders because this rank's run failed with `e` (nothing when no folder is set);
/// quietly, so that the error stays the one line the rank prints (a dump that cannot be written
/// adds a line saying why).
pub fn dump_on_error(e: &anyhow::Error) {
    flight::report(flight::dump_all(&format!("error: {e:#}")), false);
}

/// The SIGSTOP test hook (see the [module docs](self)): stops this process when
/// `MESHGRAD_TEST_SIGSTOP` is `RANK:STEP` for this `rank` and `step`.
pub fn test_stop_hook(rank: usize, step: usize) {
    static TARGET: OnceLock<Option<(usize, usize)>> = OnceLock::new();
    let target = TARGET.get_or_init(|| {
        let v = std::env::var(TEST_SIGSTOP_VAR).ok()?;
        let (r, s) = v.trim().split_once(':')?;
        Some((r.parse().ok()?, s.parse().ok()?))
    });
    if *target == Some((rank, step)) {
        eprintln!(
            "rank {rank}: test hook: stopping pid {} with SIGSTOP at step {step}",
            std::process::id()
        );
        let _ = signal_hook::low_level::raise(signal_hook::consts::SIGSTOP);
    }
}

/// `meshgrad flight DIR`: reads every rank's dump in `DIR` (a run's `--out` folder or its
/// `flight/` folder) and prints, per rank, its last completed and its open calls, then the
/// first call where the ranks disagree, and last `flight: behind=<ranks> call=<kind>#<seq>`
/// (`flight: behind=none call=none` when every rank agrees).
pub fn run(dir: &Path) -> Result<()> {
    let dumps = flight::read_all(dir)?;
    let a = flight::analyse(&dumps);
    println!(
        "flight: {} dump(s) of {} rank(s) in {}",
        dumps.len(),
        a.world_size,
        flight::dump_folder(dir).display()
    );
    for line in &a.lines {
        println!("{line}");
    }
    println!("{}", a.summary());
    Ok(())
}
