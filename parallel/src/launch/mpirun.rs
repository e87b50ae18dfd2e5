//! The MPI launcher: `mpirun -np N` with `--tag-output`, its lines retagged `[rank R] `, and the
//! failed rank read from mpirun's own messages (Open MPI's wording).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use meshgrad_tensor::{bail, Error, Result};

use super::processes::{describe_status, free_port, signal_name, stop_all, stop_flag};
use super::{LaunchOptions, LAUNCHER_PID_VAR};

/// The first `name` on `PATH`.
fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Rewrites mpirun's `--tag-output` prefix `[1,R]<stdout>:` (or `<stderr>`) to `[rank R] `.
fn retag(line: &str) -> Option<String> {
    let rest = line.strip_prefix('[')?;
    let (ids, rest) = rest.split_once(']')?;
    let (_, rank) = ids.split_once(',')?;
    let rank: usize = rank.parse().ok()?;
    let rest = rest
        .strip_prefix("<stdout>:")
        .or_else(|| rest.strip_prefix("<stderr>:"))?;
    Some(format!("[rank {rank}] {rest}"))
}

/// The first rank mpirun reports as failed, read from its own (untagged) messages: `(rank, what
/// happened)`, e.g. `(2, "was killed by signal 9 (SIGKILL)")`.
#[derive(Default)]
struct MpirunReport {
    failure: Option<(usize, String)>,
    /// A rank named on one line whose status follows on the next.
    pending: Option<(usize, Pending)>,
}

#[derive(Clone, Copy)]
enum Pending {
    /// `Process name: [[J,1],R]`, then `Exit code: C`.
    Exit,
    /// `MPI_ABORT was invoked on rank R ...`, then `with errorcode C.`.
    Abort,
}

impl MpirunReport {
    /// Reads one of the ranks' own lines (already retagged `[rank R] ...`): the MPI backend's
    /// panic hook writes a [`crate::comm::panic_abort_line`] before it aborts, which
    /// names the rank even when mpirun's own report is lost (Open MPI sometimes fails to print it
    /// while tearing the job down).
    fn read_rank_line(&mut self, line: &str) {
        let Some((rank, code)) = line
            .split_once("] ")
            .and_then(|(_, text)| crate::comm::parse_panic_abort_line(text))
        else {
            return;
        };
        if self.failure.is_none() {
            self.failure = Some((
                rank,
                format!("aborted the MPI job (MPI_Abort with error code {code})"),
            ));
        }
    }

    /// Reads one of mpirun's lines (Open MPI 4's wording).
    fn read(&mut self, line: &str) {
        let t = line.trim();
        let mut fail = |rank: usize, what: String| {
            if self.failure.is_none() {
                self.failure = Some((rank, what));
            }
        };
        if let Some((rank, kind)) = self.pending.take() {
            let code = match kind {
                Pending::Exit => t.strip_prefix("Exit code:").map(str::trim),
                Pending::Abort => t
                    .strip_prefix("with errorcode")
                    .map(|c| c.trim().trim_end_matches('.')),
            };
            if let Some(code) = code {
                fail(
                    rank,
                    match kind {
                        Pending::Exit => format!("exited with status {code}"),
                        Pending::Abort => {
                            format!("aborted the MPI job (MPI_Abort with error code {code})")
                        }
                    },
                );
                return;
            }
        }
        if let Some(rest) = t.strip_prefix("Process name: [[") {
            // `[[5512,1],1]`: job id, then the rank.
            if let Some(rank) = rest
                .split_once("],")
                .and_then(|(_, r)| r.trim_end_matches(']').parse().ok())
            {
                self.pending = Some((rank, Pending::Exit));
            }
        } else if let Some(rest) = t.strip_prefix("MPI_ABORT was invoked on rank ") {
            if let Some(rank) = rest.split(' ').next().and_then(|r| r.parse().ok()) {
                self.pending = Some((rank, Pending::Abort));
            }
        } else if let Some(rest) = t.strip_prefix("mpirun noticed that process rank ") {
            // `2 with PID 0 on node vm exited on signal 9 (Killed).`
            let rank = rest.split(' ').next().and_then(|r| r.parse().ok());
            let sig = rest
                .split_once("on signal ")
                .and_then(|(_, s)| s.split(' ').next())
                .and_then(|s| s.trim_end_matches('.').parse::<i32>().ok());
            if let (Some(rank), Some(sig)) = (rank, sig) {
                fail(
                    rank,
                    format!("was killed by signal {sig}{}", signal_name(sig)),
                );
            }
        }
    }
}

fn retag_lines(
    reader: impl Read + Send + 'static,
    to_stderr: bool,
    report: Arc<std::sync::Mutex<MpirunReport>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { return };
            let line = match retag(&line) {
                Some(tagged) => {
                    report
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .read_rank_line(&tagged);
                    tagged
                }
                None => {
                    report.lock().unwrap_or_else(|e| e.into_inner()).read(&line);
                    line
                }
            };
            if to_stderr {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        }
    })
}

