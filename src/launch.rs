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
//!   `--oversubscribe`, and `--allow-run-as-root` as root), with the same line prefixes, so they
//!   form one MPI world. mpirun stops the job when a rank fails; the launcher reads which rank
//!   from mpirun's own message (Open MPI's wording) and fails with the same kind of line, e.g.
//!   `rank 2 was killed by signal 9 (SIGKILL); mpirun stopped the other ranks (...)`.
//!
//! * The default, `--backend tcp`, starts plain processes; `meshgrad train` in them trains over
//!   the TCP backend (`parallel::comm::tcp`), its ranks connecting through rank 0's store.
//! * `--backend nccl` starts plain processes as `tcp` does, with `MESHGRAD_BACKEND=nccl` so
//!   that `meshgrad train` in each rank uses the NCCL backend on `cuda:LOCAL_RANK`, rendezvousing
//!   through rank 0's store. It first checks that NCCL can run here (built with `--features
//!   nccl`, at least `--nproc-per-node` CUDA devices) and fails in one line saying why not.
//!
//! Signals are sent with the `kill` command (no unsafe code) and `Child::kill`. Every rank
//! started directly (tcp, nccl) ends itself when the launcher is gone, even after a SIGKILL
//! that gave the launcher no chance to stop it ([`exit_with_launcher`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::ToSocketAddrs;
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
use meshgrad_parallel::layout::MAX_WORLD_SIZE;

/// How long the other ranks get between SIGTERM and SIGKILL once one rank failed.
pub const GRACE: Duration = Duration::from_secs(5);

/// Which launcher starts the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchBackend {
    /// Plain child processes with torchrun's variables (`meshgrad train` in them trains over
    /// TCP).
    Tcp,
    /// The system's `mpirun`.
    Mpi,
    /// Plain child processes, one per GPU, training over NCCL (`MESHGRAD_BACKEND=nccl`).
    Nccl,
}

/// The variable `meshgrad launch --backend nccl` sets in every rank so that `meshgrad train`
/// uses the NCCL backend (its `--backend` flag overrides it).
pub const BACKEND_VAR: &str = "MESHGRAD_BACKEND";

impl std::str::FromStr for LaunchBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tcp" => Ok(LaunchBackend::Tcp),
            "mpi" => Ok(LaunchBackend::Mpi),
            "nccl" => Ok(LaunchBackend::Nccl),
            _ => Err(format!("unknown backend {s:?} (expected tcp, mpi or nccl)")),
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

/// The variable through which `meshgrad launch` gives each rank it starts its own pid, so the
/// rank can end with it ([`exit_with_launcher`]).
pub const LAUNCHER_PID_VAR: &str = "MESHGRAD_LAUNCHER_PID";

