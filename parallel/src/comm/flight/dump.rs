//! The flight recorder's dump, `rank-R.json`: its JSON form, written atomically, and read back.

use std::path::{Path, PathBuf};

use meshgrad_tensor::{Error, Result};
use serde::{Deserialize, Serialize};

/// Where a recorded call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryState {
    /// Launched; its handle has not been waited for yet (or the wait is still blocked).
    Launched,
    /// Its wait returned the result.
    Completed,
    /// Its launch or wait returned an error (see [`Entry::error`], [`Entry::waiting_for`]).
    Failed,
    /// Its handle was dropped before it was known to be complete.
    Abandoned,
}

impl EntryState {
    /// Whether the call had not finished when the dump was written.
    pub fn is_open(self) -> bool {
        matches!(self, EntryState::Launched | EntryState::Failed)
    }
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The rank's own count of recorded calls (0 for its first), across all groups.
    #[serde(default)]
    pub id: u64,
    /// The group's key: `world`, or `PARENT/TAG[members]#N` for sub-groups (the same on every
    /// member).
    pub group: String,
    /// The group's members (global ranks, in group order).
    pub ranks: Vec<usize>,
    /// The sequence number errors quote: the n-th collective on the group (from 0), or for
    /// `send` / `recv` the n-th message to / from `peer` on the group.
    pub seq: u64,
    /// `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `all_to_all`, `barrier`,
    /// `send` or `recv`.
    pub kind: String,
    /// The whole call as errors show it, e.g. `all_reduce(sum, f32 [4])` (an all-to-all's
    /// shows its splits: `all_to_all(send [1, 2], recv [2, 0], f32 [3, 4])`).
    #[serde(default)]
    pub call: String,
    /// The tensor's dtype (none for barriers and receives).
    #[serde(default)]
    pub dtype: Option<String>,
    /// The tensor's shape (none for barriers and receives).
    #[serde(default)]
    pub shape: Option<Vec<usize>>,
    /// The reduce op of an all-reduce or reduce-scatter.
    #[serde(default)]
    pub op: Option<String>,
    /// A broadcast's root (global rank).
    #[serde(default)]
    pub root: Option<usize>,
    /// The other side of a send or receive (global rank).
    #[serde(default)]
    pub peer: Option<usize>,
    /// Where it stands.
    pub state: EntryState,
    /// The error it failed with.
    #[serde(default)]
    pub error: Option<String>,
    /// For a call the watchdog timed out: the ranks that did not join (global ranks).
    #[serde(default)]
    pub waiting_for: Vec<usize>,
    /// When it was launched (Unix milliseconds).
    #[serde(default)]
    pub launched_ms: u64,
    /// When its wait returned or it was abandoned (Unix milliseconds).
    #[serde(default)]
    pub ended_ms: Option<u64>,
}

impl Entry {
    /// `all_reduce#17`: the call's kind and sequence number.
    pub fn label(&self) -> String {
        format!("{}#{}", self.kind, self.seq)
    }
}

/// One rank's dump: who wrote it, when and why, and its recorder's entries, oldest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    /// The format's version ([`Dump::VERSION`]).
    pub version: u32,
    /// The global rank that wrote it.
    pub rank: usize,
    /// The job's number of ranks.
    pub world_size: usize,
    /// The writing process.
    #[serde(default)]
    pub pid: u32,
    /// The recorder's capacity (entries kept).
    #[serde(default)]
    pub capacity: usize,
    /// Calls recorded since the start (more than `entries` once the ring wrapped).
    #[serde(default)]
    pub recorded: u64,
    /// When the recorder started (Unix milliseconds).
    #[serde(default)]
    pub started_ms: u64,
    /// When the dump was written (Unix milliseconds).
    #[serde(default)]
    pub dumped_ms: u64,
    /// Why it was dumped (the watchdog's error, `SIGUSR1`, the rank's error), oldest first.
    #[serde(default)]
    pub reasons: Vec<String>,
    /// The recorded calls, oldest first.
    pub entries: Vec<Entry>,
}

impl Dump {
    /// The format version this build writes.
    pub const VERSION: u32 = 1;

