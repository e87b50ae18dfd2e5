//! Starting several copies of a program as the ranks of one job, the way torchrun does, and
//! watching them (`meshgrad launch` is this launcher; a program of your own that trains with
//! meshgrad can use it the same way).
//!
//! * Every child gets torchrun's variables: `RANK = node_rank * nproc_per_node + local_rank`,
//!   `WORLD_SIZE = nnodes * nproc_per_node`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the
//!   node's index), `MASTER_ADDR` (default `127.0.0.1`) and `MASTER_PORT` (default: a free port on
//!   one node, 29500 across nodes, where every node must agree). Rank 0 serves the job's
//!   [`TcpStore`](crate::comm::store::TcpStore) there.
//! * Every line a child writes is prefixed with `[rank R] ` (its stdout to stdout, its stderr to
//!   stderr), one whole line at a time.
//! * When a child exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL
//!   after a grace period of [`GRACE`], and the launcher fails with one line naming the rank and
//!   its exit status or signal. When the launcher itself gets SIGINT, SIGTERM or SIGHUP it stops
//!   the children the same way. It succeeds when every child exits 0.
//! * [`LaunchBackend::Mpi`] starts the ranks through the system's `mpirun -np N` instead (adding
//!   `--oversubscribe`, and `--allow-run-as-root` as root), with the same line prefixes, so they
//!   form one MPI world. mpirun stops the job when a rank fails; the launcher reads which rank
//!   from mpirun's own message (Open MPI's wording) and fails with the same kind of line, e.g.
//!   `rank 2 was killed by signal 9 (SIGKILL); mpirun stopped the other ranks (...)`.
//! * [`LaunchBackend::Tcp`] starts plain processes; `meshgrad train` in them trains over the TCP
//!   backend ([`crate::comm::tcp`]), its ranks connecting through rank 0's store.
//! * [`LaunchBackend::Nccl`] starts plain processes as `Tcp` does, with [`BACKEND_VAR`]` = nccl`
//!   so that `meshgrad train` in each rank uses the NCCL backend on `cuda:LOCAL_RANK`,
//!   rendezvousing through rank 0's store. It first checks that NCCL can run here (built with the
//!   `nccl` feature, at least `nproc_per_node` CUDA devices) and fails in one line saying why not.
//!
//! Signals are sent with the `kill` command (no unsafe code) and `Child::kill`. Every rank
//! started directly (tcp, nccl) ends itself when the launcher is gone, even after a SIGKILL
//! that gave the launcher no chance to stop it, when it calls [`exit_with_launcher`].

mod mpirun;
mod processes;

use std::io::Write;
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::time::Duration;

use meshgrad_tensor::{bail, Error, Result};

use crate::layout::MAX_WORLD_SIZE;
pub use processes::describe_status;

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

/// What to launch and where.
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
    /// The program every rank runs; `None` runs this executable again.
    pub program: Option<PathBuf>,
    /// The arguments every rank gets, e.g. `["train", "--steps", "10"]`.
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
///
/// Four ranks of a program of one's own on this machine, each finding its rank and the store
/// through [`RankEnv::detect`](crate::comm::RankEnv::detect):
///
/// ```no_run
/// use meshgrad_parallel::launch::{launch, LaunchBackend, LaunchOptions};
/// launch(&LaunchOptions {
///     nproc_per_node: 4,
///     nnodes: 1,
///     node_rank: 0,
///     master_addr: None,
///     master_port: None,
///     backend: LaunchBackend::Tcp,
///     program: Some("target/release/my-trainer".into()),
///     args: vec!["--steps".into(), "100".into()],
/// })?;
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
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
            .map_err(|e| Error::msg(format!("--master-addr {addr} does not resolve: {e}")))?;
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
    let exe = match &opts.program {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| Error::msg(format!("finding this executable: {e}")))?,
    };
    match opts.backend {
        LaunchBackend::Tcp => processes::launch_processes(&exe, opts),
        LaunchBackend::Mpi => mpirun::launch_mpirun(&exe, opts),
        LaunchBackend::Nccl => {
            if let Some(why) = crate::comm::backend::nccl_unavailable(opts.nproc_per_node) {
                bail!("{why}");
            }
            processes::launch_processes(&exe, opts)
        }
    }
}
