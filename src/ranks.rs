//! Where the ranks of a layout run: threads of this process (the default), or this process as
//! one rank of a job of processes (TCP under `meshgrad launch`, MPI under `mpirun`, NCCL), each
//! with its [`LayoutMesh`] (`on_ranks`); the backend choice and its checks; the layout checks
//! and the header's description of a layout shared by every model.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use meshgrad_parallel::comm::{flight, run_ranks, Backend, RankCtx, RankEnv, RunOptions};
use meshgrad_parallel::{Communicator, LayoutMesh, ParallelLayout};
use meshgrad_tensor::Device;

use crate::config::TrainConfig;
use crate::reference::mesh_world;
use crate::run_setup::{check_microbatches, check_sequence_parallel, TrainOptions};

/// Runs `body` on the ranks of `layout` (threads of this process, each collective failing after
/// `timeout` without its peers; or this process's rank of a job of processes), each with its
/// [`LayoutMesh`], and returns what rank 0 returned. In `reference` mode the mesh's groups add
/// float sums in the aligned tree over their ranks ([`mesh_world`]). `body` returns `Some` on
/// the leader only.
pub(crate) fn on_ranks<T: Send>(
    layout: &ParallelLayout,
    timeout: Duration,
    reference: bool,
    body: impl Fn(&RankCtx, &LayoutMesh) -> Result<Option<T>> + Send + Sync,
) -> Result<T> {
    match selected_backend() {
        Backend::Nccl => return on_nccl_rank(layout, timeout, reference, body),
        Backend::Tcp => {
            let world = tcp_world(layout, timeout)?;
            return on_process_rank(world, layout, reference, body, || Ok(()));
        }
        Backend::Threads | Backend::Mpi => {}
    }
    if let Some(n) = mpi_world_size() {
        return on_mpi_rank(layout, n, timeout, reference, body);
    }
    let run_opts = RunOptions::with_timeout(timeout);
    let results = run_ranks(layout.world_size(), &run_opts, |ctx| {
        let mesh = layout.mesh(mesh_world(ctx.comm.clone(), reference))?;
        // anyhow's chain, flattened to one line, for the tensor-level error type.
        body(&ctx, &mesh).map_err(|e| {
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            meshgrad_tensor::Error::msg(msg.join(": "))
        })
    })?;
    results
        .into_iter()
        .flatten()
        .next()
        .ok_or_else(|| anyhow::anyhow!("rank 0 returned no result"))
}

static BACKEND: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();

/// The backend [`resolve_backend`] chose for this process (threads when it was not called).
pub(crate) fn selected_backend() -> Backend {
    BACKEND.get().copied().unwrap_or(Backend::Threads)
}

/// Chooses `meshgrad train`'s communication backend: `flag` (`--backend`), else
/// `MESHGRAD_BACKEND` (which `meshgrad launch --backend nccl` sets), else
/// [`default_backend`](meshgrad_parallel::comm::default_backend) for the CPU, where training
/// runs (threads in one process, tcp between the processes of `meshgrad launch` or torchrun,
/// mpi under mpirun). NCCL is checked at once: a one-line error when this build has no NCCL or
/// this process has no GPU `cuda:LOCAL_RANK`; `mpi` needs mpirun's variables, `tcp` torchrun's
/// (`MASTER_PORT`). The choice is kept for the layout runner (`on_ranks`).
pub fn resolve_backend(flag: Option<&str>, env: &RankEnv) -> Result<Backend> {
    let var = std::env::var(meshgrad_parallel::launch::BACKEND_VAR)
        .ok()
        .filter(|v| !v.is_empty());
    let chosen = match flag.map(str::to_string).or(var) {
        Some(s) => s.parse::<Backend>().map_err(anyhow::Error::msg)?,
        None => meshgrad_parallel::comm::default_backend(Device::Cpu, env),
    };
    match chosen {
        Backend::Nccl => {
            if let Some(why) =
                meshgrad_parallel::comm::backend::nccl_unavailable(env.local_rank + 1)
            {
                anyhow::bail!("{why}");
            }
        }
        Backend::Mpi if mpi_world_size().is_none() => anyhow::bail!(
            "--backend mpi: this process was not started by mpirun as one of several ranks \
             (run `meshgrad launch --backend mpi --nproc-per-node N -- train ...` or mpirun -np N)"
        ),
        Backend::Tcp if env.source != meshgrad_parallel::comm::EnvSource::Torchrun => {
            anyhow::bail!(
                "--backend tcp: this process was not started by meshgrad launch or torchrun (no \
                 RANK and WORLD_SIZE); run `meshgrad launch --nproc-per-node N -- train ...`"
            )
        }
        Backend::Tcp if env.master_port.is_none() => anyhow::bail!(
            "--backend tcp: MASTER_PORT is not set: rank {} cannot find rank 0's store (meshgrad \
             launch and torchrun set MASTER_ADDR and MASTER_PORT)",
            env.rank
        ),
        _ => {}
    }
    let _ = BACKEND.set(chosen);
    Ok(chosen)
}