pub(super) fn launch_mpirun(exe: &Path, opts: &LaunchOptions) -> Result<()> {
    if opts.nnodes > 1 {
        bail!("--backend mpi starts the ranks of one node; across nodes run mpirun with a hostfile yourself");
    }
    let Some(mpirun) = which("mpirun") else {
        bail!("--backend mpi needs mpirun on PATH (Debian: apt-get install openmpi-bin)");
    };
    let root = std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false);
    let mut cmd = Command::new(&mpirun);
    // N ranks whatever the number of cores, as the process launcher starts them.
    cmd.args(["--tag-output", "--oversubscribe"]);
    if root {
        cmd.arg("--allow-run-as-root");
    }
    cmd.env(
        "MASTER_ADDR",
        opts.master_addr.as_deref().unwrap_or("127.0.0.1"),
    );
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    // mpirun's daemons, not this launcher, are the ranks' parents: they stop with mpirun.
    cmd.env("MASTER_PORT", port.to_string())
        .env_remove(LAUNCHER_PID_VAR)
        .arg("-np")
        .arg(opts.nproc_per_node.to_string())
        .arg(exe)
        .args(&opts.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::msg(format!("starting {}: {e}", mpirun.display())))?;
    let mut readers = Vec::new();
    let report = Arc::new(std::sync::Mutex::new(MpirunReport::default()));
    if let Some(out) = child.stdout.take() {
        readers.push(retag_lines(out, false, report.clone()));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(retag_lines(err, true, report.clone()));
    }
    let stop = stop_flag();
    let status = loop {
        let waited = child
            .try_wait()
            .map_err(|e| Error::msg(format!("waiting for mpirun: {e}")))?;
        if let Some(s) = waited {
            break s;
        }
        if stop.load(Ordering::SeqCst) {
            // mpirun forwards SIGTERM to the ranks and stops them.
            let mut slot = [Some(child)];
            stop_all(&mut slot);
            for r in readers {
                let _ = r.join();
            }
            bail!("interrupted: stopped mpirun and its ranks");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for r in readers {
        let _ = r.join();
    }
    if status.success() {
        return Ok(());
    }
    let failure = report
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .failure
        .take();
    match failure {
        Some((rank, what)) => bail!(
            "rank {rank} {what}; mpirun stopped the other ranks ({})",
            describe_status(&status)
        ),
        None => bail!(
            "mpirun {} (its own message above says why)",
            describe_status(&status)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mpirun_tags_become_rank_prefixes() {
        assert_eq!(
            retag("[1,3]<stdout>:loss=1.0").unwrap(),
            "[rank 3] loss=1.0"
        );
        assert_eq!(retag("[1,0]<stderr>:oops").unwrap(), "[rank 0] oops");
        assert_eq!(retag("plain"), None);
    }

    fn report(lines: &str) -> Option<(usize, String)> {
        let mut r = MpirunReport::default();
        lines.lines().for_each(|l| r.read(l));
        r.failure
    }

    #[test]
    fn mpirun_messages_name_the_failed_rank() {
        // Open MPI 4.1's messages, as printed under `mpirun -np 3`.
        let exit = "--------\nmpirun detected that one or more processes exited with non-zero \
                    status, thus causing\nthe job to be terminated. The first process to do so \
                    was:\n\n  Process name: [[5512,1],1]\n  Exit code:    3\n--------";
        assert_eq!(report(exit), Some((1, "exited with status 3".into())));
        let signal = "mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 \
                      (Killed).";
        assert_eq!(
            report(signal),
            Some((2, "was killed by signal 9 (SIGKILL)".into()))
        );
        let abort = "MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD\nwith \
                     errorcode 101.\n\nNOTE: invoking MPI_ABORT causes Open MPI to kill all MPI \
                     processes.\nmpirun noticed that process rank 0 with PID 0 on node vm exited \
                     on signal 15 (Terminated).";
        assert_eq!(
            report(abort),
            Some((
                2,
                "aborted the MPI job (MPI_Abort with error code 101)".into()
            ))
        );
        assert_eq!(report("Primary job  terminated normally"), None);
    }

    #[test]
    fn a_ranks_panic_line_names_it() {
        let mut r = MpirunReport::default();
        r.read_rank_line("[rank 3] thread 'main' panicked at src/x.rs:1:1:");
        assert_eq!(r.failure, None);
        r.read_rank_line(
            "[rank 1] rank 1: panicked; aborting the MPI job (MPI_Abort with error code 101)",
        );
        // mpirun's own report afterwards does not replace the first failure.
        r.read("MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD");
        r.read("with errorcode 7.");
        assert_eq!(
            r.failure,
            Some((
                1,
                "aborted the MPI job (MPI_Abort with error code 101)".into()
            ))
        );
    }
}
