//! The plain-process launcher: starts the ranks, prefixes their lines, watches them and stops
//! them all when one fails or the launcher is interrupted.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use meshgrad_tensor::{bail, Error, Result};

use super::{LaunchBackend, LaunchOptions, BACKEND_VAR, GRACE, LAUNCHER_PID_VAR};

/// A free TCP port on this machine (bound, then released).
pub(super) fn free_port() -> Result<u16> {
    let io = |e: std::io::Error| Error::msg(format!("finding a free port: {e}"));
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    Ok(l.local_addr().map_err(io)?.port())
}

/// Copies `reader`'s lines to `out`, each prefixed with `prefix`; a last line without a newline
/// gets one.
fn forward_lines(
    reader: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(reader);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let mut buf = Vec::with_capacity(prefix.len() + line.len());
            buf.extend_from_slice(prefix.as_bytes());
            buf.extend_from_slice(&line);
            // One write of the whole line under the lock: lines of ranks never interleave.
            let _ = if to_stderr {
                std::io::stderr().lock().write_all(&buf)
            } else {
                let mut out = std::io::stdout().lock();
                out.write_all(&buf).and_then(|_| out.flush())
            };
        }
    })
}

/// `exited with status 3` or `was killed by signal 9 (SIGKILL)`.
pub fn describe_status(status: &ExitStatus) -> String {
    if let Some(code) = status.code() {
        format!("exited with status {code}")
    } else if let Some(sig) = status.signal() {
        format!("was killed by signal {sig}{}", signal_name(sig))
    } else {
        format!("ended with {status}")
    }
}

/// ` (SIGKILL)` for 9, and so on for the common signals; empty for the others.
pub(super) fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => " (SIGHUP)",
        2 => " (SIGINT)",
        6 => " (SIGABRT)",
        9 => " (SIGKILL)",
        11 => " (SIGSEGV)",
        15 => " (SIGTERM)",
        _ => "",
    }
}

/// Sends SIGTERM to a running child (through the `kill` command).
pub(super) fn terminate(child: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Registers SIGINT, SIGTERM and SIGHUP to set the returned flag.
pub(super) fn stop_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        let _ = signal_hook::flag::register(sig, flag.clone());
    }
    flag
}

pub(super) fn launch_processes(exe: &Path, opts: &LaunchOptions) -> Result<()> {
    let n = opts.nproc_per_node;
    let world = opts.nnodes * n;
    let addr = opts
        .master_addr
        .clone()
        .unwrap_or_else(|| "127.0.0.1".into());
    let port = match opts.master_port {
        Some(p) => p,
        None if opts.nnodes == 1 => free_port()?,
        None => 29500,
    };
    let stop = stop_flag();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    let mut readers = Vec::new();
    for local in 0..n {
        let rank = opts.node_rank * n + local;
        let mut cmd = Command::new(exe);
        cmd.args(&opts.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", opts.node_rank.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.env(LAUNCHER_PID_VAR, std::process::id().to_string());
        if opts.backend == LaunchBackend::Nccl {
            cmd.env(BACKEND_VAR, "nccl");
        } else {
            cmd.env_remove(BACKEND_VAR);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut children);
                bail!("could not start rank {rank} ({}): {e}", exe.display());
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            readers.push(forward_lines(out, prefix.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(forward_lines(err, prefix, true));
        }
        children.push(Some(child));
    }
    // Watch: the first rank to fail (in the order observed) is the one reported; of several
    // seen failing in one round, a rank killed by a signal (likely the cause: its peers then
    // fail on the broken connection) is named first.
    let mut failures: Vec<Failure> = Vec::new();
    let mut interrupted = false;
    let mut running = n;
    while running > 0 {
        if stop.load(Ordering::SeqCst) {
            interrupted = true;
            break;
        }
        for (local, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            let rank = opts.node_rank * n + local;
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    running -= 1;
                    if !status.success() {
                        failures.push(Failure {
                            rank,
                            what: describe_status(&status),
                            by_signal: status.signal().is_some(),
                        });
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    *slot = None;
                    running -= 1;
                    failures.push(Failure {
                        rank,
                        what: format!("could not be waited for: {e}"),
                        by_signal: false,
                    });
                }
            }
        }
        if !failures.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopped = children.iter().flatten().count();
    stop_all(&mut children);
    for r in readers {
        let _ = r.join();
    }
    if interrupted {
        bail!("interrupted: stopped {stopped} running rank(s)")
    }
    match failure_line(failures, stopped) {
        None => Ok(()),
        Some(line) => bail!("{line}"),
    }
}

/// A rank that ended badly, as the launcher saw it.
pub(super) struct Failure {
    rank: usize,
    /// `exited with status 3`, `was killed by signal 9 (SIGKILL)`, ...
    what: String,
    by_signal: bool,
}

/// The launcher's one-line report of the ranks seen failing in one round (`None` when none
/// did): a rank killed by a signal first, else the first seen; the others after `also`; then
/// how many running ranks were stopped.
pub(super) fn failure_line(mut failures: Vec<Failure>, stopped: usize) -> Option<String> {
    if let Some(i) = failures.iter().position(|f| f.by_signal) {
        let killed = failures.remove(i);
        failures.insert(0, killed);
    }
    let mut parts = failures
        .iter()
        .map(|f| format!("rank {} {}", f.rank, f.what));
    let mut line = parts.next()?;
    let also: Vec<String> = parts.collect();
    if !also.is_empty() {
        line += &format!(" (also: {})", also.join(", "));
    }
    if stopped > 0 {
        line += &format!("; stopped the other {stopped} running rank(s)");
    }
    Some(line)
}

/// SIGTERM to every running child, SIGKILL to those still running after [`GRACE`], then reaps
/// them all.
pub(super) fn stop_all(children: &mut [Option<Child>]) {
    for child in children.iter().flatten() {
        terminate(child);
    }
    let deadline = Instant::now() + GRACE;
    loop {
        let mut alive = 0;
        for slot in children.iter_mut() {
            if let Some(child) = slot {
                match child.try_wait() {
                    Ok(None) => alive += 1,
                    _ => *slot = None,
                }
            }
        }
        if alive == 0 {
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_killed_by_a_signal_is_named_before_the_peers_that_failed_after_it() {
        let f = |rank, what: &str, by_signal| Failure {
            rank,
            what: what.into(),
            by_signal,
        };
        assert_eq!(failure_line(vec![], 3), None);
        assert_eq!(
            failure_line(vec![f(2, "exited with status 3", false)], 1).unwrap(),
            "rank 2 exited with status 3; stopped the other 1 running rank(s)"
        );
        let line = failure_line(
            vec![
                f(0, "exited with status 1", false),
                f(1, "was killed by signal 9 (SIGKILL)", true),
            ],
            0,
        )
        .unwrap();
        assert_eq!(
            line,
            "rank 1 was killed by signal 9 (SIGKILL) (also: rank 0 exited with status 1)"
        );
    }
}