    /// Whether older entries were dropped from the ring (so an absent entry proves nothing).
    pub fn wrapped(&self) -> bool {
        self.recorded > self.entries.len() as u64
    }
}

/// The file name of rank `rank`'s dump.
pub fn file_name(rank: usize) -> String {
    format!("rank-{rank}.json")
}

/// Writes `dump` to `dir/rank-R.json` atomically (a temporary file in `dir`, then a rename), so a
/// reader never sees half a dump; creates `dir` when needed. Returns the path.
pub fn write(dir: &Path, dump: &Dump) -> Result<PathBuf> {
    let fail = |what: &str, p: &Path, e: &dyn std::fmt::Display| {
        Error::msg(format!(
            "rank {}: flight recorder: cannot {what} {}: {e}",
            dump.rank,
            p.display()
        ))
    };
    std::fs::create_dir_all(dir).map_err(|e| fail("create", dir, &e))?;
    let path = dir.join(file_name(dump.rank));
    let text = serde_json::to_vec_pretty(dump).map_err(|e| fail("encode", &path, &e))?;
    // A fresh temporary name per write (threads of a process may dump one rank at once).
    meshgrad_nn::state::write_bytes_atomic(&path, &text)
        .map_err(|e| Error::msg(format!("rank {}: flight recorder: {e}", dump.rank)))?;
    Ok(path)
}

/// The folder holding the dumps: `dir/flight` when `dir` is a run's output folder that has one,
/// else `dir` itself.
pub fn dump_folder(dir: &Path) -> PathBuf {
    let sub = dir.join("flight");
    if sub.is_dir() {
        sub
    } else {
        dir.to_path_buf()
    }
}

/// Reads every `rank-R.json` of `dir` (a run's output folder or its `flight/` folder), in rank
/// order. One-line errors name the folder or the file: a missing folder, no dumps, a file that
/// is not a dump (malformed JSON), two dumps of one rank.
pub fn read_all(dir: &Path) -> Result<Vec<(PathBuf, Dump)>> {
    if !dir.is_dir() {
        return Err(Error::msg(format!(
            "flight: {} is not a folder (give a run's --out folder or its flight/ folder)",
            dir.display()
        )));
    }
    let folder = dump_folder(dir);
    let list = std::fs::read_dir(&folder)
        .map_err(|e| Error::msg(format!("flight: cannot read {}: {e}", folder.display())))?;
    let mut dumps: Vec<(PathBuf, Dump)> = Vec::new();
    for item in list {
        let item =
            item.map_err(|e| Error::msg(format!("flight: cannot read {}: {e}", folder.display())))?;
        let name = item.file_name().to_string_lossy().into_owned();
        let is_dump = name
            .strip_prefix("rank-")
            .and_then(|r| r.strip_suffix(".json"))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
        if !is_dump {
            continue;
        }
        let path = item.path();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::msg(format!("flight: cannot read {}: {e}", path.display())))?;
        let dump: Dump = serde_json::from_str(&text).map_err(|e| {
            Error::msg(format!(
                "flight: {}: not a flight-recorder dump (malformed JSON: {e})",
                path.display()
            ))
        })?;
        if dump.world_size == 0 || dump.rank >= dump.world_size {
            return Err(Error::msg(format!(
                "flight: {}: rank {} is not below its world size {}",
                path.display(),
                dump.rank,
                dump.world_size
            )));
        }
        dumps.push((path, dump));
    }
    if dumps.is_empty() {
        return Err(Error::msg(format!(
            "flight: no rank-R.json dumps in {} (a run writes them to OUT/flight/ on a watchdog \
             timeout, on SIGUSR1 or when a rank fails)",
            folder.display()
        )));
    }
    dumps.sort_by_key(|(_, d)| d.rank);
    for w in dumps.windows(2) {
        if w[0].1.rank == w[1].1.rank {
            return Err(Error::msg(format!(
                "flight: {} and {} are both dumps of rank {}",
                w[0].0.display(),
                w[1].0.display(),
                w[0].1.rank
            )));
        }
    }
    Ok(dumps)
}