/// In a rank started by `meshgrad launch` (which sets [`LAUNCHER_PID_VAR`]): starts a thread
/// that ends this process, with one line on stderr, once the launcher is gone (this process's
/// parent is no longer the launcher: it exited or was killed, even by SIGKILL, which leaves it
/// no chance to stop its ranks). Checked every 200 ms. Does nothing in other processes.
pub fn exit_with_launcher() {
    let Some(launcher) = std::env::var(LAUNCHER_PID_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
    else {
        return;
    };
    let watch = move || loop {
        if std::os::unix::process::parent_id() != launcher {
            let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
            // Not eprintln!: the launcher held the other end of stderr, and a write to a broken
            // pipe must not stop this thread before it ends the process.
            let _ = writeln!(
                std::io::stderr(),
                "error: rank {rank}: the launcher (pid {launcher}) is gone; stopping"
            );
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = std::thread::Builder::new()
        .name("launcher-watch".into())
        .spawn(watch);
}

/// The most processes `meshgrad launch` starts on one node.
pub const MAX_PROCS_PER_NODE: usize = 1024;

/// Runs the job: `Ok` when every rank exited 0, else one line naming the failed rank.
pub fn launch(opts: &LaunchOptions) -> Result<()> {
    if opts.nproc_per_node == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    if opts.nproc_per_node > MAX_PROCS_PER_NODE {
        bail!(
            "--nproc-per-node {} is more than the {MAX_PROCS_PER_NODE} processes one node may \
             start",
            opts.nproc_per_node
        );
    }
    if opts.nnodes == 0 {
        bail!("--nnodes must be at least 1");
    }
    let world = opts.nnodes.checked_mul(opts.nproc_per_node);
    if world.is_none_or(|w| w > MAX_WORLD_SIZE) {
        bail!(
            "--nnodes {} x --nproc-per-node {} is more than the {MAX_WORLD_SIZE} processes a job \
             may have",
            opts.nnodes,
            opts.nproc_per_node
        );
    }
    if opts.master_port == Some(0) {
        bail!(
            "--master-port 0 is not a port the ranks can meet at: give a fixed port (1 to 65535)"
        );
    }
    if let Some(addr) = &opts.master_addr {
        // A name that does not resolve fails now, not after the ranks' store timeout.
        (addr.as_str(), opts.master_port.unwrap_or(29500))
            .to_socket_addrs()
            .with_context(|| format!("--master-addr {addr} does not resolve"))?;
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
        LaunchBackend::Tcp => launch_processes(&exe, opts),
        LaunchBackend::Mpi => launch_mpirun(&exe, opts),
        LaunchBackend::Nccl => {
            if let Some(why) =
                meshgrad_parallel::comm::backend::nccl_unavailable(opts.nproc_per_node)
            {
                bail!("{why}");
            }
            launch_processes(&exe, opts)
        }
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
        format!("was killed by signal {sig}{}", signal_name(sig))
    } else {
        format!("ended with {status}")
    }
}

/// ` (SIGKILL)` for 9, and so on for the common signals; empty for the others.
fn signal_name(sig: i32) -> &'static str {
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
struct Failure {
    rank: usize,
    /// `exited with status 3`, `was killed by signal 9 (SIGKILL)`, ...
    what: String,
    by_signal: bool,
}

/// The launcher's one-line report of the ranks seen failing in one round (`None` when none
/// did): a rank killed by a signal first, else the first seen; the others after `also`; then
/// how many running ranks were stopped.
fn failure_line(mut failures: Vec<Failure>, stopped: usize) -> Option<String> {
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
    /// panic hook writes a [`meshgrad_parallel::comm::panic_abort_line`] before it aborts, which
    /// names the rank even when mpirun's own report is lost (Open MPI sometimes fails to print it
    /// while tearing the job down).
    fn read_rank_line(&mut self, line: &str) {
        let Some((rank, code)) = line
            .split_once("] ")
            .and_then(|(_, text)| meshgrad_parallel::comm::parse_panic_abort_line(text))
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
        .with_context(|| format!("starting {}", mpirun.display()))?;
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

/// Refuses a `meshgrad train` whose backend runs ranks as threads (or MPI) but that was started
/// as one of several processes (torchrun's or Slurm's variables with a world size above 1): each
/// process would otherwise train its own independent copy of the model. (torchrun's processes
/// train over TCP by default and do not come here.) Ranks of an MPI world pass: Open MPI's
/// (`mpirun`), and Slurm's tasks started with PMIx (`srun --mpi=pmix`, which sets `PMIX_RANK`),
/// whose `MPI_Init` forms the world; they train over MPI (see
/// `ranks::check_mpi_world`, which says to rebuild without the `mpi` feature).
pub fn refuse_multi_process(env: &RankEnv) -> Result<()> {
    refuse_multi_process_with(env, std::env::var_os("PMIX_RANK").is_some())
}

/// [`refuse_multi_process`] with whether `PMIX_RANK` is set.
fn refuse_multi_process_with(env: &RankEnv, pmix: bool) -> Result<()> {
    use meshgrad_parallel::comm::EnvSource;
    if env.source == EnvSource::OpenMpi || (env.source == EnvSource::Slurm && pmix) {
        return Ok(());
    }
    if env.is_multi_process() {
        let how = if env.source == EnvSource::Slurm {
            "under srun, MPI joins them: `srun --mpi=pmix` with meshgrad built with \
             `--features mpi`"
        } else {
            "train them over TCP with --backend tcp (the default under meshgrad launch and \
             torchrun)"
        };
        bail!(
            "{}={} ({}, rank {}) asks for {} processes, but this run's backend cannot join \
             them (each would train alone): {how}; or run one process with --layout dp={} \
             (ranks as threads)",
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
    if p.mpi {
        return probe_mpi(p);
    }
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

/// `launch-probe --mpi`: joins the MPI world and all-reduces a number every 20 ms for `sleep`
/// seconds, so that the ranks wait in a collective when one stops: `exit_rank` exits with
/// `exit_code`, `panic_rank` panics, after `exit_delay` seconds.
#[cfg(feature = "mpi")]
fn probe_mpi(p: &ProbeOptions) -> Result<()> {
    use meshgrad_parallel::comm::mpi::{finalize, MpiCommunicator};
    use meshgrad_parallel::{Communicator, ReduceOp};
    use meshgrad_tensor::{Device, Tensor};
    let world = MpiCommunicator::world()?;
    let rank = world.rank();
    println!("mpi rank={rank} world_size={}", world.world_size());
    let tick = Duration::from_millis(20);
    let steps = (p.sleep / tick.as_secs_f64()).ceil() as usize;
    let stop_at = (p.exit_delay / tick.as_secs_f64()).ceil() as usize;
    let one = Tensor::from_vec(vec![1.0f32], 1, Device::Cpu)?;
    for step in 0..steps.max(1) {
        if step == stop_at {
            if p.panic_rank == Some(rank) {
                panic!("launch-probe: a deliberate panic on rank {rank}");
            }
            if p.exit_rank == Some(rank) {
                std::process::exit(p.exit_code);
            }
        }
        world.all_reduce(&one, ReduceOp::Sum)?.wait()?;
        std::thread::sleep(tick);
    }
    println!("mpi done");
    drop(world);
    finalize();
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn probe_mpi(_p: &ProbeOptions) -> Result<()> {
    bail!("launch-probe --mpi needs meshgrad built with `--features mpi`")
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
    /// Join the MPI world and wait in collectives (see `probe_mpi`).
    pub mpi: bool,
    /// With `mpi`: the rank that panics after `exit_delay` seconds.
    pub panic_rank: Option<usize>,
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
        let e = refuse_multi_process_with(&env, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("WORLD_SIZE=2 (torchrun's variables, rank 1) asks for 2 processes"),
            "{e}"
        );
        // srun's tasks: an MPI world with PMIx (srun --mpi=pmix), refused without.
        let slurm = RankEnv {
            source: meshgrad_parallel::comm::EnvSource::Slurm,
            ..env
        };
        assert!(refuse_multi_process_with(&slurm, true).is_ok());
        let e = refuse_multi_process_with(&slurm, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("SLURM_NTASKS=2 (Slurm's variables, rank 1)") && e.contains("--mpi=pmix"),
            "{e}"
        );
    }
}
