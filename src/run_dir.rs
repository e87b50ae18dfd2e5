//! A run's output folder (`--out`): one run at a time in it (its lock), whether it already holds
//! a run, and where the run's checkpoints live inside it (`OUT/checkpoints/step-NNNNNN`, with
//! `OUT/checkpoints/latest` naming the newest complete one).
//!
//! The order a run follows: [`lock_out_dir`] (before anything is read from or written to the
//! folder), [`check_out_dir`] (refuses a folder that holds a run, unless resumed or
//! overwritten; removes nothing), every other check and the run's set-up, and only then, once
//! the new run is ready to write, [`clear_old_run`] for `--overwrite`.

use std::collections::HashMap;
use std::fs::{File, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};

/// The lock file a run (or an export) holds in its folder for its whole life.
pub const LOCK_FILE: &str = ".meshgrad.lock";

/// The folder of a run's periodic checkpoints.
pub fn checkpoints_dir(out: &Path) -> PathBuf {
    out.join("checkpoints")
}

/// What in `out` shows that it holds a run (a final model, a saved config or checkpoints), if
/// anything.
pub fn run_marker(out: &Path) -> Option<PathBuf> {
    [
        "config.json",
        "model.safetensors",
        "meshgrad.toml",
        "checkpoints",
    ]
    .iter()
    .map(|f| out.join(f))
    .find(|p| p.exists())
}

/// A held lock: the open lock file (its `flock` is the lock; the kernel drops it when the
/// process ends, however it ends).
struct HeldLock {
    path: PathBuf,
    file: File,
}

/// The folders this process holds the lock of, by canonical path.
static HELD: Mutex<Option<HashMap<PathBuf, HeldLock>>> = Mutex::new(None);

/// Takes the exclusive lock of `out` (`OUT/.meshgrad.lock`, creating the folder; `flag` names
/// the setting that gave it, in errors) for the rest of this process's work in it, or fails in
/// one line naming the process that holds it (pid and host, as its lock file records them). A lock file left by a process that is gone (killed,
/// even by SIGKILL) is not held, and is taken over. Taking a lock this process already holds
/// succeeds. Of a job of several processes, only rank 0 (`RANK`, `OMPI_COMM_WORLD_RANK`, ...)
/// takes it: the others write into the folder as rank 0 directs. The lock is released by
/// [`release_locks`] (the command line calls it before it exits).
///
/// Under the lock, the temporary files (`.NAME.tmp-PID-N`) that a save killed half-way left in
/// `out` are removed: no other process can be writing them.
pub fn lock_out_dir(out: &Path, flag: &str) -> Result<()> {
    let env = meshgrad_parallel::comm::RankEnv::detect()?;
    if env.rank != 0 {
        return Ok(());
    }
    if out.exists() && !out.is_dir() {
        anyhow::bail!(
            "the output directory {} ({flag}) is not a directory",
            out.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| {
        format!(
            "cannot create the output directory {} ({flag})",
            out.display()
        )
    })?;
    let key = out
        .canonicalize()
        .with_context(|| format!("resolving {}", out.display()))?;
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let held = held.get_or_insert_with(HashMap::new);
    if held.contains_key(&key) {
        return Ok(());
    }
    let path = out.join(LOCK_FILE);
    let file = loop {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening the lock file {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                // The holder writes its name just after it takes the lock: give it a moment.
                let mut holder = String::new();
                for _ in 0..50 {
                    holder = std::fs::read_to_string(&path).unwrap_or_default();
                    if !holder.trim().is_empty() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let holder = holder.trim();
                anyhow::bail!(
                    "{} is in use by another run or export ({}; {}): wait for it to finish, or \
                     choose another folder",
                    out.display(),
                    if holder.is_empty() {
                        "a process that has not written its name yet"
                    } else {
                        holder
                    },
                    path.display()
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()));
            }
        }
        // The holder before us may have removed the file between our open and our lock: then
        // we hold a lock on a file no one else sees; open the path again.
        if same_file(&file, &path) {
            break file;
        }
    };
    let mut f = &file;
    f.set_len(0)
        .and_then(|_| writeln!(f, "pid {} on host {}", std::process::id(), host_name()))
        .with_context(|| format!("writing the lock file {}", path.display()))?;
    held.insert(key, HeldLock { path, file });
    remove_stale_temp_files(out)
}

