//! The flight recorder: every rank keeps its last N collectives and point-to-point calls, and
//! dumps them when a job hangs or fails, so that `meshgrad flight` can name the rank that is
//! behind and the call the ranks disagree on (the debugging tool of PyTorch's NCCL flight
//! recorder and torchtitan).
//!
//! * **One mechanism for every backend.** [`record`] (one rank per process: TCP, MPI, NCCL) and
//!   [`record_job`] (ranks as threads: [`run_ranks`](crate::comm::run_ranks) uses it) wrap a
//!   world communicator in [`Recorded`], which records each call when it is launched and how it
//!   ended when its handle is waited for; sub-groups made from it are recorded too. Entries carry
//!   the rank's own call count, the group (its key, e.g. `world/dp[0,1,2,3]#0`, and members), the
//!   per-group sequence number that errors quote (`all_reduce #17`), the kind, dtype and shape,
//!   the reduce op, root or peer, the state (`launched`, `completed`, `failed` with the error and,
//!   for a watchdog timeout, the ranks it was `waiting_for`, or `abandoned` when the handle was
//!   dropped unfinished) and the launch and end times (Unix ms).
//! * **A fixed-capacity ring per rank**: [`capacity`] entries, 1024 by default, set with
//!   `MESHGRAD_FLIGHT_RECORDER_SIZE` (0 turns the recorder off; a value that is not a number is
//!   ignored). Recording takes a mutex for a few stores; the only allocation is the entry's shape.
//! * **Dumps** go to `DIR/rank-R.json` (JSON, written atomically), one per rank of the process,
//!   where `DIR` is set with [`set_dump_dir`] (`meshgrad train` sets `OUT/flight`); without it
//!   nothing is written. They are written when a wait fails on the watchdog's timeout (any
//!   backend whose timeout error reaches the caller: threads, TCP, MPI, NCCL), and by the caller
//!   through [`dump_all`]: `meshgrad train` does on SIGUSR1 and when a rank fails.
//! * **What `completed` means**: the caller's wait returned. On NCCL completion is
//!   stream-ordered (a wait returns once the GPU's later work is ordered after the collective),
//!   and its watchdog's error surfaces on a later call or wait and cannot name the missing ranks,
//!   so there the first open call may come after the one that hung; the threads, TCP and MPI
//!   backends' waits block until the result is there and their timeouts name the missing ranks.
//! * **Analysis**: [`analyse`] reads the dumps of every rank (a rank stopped or killed cannot
//!   write one; the watchdog's `waiting_for` names it) and finds the first call where the ranks
//!   disagree and the ranks behind; see [`Analysis`].

mod analysis;
mod dump;
mod recorded;
mod ring;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use meshgrad_tensor::Result;

pub use analysis::{analyse, Analysis, Disagreement};
pub use dump::{dump_folder, file_name, read_all, write, Dump, Entry, EntryState};
pub use recorded::Recorded;
pub use ring::Recorder;

use super::Communicator;

/// The environment variable that sets the recorder's capacity (0 turns it off).
pub const SIZE_VAR: &str = "MESHGRAD_FLIGHT_RECORDER_SIZE";

/// The default number of calls each rank keeps.
pub const DEFAULT_CAPACITY: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many calls each rank keeps: `MESHGRAD_FLIGHT_RECORDER_SIZE` when it is a number (read
/// once per process), else [`DEFAULT_CAPACITY`]; 0 means no recorder.
pub fn capacity() -> usize {
    static CAPACITY: OnceLock<usize> = OnceLock::new();
    *CAPACITY.get_or_init(|| {
        std::env::var(SIZE_VAR)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_CAPACITY)
    })
}

/// The recorders of this process's current job (one per rank it runs) and the dump folder.
struct State {
    recorders: Vec<Arc<Recorder>>,
    dir: Option<PathBuf>,
}

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(|| {
        Mutex::new(State {
            recorders: Vec::new(),
            dir: None,
        })
    })
}

/// Sets the folder dumps are written to (`None`: none are written). `meshgrad train` sets its
/// `OUT/flight` at start-up.
pub fn set_dump_dir(dir: Option<PathBuf>) {
    lock(state()).dir = dir;
}

/// The folder dumps are written to, if set.
pub fn dump_dir() -> Option<PathBuf> {
    lock(state()).dir.clone()
}

/// Wraps `world`, this process's only rank, in a recorder (and makes it the process's recorded
/// job). Returns `world` unchanged when the recorder is off ([`capacity`] 0).
pub fn record(world: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
    record_job(vec![world]).pop().expect("one communicator")
}

/// Wraps the world communicators of the ranks this process runs (threads of one job) in
/// recorders, which replace the process's previous job's in [`dump_all`]. Returns them unchanged
/// when the recorder is off ([`capacity`] 0).
pub fn record_job(worlds: Vec<Arc<dyn Communicator>>) -> Vec<Arc<dyn Communicator>> {
    let cap = capacity();
    if cap == 0 {
        return worlds;
    }
    let recorders: Vec<Arc<Recorder>> = worlds
        .iter()
        .map(|w| Arc::new(Recorder::new(w.global_rank(), w.world_size(), cap)))
        .collect();
    lock(state()).recorders = recorders.clone();
    worlds
        .into_iter()
        .zip(recorders)
        .map(|(w, r)| Recorded::wrap(w, r))
        .collect()
}

/// Writes every recorder of this process's job to the dump folder ([`set_dump_dir`]), noting
/// `reason` in each dump; returns the files written (none when no folder is set or the
/// recorder is off). An error names the rank and the file.
pub fn dump_all(reason: &str) -> Result<Vec<PathBuf>> {
    let (recorders, dir) = {
        let s = lock(state());
        (s.recorders.clone(), s.dir.clone())
    };
    let Some(dir) = dir else {
        return Ok(Vec::new());
    };
    recorders
        .iter()
        .map(|r| {
            r.add_reason(reason);
            write(&dir, &r.snapshot())
        })
        .collect()
}

/// [`dump_all`] for the library's own triggers: reports on stderr why it could not write, and
/// with `announce` (the watchdog) what it wrote, one line each. A failing rank's dump is quiet,
/// so that its error stays the one line it prints.
pub(crate) fn dump_on(reason: &str, announce: bool) {
    report(dump_all(reason), announce);
}

/// When `announce`, prints one stderr line per dump written (`flight recorder: wrote PATH`), or
/// the error. A quiet dump (a failing rank's, whose own error must stay the one line it prints)
/// prints nothing, not even its failure.
pub fn report(r: Result<Vec<PathBuf>>, announce: bool) {
    if !announce {
        return;
    }
    match r {
        Ok(paths) => {
            for p in paths {
                eprintln!("flight recorder: wrote {}", p.display());
            }
        }
        Err(e) => eprintln!("flight recorder: {e}"),
    }
}

/// Reads the dumps of `dir` (a run's output folder or its `flight/` folder) and analyses them.
pub fn analyse_dir(dir: &Path) -> Result<Analysis> {
    Ok(analyse(&read_all(dir)?))
}

#[cfg(test)]
mod tests;