/// The most ranks one process runs as threads (`--backend threads`).
pub const MAX_THREAD_RANKS: usize = 1024;

/// Fails at once when this process is one rank of a job of processes over NCCL or TCP but the
/// layout cannot use them (no `--layout`, or one of another number of ranks), or when a layout
/// run as threads has more than [`MAX_THREAD_RANKS`] ranks.
pub fn check_process_layout(
    backend: Backend,
    env: &RankEnv,
    layout: Option<&ParallelLayout>,
) -> Result<()> {
    if backend == Backend::Threads {
        if let Some(l) = layout.filter(|l| l.world_size() > MAX_THREAD_RANKS) {
            anyhow::bail!(
                "--layout {l} needs {} ranks, more than the {MAX_THREAD_RANKS} one process runs \
                 as threads; run them as processes (meshgrad launch, --backend tcp)",
                l.world_size()
            );
        }
    }
    if !matches!(backend, Backend::Nccl | Backend::Tcp) {
        return Ok(());
    }
    match layout {
        None => anyhow::bail!(
            "--backend {backend}: give a --layout of {} ranks (WORLD_SIZE)",
            env.world_size
        ),
        Some(l) if l.world_size() != env.world_size => anyhow::bail!(
            "--layout {l} needs {} ranks, but this is one of {} processes ({})",
            l.world_size(),
            env.world_size,
            env.source.describe()
        ),
        Some(_) => Ok(()),
    }
}

/// `on_ranks` under `meshgrad launch --backend nccl`: this process runs its single rank over
/// NCCL on `cuda:LOCAL_RANK` (the model computes on the CPU; the NCCL backend stages CPU
/// tensors through the GPU). The ranks rendezvous through rank 0's store. Rank 0 returns its
/// result; the other ranks exit once every rank has finished; an error on any rank is printed
/// with its rank and ends the process with status 1 (the launcher then stops the others).
#[cfg(feature = "nccl")]
fn on_nccl_rank<T: Send>(
    layout: &ParallelLayout,
    timeout: Duration,
    reference: bool,
    body: impl Fn(&RankCtx, &LayoutMesh) -> Result<Option<T>>,
) -> Result<T> {
    use meshgrad_parallel::comm::nccl::NcclCommunicator;
    use meshgrad_parallel::comm::store::TcpStore;
    let env = RankEnv::detect()?;
    check_process_layout(Backend::Nccl, &env, Some(layout))?;
    let store = Arc::new(TcpStore::from_env(&env, timeout)?);
    let world = flight::record(NcclCommunicator::world(&env, store.clone(), timeout)?);
    on_process_rank(world, layout, reference, body, move || {
        // Every rank leaves the store's barrier before rank 0 drops (and stops) it.
        store.barrier("nccl-done")?;
        drop(store);
        Ok(())
    })
}

/// `on_ranks` in a job of processes (NCCL's or TCP's): this process runs its single rank of
/// `world`. After the last barrier `done` runs on every rank. Rank 0 returns its result; the
/// other ranks exit once every rank has finished; an error on any rank is printed with its rank
/// and ends the process with status 1 (the launcher then stops the others).
fn on_process_rank<T: Send>(
    world: Arc<dyn Communicator>,
    layout: &ParallelLayout,
    reference: bool,
    body: impl Fn(&RankCtx, &LayoutMesh) -> Result<Option<T>>,
    done: impl FnOnce() -> Result<()>,
) -> Result<T> {
    use meshgrad_tensor::alloc::{with_tracker, MemoryTracker};
    let tracker = MemoryTracker::new();
    let ctx = RankCtx {
        rank: world.rank(),
        world_size: world.world_size(),
        comm: world,
        tracker: tracker.clone(),
    };
    let rank = ctx.rank;
    let r = with_tracker(tracker, || -> Result<Option<T>> {
        let mesh = layout.mesh(mesh_world(ctx.comm.clone(), reference))?;
        let r = body(&ctx, &mesh)?;
        ctx.comm.barrier()?.wait()?;
        Ok(r)
    });
    match r.and_then(|r| {
        drop(ctx);
        done()?;
        Ok(r)
    }) {
        Ok(r) => {
            if rank != 0 {
                std::process::exit(0);
            }
            r.ok_or_else(|| anyhow::anyhow!("rank 0 returned no result"))
        }
        Err(e) => {
            eprintln!("{}", rank_error_line(rank, &e));
            crate::flight::dump_on_error(&e);
            std::process::exit(1)
        }
    }
}

