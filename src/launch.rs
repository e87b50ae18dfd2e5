//! `meshgrad launch`'s rank-side checks and `meshgrad launch-probe`; the launcher itself is
//! [`meshgrad_parallel::launch`].

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use meshgrad_parallel::comm::RankEnv;

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