/// Releases every lock this process holds ([`lock_out_dir`]), removing its lock files.
pub fn release_locks() {
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    for (_, lock) in held.take().unwrap_or_default() {
        // Remove while still holding the lock, so no one takes a file that is going away.
        let _ = std::fs::remove_file(&lock.path);
        drop(lock.file);
    }
}

/// Whether the open `file` is the file at `path` (same device and inode).
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// This machine's name (`/proc/sys/kernel/hostname`, else `HOSTNAME`, else `unknown`).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Refuses to train into a folder that already holds a run, unless the run continues it
/// (`resume`) or starts over (`overwrite`). One line, naming the folder and what is in it.
/// Removes nothing: with `overwrite`, the old run goes only once the new one is ready to write
/// ([`clear_old_run`]), so a run refused by a later check leaves it as it was.
pub fn check_out_dir(out: &Path, resume: bool, overwrite: bool) -> Result<()> {
    let Some(marker) = run_marker(out) else {
        return Ok(());
    };
    if resume || overwrite {
        return Ok(());
    }
    anyhow::bail!(
        "{} already holds a run ({} exists); continue it with --resume {}, or pass \
         --overwrite to start over",
        out.display(),
        marker.display(),
        out.display()
    );
}

/// Removes the run in `out` that `--overwrite` replaces: its final model (config first, so a
/// folder left half removed does not load), config, tokenizer and checkpoints. Called by the
/// new run's first rank once every check has passed and the run is set up, just before it
/// writes anything.
pub fn clear_old_run(out: &Path) -> Result<()> {
    for f in [
        "config.json",
        "model.safetensors",
        "meshgrad.toml",
        "tokenizer.json",
    ] {
        let p = out.join(f);
        if p.exists() {
            gone_ok(std::fs::remove_file(&p))
                .with_context(|| format!("--overwrite: removing {}", p.display()))?;
        }
    }
    let ckpts = checkpoints_dir(out);
    if ckpts.exists() {
        gone_ok(std::fs::remove_dir_all(&ckpts))
            .with_context(|| format!("--overwrite: removing {}", ckpts.display()))?;
    }
    Ok(())
}

/// A removal that found nothing to remove (another process of the run got there first) counts
/// as done.
fn gone_ok(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Removes the temporary files (`.NAME.tmp-PID-N`) that a save killed half-way left in `out`
/// (called under the folder's lock, so none of them is being written).
fn remove_stale_temp_files(out: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp-") && e.path().is_file() {
            gone_ok(std::fs::remove_file(e.path()))
                .with_context(|| format!("removing the leftover {}", e.path().display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("meshgrad-run-dir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_folder_with_a_run_is_refused_unless_resumed_or_overwritten_and_nothing_is_removed() {
        let dir = fresh("refuse");
        std::fs::create_dir_all(checkpoints_dir(&dir).join("step-000001")).unwrap();
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        let e = check_out_dir(&dir, false, false).unwrap_err().to_string();
        assert!(
            e.contains("already holds a run") && e.contains("--resume"),
            "{e}"
        );
        check_out_dir(&dir, true, false).unwrap();
        check_out_dir(&dir, false, true).unwrap();
        // Checking removes nothing, even with --overwrite.
        assert!(checkpoints_dir(&dir).exists() && dir.join("config.json").exists());
        clear_old_run(&dir).unwrap();
        assert!(!checkpoints_dir(&dir).exists() && !dir.join("config.json").exists());
        check_out_dir(&dir, false, false).unwrap();
        check_out_dir(&dir.join("absent"), false, false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_lock_removes_a_killed_save_s_temp_files_and_is_released_with_its_file() {
        let dir = fresh("lock");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(".model.safetensors.tmp-123-0"), b"x").unwrap();
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        lock_out_dir(&dir, "--out").unwrap();
        // Taken again by the same process: fine.
        lock_out_dir(&dir, "--out").unwrap();
        assert!(!dir.join(".model.safetensors.tmp-123-0").exists());
        assert!(dir.join("notes.txt").exists());
        let text = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert!(
            text.starts_with(&format!("pid {} on host ", std::process::id())),
            "{text}"
        );
        // Another open file description cannot take it while this process holds it.
        let other = File::open(dir.join(LOCK_FILE)).unwrap();
        assert!(matches!(other.try_lock(), Err(TryLockError::WouldBlock)));
        drop(other);
        release_locks();
        assert!(!dir.join(LOCK_FILE).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