/// This process's rank of the TCP job that `meshgrad launch` or torchrun started (connected on
/// the first call, within `timeout`, which is also its watchdog's; later calls return the same
/// world). The layout must have as many ranks as the job.
fn tcp_world(layout: &ParallelLayout, timeout: Duration) -> Result<Arc<dyn Communicator>> {
    use meshgrad_parallel::comm::store::TcpStore;
    use meshgrad_parallel::comm::tcp::TcpCommunicator;
    static WORLD: std::sync::OnceLock<Arc<dyn Communicator>> = std::sync::OnceLock::new();
    let env = RankEnv::detect()?;
    check_process_layout(Backend::Tcp, &env, Some(layout))?;
    if let Some(w) = WORLD.get() {
        return Ok(w.clone());
    }
    let store = Arc::new(TcpStore::from_env(&env, timeout)?);
    let world = TcpCommunicator::world(&env, store, timeout)?;
    Ok(WORLD.get_or_init(|| flight::record(world)).clone())
}

#[cfg(not(feature = "nccl"))]
fn on_nccl_rank<T: Send>(
    _layout: &ParallelLayout,
    _timeout: Duration,
    _reference: bool,
    _body: impl Fn(&RankCtx, &LayoutMesh) -> Result<Option<T>>,
) -> Result<T> {
    anyhow::bail!(
        "{}",
        meshgrad_parallel::comm::backend::nccl_unavailable(1)
            .unwrap_or_else(|| "--backend nccl: not built in".into())
    )
}

/// The number of MPI ranks when this process is one of several started by an MPI launcher, from
/// its environment (MPI itself is not initialised here): `mpirun -np N` (Open MPI's
/// `OMPI_COMM_WORLD_SIZE`, or `PMI_SIZE`), or `srun -n N --mpi=pmix` (Slurm's task count, when
/// Slurm started the task with PMIx, which sets `PMIX_RANK`: `MPI_Init` then forms the world).
pub(crate) fn mpi_world_size() -> Option<usize> {
    mpi_world_size_from(&|v| std::env::var(v).ok())
}

fn mpi_world_size_from(var: &dyn Fn(&str) -> Option<String>) -> Option<usize> {
    let num = |v: &str| var(v)?.trim().parse::<usize>().ok();
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| num(v))
        .or_else(|| {
            var("PMIX_RANK")?;
            num("SLURM_STEP_NUM_TASKS").or_else(|| num("SLURM_NTASKS"))
        })
        .filter(|&n| n > 1)
}

/// In a job of processes, this process's world (the same world [`on_ranks`] then runs on), for
/// what the ranks must agree on before they start, e.g. the pipeline's partition: MPI's under an
/// MPI launcher (initialising MPI on the first call), TCP's under `meshgrad launch` or torchrun
/// (connecting within `timeout`). `None` when this process is the only one.
pub(crate) fn process_world(
    layout: &ParallelLayout,
    timeout: Duration,
) -> Result<Option<Arc<dyn Communicator>>> {
    if selected_backend() == Backend::Tcp {
        return tcp_world(layout, timeout).map(Some);
    }
    let Some(n) = mpi_world_size() else {
        return Ok(None);
    };
    check_mpi_world(Some(layout))?;
    #[cfg(feature = "mpi")]
    {
        let world = meshgrad_parallel::comm::mpi::MpiCommunicator::world()?;
        if world.world_size() != n {
            anyhow::bail!(
                "the environment says {n} MPI ranks, but MPI's world has {}",
                world.world_size()
            );
        }
        Ok(Some(recorded_mpi_world(world)))
    }
    #[cfg(not(feature = "mpi"))]
    unreachable!("check_mpi_world fails without the mpi feature ({n} ranks)")
}

