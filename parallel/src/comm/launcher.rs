//! Running a closure on N ranks, each a thread with its own in-process communicator and memory
//! tracker.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use meshgrad_tensor::alloc::{with_tracker, MemoryTracker};
use meshgrad_tensor::{Device, Error, Result};

use super::in_process::{InProcessComm, World};
use super::Communicator;

/// Options of [`run_ranks`].
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// How long any communication operation waits for its peers before failing (default 60 s).
    pub timeout: Duration,
    /// Stack size of each rank thread in bytes (default 16 MiB).
    pub stack_size: usize,
    /// Rendezvous sends (default off: buffered). A send's [`crate::Work`] then completes only
    /// when the receiver has taken the message, as a large send does on NCCL or MPI, so a
    /// pipeline schedule that would deadlock on a real backend times out here, naming the ranks
    /// and the calls, instead of passing in tests.
    pub rendezvous_sends: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            timeout: Duration::from_secs(60),
            stack_size: 16 << 20,
            rendezvous_sends: false,
        }
    }
}

impl RunOptions {
    /// Default options with the given timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        RunOptions {
            timeout,
            ..Default::default()
        }
    }

    /// The same options with rendezvous sends (see [`RunOptions::rendezvous_sends`]).
    pub fn rendezvous(mut self) -> Self {
        self.rendezvous_sends = true;
        self
    }
}

/// What each rank's closure gets: its rank, the world communicator and its memory tracker.
#[derive(Clone)]
pub struct RankCtx {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The world communicator (this rank's handle).
    pub comm: Arc<dyn Communicator>,
    /// The tracker every allocation of this rank's thread is charged to.
    pub tracker: Arc<MemoryTracker>,
}

impl RankCtx {
    /// The device of this rank (each in-process rank computes on the CPU).
    pub fn device(&self) -> Device {
        Device::Cpu
    }
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// Runs `f` on `world` ranks, each in its own thread with its own [`RankCtx`], joins them all and
/// returns every rank's own result, in rank order.
///
/// Each rank thread installs a fresh [`MemoryTracker`] (see
/// [`meshgrad_tensor::alloc::with_tracker`]), so per-rank memory is accounted separately. A rank
/// whose closure returns an error or panics (the panic is caught and becomes an error) marks the
/// world failed: peers blocked in, or later entering, a communication operation fail at once with
/// an error naming the failed rank. A rank that returns normally is marked exited, so operations
/// still waiting for it fail at once too. Anything else a peer waits for fails after
/// `opts.timeout`. So this call always returns.
///
/// The outer error is only for invalid arguments (a world of 0 ranks, a thread that could not be
/// started).
pub fn run_ranks_each<T, F>(world: usize, opts: &RunOptions, f: F) -> Result<Vec<Result<T>>>
where
    T: Send,
    F: Fn(RankCtx) -> Result<T> + Send + Sync,
{
    Ok(run_inner(world, opts, f)?.0)
}

/// Runs the ranks; also returns the rank that failed first, if any.
fn run_inner<T, F>(world: usize, opts: &RunOptions, f: F) -> Result<(Vec<Result<T>>, Option<usize>)>
where
    T: Send,
    F: Fn(RankCtx) -> Result<T> + Send + Sync,
{
    if world == 0 {
        meshgrad_tensor::bail!("run_ranks: the world size must be at least 1");
    }
    let shared = World::new(world, opts.timeout);
    shared.set_rendezvous(opts.rendezvous_sends);
    let handles: Vec<Arc<dyn Communicator>> = InProcessComm::world_handles(&shared)
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();
    // Every rank's calls go through the flight recorder (unless it is off).
    let handles = super::flight::record_job(handles);
    let f = &f;
    let shared = &shared;
    std::thread::scope(|scope| {
        let mut threads = Vec::with_capacity(world);
        for (rank, comm) in handles.into_iter().enumerate() {
            let tracker = MemoryTracker::new();
            let ctx = RankCtx {
                rank,
                world_size: world,
                comm,
                tracker: tracker.clone(),
            };
            let t = std::thread::Builder::new()
                .name(format!("meshgrad-rank-{rank}"))
                .stack_size(opts.stack_size)
                .spawn_scoped(scope, move || {
                    let r = with_tracker(tracker, || catch_unwind(AssertUnwindSafe(|| f(ctx))));
                    let r = match r {
                        Ok(r) => r,
                        Err(p) => Err(Error::msg(format!(
                            "rank {rank} panicked: {}",
                            panic_message(p.as_ref())
                        ))),
                    };
                    match &r {
                        Ok(_) => shared.exit(rank),
                        Err(e) => {
                            shared.fail(rank, &e.to_string());
                            // A failing rank dumps the job's flight recorders (when a folder
                            // is set: see `flight::set_dump_dir`).
                            super::flight::dump_on(&format!("rank {rank} failed: {e}"), false);
                        }
                    }
                    r
                });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // Release the ranks already started, then report.
                    shared.fail(rank, &format!("could not start its thread: {e}"));
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(Error::msg(format!(
                        "run_ranks: could not start the thread of rank {rank}: {e}"
                    )));
                }
            }
        }
        let results = threads
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                t.join().unwrap_or_else(|p| {
                    Err(Error::msg(format!(
                        "rank {rank} panicked: {}",
                        panic_message(p.as_ref())
                    )))
                })
            })
            .collect();
        Ok((results, shared.first_failed_rank()))
    })
}

/// Runs `f` on `world` ranks like [`run_ranks_each`] and returns the results in rank order, or,
/// if any rank failed, the error of the rank that failed first (the root cause; the failures of
/// its peers are consequences), prefixed with its rank.
pub fn run_ranks<T, F>(world: usize, opts: &RunOptions, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(RankCtx) -> Result<T> + Send + Sync,
{
    let (results, first) = run_inner(world, opts, f)?;
    if let Some(rank) = first {
        if let Some(Err(e)) = results.get(rank) {
            let msg = e.to_string();
            return Err(if msg.starts_with(&format!("rank {rank}")) {
                Error::msg(msg)
            } else {
                Error::msg(format!("rank {rank}: {msg}"))
            });
        }
    }
    results.into_iter().collect()
}
