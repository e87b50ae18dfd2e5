//! `meshgrad launch`: starts several copies of this executable as the ranks of one job, the way
//! torchrun does, and watches them.
//!
//! * Every child gets torchrun's variables: `RANK = node_rank * nproc_per_node + local_rank`,
//!   `WORLD_SIZE = nnodes * nproc_per_node`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the
//!   node's index), `MASTER_ADDR` (default `127.0.0.1`) and `MASTER_PORT` (default: a free port on
//!   one node, 29500 across nodes, where every node must agree). Rank 0 serves the job's
//!   [`TcpStore`](meshgrad_parallel::comm::store::TcpStore) there.
//! * Every line a child writes is prefixed with `[rank R] ` (its stdout to stdout, its stderr to
//!   stderr), one whole line at a time.
//! * When a child exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL
//!   after a grace period of [`GRACE`], and the launcher fails with one line naming the rank and
//!   its exit status or signal. When the launcher itself gets SIGINT, SIGTERM or SIGHUP it stops
//!   the children the same way. It succeeds when every child exits 0.
//! * `--backend mpi` starts the ranks through the system's `mpirun -np N` instead (adding
//!   `--allow-run-as-root --oversubscribe` as root), with the same line prefixes, so they form one
//!   MPI world; mpirun stops the job when a rank fails.
//!
//! Signals are sent with the `kill` command (no unsafe code) and `Child::kill`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use meshgrad_parallel::comm::RankEnv;

/// How long the other ranks get between SIGTERM and SIGKILL once one rank failed.
pub const GRACE: Duration = Duration::from_secs(5);

/// Which launcher starts the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchBackend {
    /// Plain child processes with torchrun's variables.
    Threads,
    /// The system's `mpirun`.
    Mpi,
}

impl std::str::FromStr for LaunchBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "threads" => Ok(LaunchBackend::Threads),
            "mpi" => Ok(LaunchBackend::Mpi),
            _ => Err(format!("unknown backend {s:?} (expected threads or mpi)")),
        }
    }
}

/// What `meshgrad launch` was asked to do.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Processes on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Where rank 0's store listens (default `127.0.0.1`).
    pub master_addr: Option<String>,
    /// The store's port (default: a free port on one node, 29500 across nodes).
    pub master_port: Option<u16>,
    /// Plain processes or mpirun.
    pub backend: LaunchBackend,
    /// The meshgrad arguments every rank runs, e.g. `["train", "--steps", "10"]`.
    pub args: Vec<String>,
}

/// Runs the job: `Ok` when every rank exited 0, else one line naming the failed rank.
pub fn launch(opts: &LaunchOptions) -> Result<()> {
    if opts.nproc_per_node == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    if opts.nnodes == 0 {
        bail!("--nnodes must be at least 1");
    }
    if opts.node_rank >= opts.nnodes {
        bail!(
            "--node-rank {} is not below --nnodes {}",
            opts.node_rank,
            opts.nnodes
        );
    }
    if opts.args.is_empty() {
        bail!("nothing to run: give the meshgrad arguments after --, e.g. meshgrad launch --nproc-per-node 2 -- train --steps 10");
    }
    let exe = std::env::current_exe().context("finding the meshgrad executable")?;
    match opts.backend {
        LaunchBackend::Threads => launch_processes(&exe, opts),
        LaunchBackend::Mpi => launch_mpirun(&exe, opts),
    }
}

/// A free TCP port on this machine (bound, then released).
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
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
        let name = match sig {
            1 => " (SIGHUP)",
            2 => " (SIGINT)",
            6 => " (SIGABRT)",
            9 => " (SIGKILL)",
            11 => " (SIGSEGV)",
            15 => " (SIGTERM)",
            _ => "",
        };
        format!("was killed by signal {sig}{name}")
    } else {
        format!("ended with {status}")
    }
}