/// The line a rank of a job of processes prints before it ends on `e`: `error: rank R: ...`,
/// without repeating the rank when the error already starts with it (a communication error).
fn rank_error_line(rank: usize, e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    if text.starts_with(&format!("rank {rank}:")) {
        format!("error: {text}")
    } else {
        format!("error: rank {rank}: {text}")
    }
}

/// In a job of processes, the value of `r`, or, on an error this rank's peers cannot know
/// about, the error printed with the rank and this process ended instead of leaving the peers
/// waiting: under MPI the whole job (`MPI_Abort`); otherwise with status 1, and the launcher
/// stops the others.
pub(crate) fn or_abort_job<T>(rank: usize, r: Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{}", rank_error_line(rank, &e));
            crate::flight::dump_on_error(&e);
            #[cfg(feature = "mpi")]
            if mpi_world_size().is_some() {
                meshgrad_parallel::comm::mpi::abort(1);
            }
            std::process::exit(1)
        }
    }
}

/// Fails at once when this process is one of several MPI ranks but the layout cannot use them:
/// no `--layout`, or (without the `mpi` feature) no MPI support at all.
pub fn check_mpi_world(layout: Option<&ParallelLayout>) -> Result<()> {
    let Some(n) = mpi_world_size() else {
        return Ok(());
    };
    if !cfg!(feature = "mpi") {
        anyhow::bail!(
            "this process is one of {n} MPI ranks, but meshgrad was built without MPI support: \
             rebuild with `cargo build --release --features mpi`"
        );
    }
    match layout {
        None => anyhow::bail!("this process is one of {n} MPI ranks: give a --layout of {n} ranks"),
        Some(l) if l.world_size() != n => anyhow::bail!(
            "--layout {l} needs {} ranks, but this is one of {n} MPI ranks",
            l.world_size()
        ),
        Some(_) => Ok(()),
    }
}

/// `on_ranks` under `mpirun`: this process runs its single rank over the MPI world. Rank 0
/// returns its result; the other ranks exit quietly once every rank has finished; an error on
/// any rank is printed with its rank and aborts the whole job. `timeout` is the MPI backend's
/// watchdog (`--collective-timeout`).
#[cfg(feature = "mpi")]
fn on_mpi_rank<T: Send>(
    layout: &ParallelLayout,
    n: usize,
    timeout: Duration,
    reference: bool,
    body: impl Fn(&RankCtx, &LayoutMesh) -> Result<Option<T>>,
) -> Result<T> {
    use meshgrad_parallel::comm::mpi::{abort, finalize, MpiCommunicator};
    use meshgrad_tensor::alloc::{with_tracker, MemoryTracker};
    check_mpi_world(Some(layout))?;
    let world = MpiCommunicator::world()?;
    world.set_timeout(timeout);
    if world.world_size() != n {
        anyhow::bail!(
            "the environment says {n} MPI ranks, but MPI's world has {}",
            world.world_size()
        );
    }
    let tracker = MemoryTracker::new();
    let ctx = RankCtx {
        rank: world.rank(),
        world_size: n,
        comm: recorded_mpi_world(world),
        tracker: tracker.clone(),
    };
    let rank = ctx.rank;
    let r = with_tracker(tracker, || -> Result<Option<T>> {
        let mesh = layout.mesh(mesh_world(ctx.comm.clone(), reference))?;
        let r = body(&ctx, &mesh)?;
        ctx.comm.barrier()?.wait()?;
        Ok(r)
    });
    match r {
        Ok(r) => {
            drop(ctx);
            finalize();
            if rank != 0 {
                std::process::exit(0);
            }
            r.ok_or_else(|| anyhow::anyhow!("rank 0 returned no result"))
        }
        Err(e) => {
            eprintln!("{}", rank_error_line(rank, &e));
            crate::flight::dump_on_error(&e);
            abort(1)
        }
    }
}

/// The MPI world wrapped in this process's flight recorder, the same on every call (so the
/// calls made before the run, e.g. to agree on a pipeline's partition, are numbered with the
/// run's).
#[cfg(feature = "mpi")]
fn recorded_mpi_world(
    world: Arc<meshgrad_parallel::comm::mpi::MpiCommunicator>,
) -> Arc<dyn Communicator> {
    static WORLD: std::sync::OnceLock<Arc<dyn Communicator>> = std::sync::OnceLock::new();
    WORLD.get_or_init(|| flight::record(world)).clone()
}

#[cfg(not(feature = "mpi"))]
fn on_mpi_rank<T: Send>(
    layout: &ParallelLayout,
    _n: usize,
    _timeout: Duration,
    _reference: bool,
    _body: impl Fn(&RankCtx, &LayoutMesh) -> Result<Option<T>>,
) -> Result<T> {
    check_mpi_world(Some(layout))?;
    unreachable!("check_mpi_world fails without the mpi feature")
}

/// A one-line reason `layout` cannot run (yet) or does not fit the run, before any work.
pub fn check_layout(cfg: &TrainConfig, layout: &ParallelLayout, opts: &TrainOptions) -> Result<()> {
    check_sequence_parallel(opts, layout.tp())?;
    crate::run_setup::check_cp_mode(opts, layout.cp())?;
    crate::run_setup::check_pipeline_flags(opts, layout.pp())?;
    opts.activation_checkpointing.check(layout.pp())?;
    crate::run_setup::check_run_options(cfg, opts)?;
    layout.check(cfg.train.batch_size, opts.microbatches, None)?;
    check_microbatches(cfg, layout.data_parallel_degree(), opts.microbatches)?;
    Ok(())
}

/// What the header says about the layout: `, layout dp=2 (2 ranks x 4 rows)`; when tensor or
/// pipeline ranks share rows, how many of the ranks are data parallel.
pub(crate) fn layout_desc(layout: &ParallelLayout, rows: usize, microbatches: usize) -> String {
    let micro = if microbatches > 1 {
        format!(" x {microbatches} micro-batches")
    } else {
        String::new()
    };
    let (world, dp) = (layout.world_size(), layout.data_parallel_degree());
    if world == dp {
        format!(", layout {layout} ({world} ranks x {rows} rows{micro})")
    } else {
        format!(", layout {layout} ({world} ranks; {dp} data-parallel x {rows} rows{micro})")
    }
}

/// A one-line error when the model's vocabulary of `vocab` ids (after padding) does not split
/// over the tensor-parallel degree of `layout`, naming the `model.vocab_multiple` that pads it.
pub(crate) fn check_vocab_splits(
    cfg: &TrainConfig,
    vocab: usize,
    layout: &ParallelLayout,
) -> Result<()> {
    let tp = layout.tp();
    if tp > 1 && !vocab.is_multiple_of(tp) {
        anyhow::bail!(
            "layout {layout}: the model's vocabulary of {vocab} ids (model.vocab_size {}{}, \
             model.vocab_multiple {}) does not split over tp={tp}; pad it with --set \
             model.vocab_multiple={tp}",
            cfg.model.vocab_size,
            if cfg.model.kind == crate::config::ModelKind::Bert {
                " and 5 special tokens"
            } else {
                ""
            },
            cfg.model.vocab_multiple,
        );
    }
    Ok(())
}

/// The one-line refusal of context parallelism (`cp` above 1 in `layout`) for a sequence
/// (`model.block_size`) that does not split into `2 cp` equal chunks. Reference mode's
/// conditions are [`crate::reference::check_reference`]'s.
pub(crate) fn check_context_parallel(cfg: &TrainConfig, layout: &ParallelLayout) -> Result<()> {
    let cp = layout.cp();
    if cp <= 1 {
        return Ok(());
    }
    meshgrad_autograd::distributed::ChunkOrder::new(0, cp)
        .chunk_len(cfg.model.block_size)
        .map_err(|e| anyhow::anyhow!("layout {layout}: {e} (model.block_size)"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mpi_world_size_from;

    fn vars<'a>(v: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            v.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, x)| x.to_string())
        }
    }

    #[test]
    fn mpi_worlds_from_mpirun_and_from_srun_with_pmix() {
        assert_eq!(mpi_world_size_from(&vars(&[])), None);
        let mpirun = [("OMPI_COMM_WORLD_SIZE", "4"), ("PMIX_RANK", "1")];
        assert_eq!(mpi_world_size_from(&vars(&mpirun)), Some(4));
        // One rank is no world of several.
        assert_eq!(
            mpi_world_size_from(&vars(&[("OMPI_COMM_WORLD_SIZE", "1")])),
            None
        );
        // srun --mpi=pmix: Slurm's task count (the step's first).
        let srun = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("PMIX_RANK", "2"),
        ];
        assert_eq!(mpi_world_size_from(&vars(&srun)), Some(4));
        // srun without PMIx: MPI_Init would give each task a world of its own.
        assert_eq!(mpi_world_size_from(&vars(&srun[..3])), None);
    }
}