/// Sends SIGTERM to a running child (through the `kill` command).
fn terminate(child: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Registers SIGINT, SIGTERM and SIGHUP to set the returned flag.
fn stop_flag() -> Arc<AtomicBool> {
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

fn launch_processes(exe: &Path, opts: &LaunchOptions) -> Result<()> {
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
    // Watch: the first rank to fail (in the order observed) is the one reported.
    let mut failure: Option<(usize, String)> = None;
    let mut running = n;
    while running > 0 {
        if stop.load(Ordering::SeqCst) && failure.is_none() {
            failure = Some((usize::MAX, "interrupted".into()));
            break;
        }
        for (local, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    running -= 1;
                    if !status.success() && failure.is_none() {
                        failure = Some((opts.node_rank * n + local, describe_status(&status)));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    *slot = None;
                    running -= 1;
                    if failure.is_none() {
                        failure = Some((
                            opts.node_rank * n + local,
                            format!("could not be waited for: {e}"),
                        ));
                    }
                }
            }
        }
        if failure.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopped = children.iter().flatten().count();
    stop_all(&mut children);
    for r in readers {
        let _ = r.join();
    }
    match failure {
        None => Ok(()),
        Some((usize::MAX, _)) => {
            bail!("interrupted: stopped {stopped} running rank(s)")
        }
        Some((rank, what)) => {
            let others = if stopped > 0 {
                format!("; stopped the other {stopped} running rank(s)")
            } else {
                String::new()
            };
            bail!("rank {rank} {what}{others}")
        }
    }
}

/// SIGTERM to every running child, SIGKILL to those still running after [`GRACE`], then reaps
/// them all.
fn stop_all(children: &mut [Option<Child>]) {
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

fn retag_lines(reader: impl Read + Send + 'static, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { return };
            let line = retag(&line).unwrap_or(line);
            if to_stderr {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        }
    })
}

fn launch_mpirun(exe: &Path, opts: &LaunchOptions) -> Result<()> {
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
    cmd.arg("--tag-output");
    if root {
        cmd.args(["--allow-run-as-root", "--oversubscribe"]);
    }
    cmd.env(
        "MASTER_ADDR",
        opts.master_addr.as_deref().unwrap_or("127.0.0.1"),
    );
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    cmd.env("MASTER_PORT", port.to_string())
        .arg("-np")
        .arg(opts.nproc_per_node.to_string())
        .arg(exe)
        .args(&opts.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", mpirun.display()))?;
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        readers.push(retag_lines(out, false));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(retag_lines(err, true));
    }
    let stop = stop_flag();
    let status = loop {
        if let Some(s) = child.try_wait()? {
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
    if !status.success() {
        bail!(
            "mpirun {} (a rank failed; mpirun's own message above names it)",
            describe_status(&status)
        );
    }
    Ok(())
}

/// Refuses a `meshgrad train` that was started as one of several processes (torchrun's or
/// Slurm's variables with a world size above 1) when no multi-process backend can join them:
/// each process would otherwise train its own independent copy of the model. Open MPI's ranks
/// pass: they train over MPI (see `train_parallel::check_mpi_world`).
pub fn refuse_multi_process(env: &RankEnv) -> Result<()> {
    // Ranks started by mpirun train over MPI (the `mpi` feature; without it
    // `train_parallel::check_mpi_world` says to rebuild).
    if env.source == meshgrad_parallel::comm::EnvSource::OpenMpi {
        return Ok(());
    }
    if env.is_multi_process() {
        bail!(
            "{}={} ({}, rank {}) asks for {} processes, but meshgrad train has no multi-process \
             backend for them yet (each would train alone); run one process with --layout dp={} \
             (ranks as threads) instead",
            env.source.world_size_var(),
            env.world_size,
            env.source.describe(),
            env.rank,
            env.world_size,
            env.world_size
        );
    }
    Ok(())
}

/// `meshgrad launch-probe`: prints what a rank sees (for tests and for checking a launch), then
/// optionally uses the store, fails or sleeps.
pub fn probe(p: &ProbeOptions) -> Result<()> {
    if p.ignore_sigterm {
        // A handler replaces SIGTERM's default action: only SIGKILL stops this rank now.
        signal_hook::flag::register(
            signal_hook::consts::SIGTERM,
            Arc::new(AtomicBool::new(false)),
        )?;
    }
    let env = RankEnv::detect()?;
    println!(
        "rank={} world_size={} local_rank={} local_world_size={} node_rank={} master={}:{} source={:?} pid={}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.node_rank,
        env.master_addr.as_deref().unwrap_or("-"),
        env.master_port.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
        env.source,
        std::process::id()
    );
    eprintln!("probe stderr");
    if p.store {
        use meshgrad_parallel::comm::store::TcpStore;
        let st = TcpStore::from_env(&env, Duration::from_secs(30))?;
        st.set(
            &format!("pid/{}", env.rank),
            std::process::id().to_string().as_bytes(),
        )?;
        st.barrier("probe")?;
        let pids: Vec<String> = (0..env.world_size)
            .map(|r| {
                st.get(&format!("pid/{r}"))
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
            })
            .collect::<std::result::Result<_, _>>()?;
        println!("store pids={}", pids.join(","));
        st.barrier("done")?;
    }
    if p.exit_rank == Some(env.rank) {
        std::thread::sleep(Duration::from_secs_f64(p.exit_delay));
        std::process::exit(p.exit_code);
    }
    if p.sleep > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(p.sleep));
    }
    Ok(())
}

/// What `meshgrad launch-probe` does after printing the rank variables.
#[derive(Clone, Debug, Default)]
pub struct ProbeOptions {
    /// The rank that exits with `exit_code`, after `exit_delay` seconds.
    pub exit_rank: Option<usize>,
    /// Exit status of `exit_rank`.
    pub exit_code: i32,
    /// Seconds `exit_rank` waits before exiting.
    pub exit_delay: f64,
    /// Seconds every other rank sleeps before exiting 0.
    pub sleep: f64,
    /// Exchange pids through the rendezvous store and print them.
    pub store: bool,
    /// Ignore SIGTERM (so the launcher must use SIGKILL).
    pub ignore_sigterm: bool,
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

    #[test]
    fn refuses_a_world_above_one() {
        assert!(refuse_multi_process(&RankEnv::single()).is_ok());
        let env = RankEnv {
            world_size: 2,
            rank: 1,
            local_world_size: 2,
            local_rank: 1,
            source: meshgrad_parallel::comm::EnvSource::Torchrun,
            ..RankEnv::single()
        };
        let e = refuse_multi_process(&env).unwrap_err().to_string();
        assert!(
            e.starts_with("WORLD_SIZE=2 (torchrun's variables, rank 1) asks for 2 processes"),
            "{e}"
        );
    }
}
