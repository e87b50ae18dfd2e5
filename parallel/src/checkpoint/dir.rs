//! The run directory: complete checkpoints side by side, the `latest` pointer, temporary
//! directories of saves in progress, and the atomic steps between them.
//!
//! ```text
//! DIR/
//!   step-000120/          complete: index.json + rank files (+ extra files); never modified
//!   step-000140/
//!   latest                "step-000140\n", replaced atomically (temporary file + rename)
//!   .tmp-step-000160/     a save in progress, or the leftover of a killed one
//! ```

use std::cmp::Ordering;
use std::path::{Path, PathBuf};

use meshgrad_nn::state::write_bytes_atomic;
use meshgrad_tensor::{Error, Result};

use super::format::INDEX_FILE;

/// The pointer file naming the newest complete checkpoint.
pub const LATEST_FILE: &str = "latest";
/// The prefix of temporary directories (saves in progress, checkpoints being deleted).
pub const TMP_PREFIX: &str = ".tmp-";

/// The conventional name of the checkpoint after `step` optimizer steps: `step-000140`.
pub fn checkpoint_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Checks a checkpoint name: a plain directory name (no separators, not hidden).
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.starts_with('.')
        || name == LATEST_FILE
        || name.contains(['/', '\\', '\n', '\0'])
    {
        meshgrad_tensor::bail!(
            "checkpoint name {name:?} must be a plain directory name (not empty, not starting \
             with '.', no '/', not {LATEST_FILE:?})"
        );
    }
    Ok(())
}

/// The temporary directory a save of `name` writes into.
pub(crate) fn tmp_dir(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{TMP_PREFIX}{name}"))
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::msg(format!("{what} {}: {e}", path.display()))
}

/// Flushes a directory's entries (a rename into it, a new file) to disk. Best effort where a
/// directory cannot be opened.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let d = std::fs::File::open(dir).map_err(|e| io_err("cannot open directory", dir, e))?;
        d.sync_all()
            .map_err(|e| io_err("cannot flush directory", dir, e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Rank 0, before the ranks write: creates `dir` if needed, refuses a name that is already a
/// complete checkpoint (they are never modified) and gives the save a fresh temporary
/// directory (removing a killed save's leftover of the same name).
pub(crate) fn prepare(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| io_err("cannot create", dir, e))?;
    let final_dir = dir.join(name);
    if final_dir.exists() {
        meshgrad_tensor::bail!(
            "checkpoint {} already exists; a complete checkpoint is never modified (choose \
             another name or delete it)",
            final_dir.display()
        );
    }
    let tmp = tmp_dir(dir, name);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_err("cannot remove the leftover", &tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
    Ok(tmp)
}

/// Rank 0, once every rank's files are complete and fsynced and the index is written: renames
/// the temporary directory into place (the atomic publish), flushes `dir`, then points `latest`
/// at it (temporary file + fsync + rename).
pub(crate) fn publish(dir: &Path, name: &str) -> Result<PathBuf> {
    let tmp = tmp_dir(dir, name);
    let final_dir = dir.join(name);
    fsync_dir(&tmp)?;
    std::fs::rename(&tmp, &final_dir).map_err(|e| {
        Error::msg(format!(
            "cannot publish {} as {}: {e}",
            tmp.display(),
            final_dir.display()
        ))
    })?;
    fsync_dir(dir)?;
    write_bytes_atomic(dir.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
    Ok(final_dir)
}

/// Orders names by their trailing number (`step-9` before `step-10`), then by the name.
fn natural(a: &str, b: &str) -> Ordering {
    fn split(s: &str) -> (Option<u128>, &str) {
        let digits = s.len() - s.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        (s[s.len() - digits..].parse().ok(), s)
    }
    split(a).cmp(&split(b))
}

/// The complete checkpoints in `dir` (directories holding an `index.json`, temporary ones
/// excluded), oldest first: ordered by the number their names end with (`step-000140`), then
/// by name. A missing `dir` has none.
pub fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("cannot list", dir, e)),
    };
    let mut names = Vec::new();
    for e in entries {
        let e = e.map_err(|e| io_err("cannot list", dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !e.path().join(INDEX_FILE).is_file() {
            continue;
        }
        names.push(name);
    }
    names.sort_by(|a, b| natural(a, b));
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// The newest complete checkpoint in `dir`, or `None` when it has none (temporary directories
/// of killed saves are never returned). That is the one `latest` names, unless a complete
/// checkpoint sorts after it ([`list`]'s order): a save killed between publishing its directory
/// and switching the pointer leaves a complete, newer checkpoint, which is then the latest.
/// Without a (valid) pointer, the newest complete checkpoint.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
    let all = list(dir)?;
    let pointer = dir.join(LATEST_FILE);
    let named = match std::fs::read_to_string(&pointer) {
        Ok(s) => Some(s.trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_err("cannot read", &pointer, e)),
    };
    let newest = all.last().cloned();
    Ok(match named {
        Some(n) if all.iter().any(|p| p.file_name() == Some(n.as_ref())) => {
            let p = dir.join(&n);
            match &newest {
                Some(newer) if natural(&n, &file_name(newer)) == Ordering::Less => newest,
                _ => Some(p),
            }
        }
        _ => newest,
    })
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Removes what killed saves left in `dir`: temporary directories (`.tmp-*`, including
/// checkpoints [`keep`] was deleting) and temporary pointer files (`.latest.tmp-*`). Returns
/// the paths removed. Call it when no save is running (at the start of a run, on rank 0).
pub fn cleanup(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("cannot list", dir, e)),
    };
    let mut removed = Vec::new();
    for e in entries {
        let e = e.map_err(|e| io_err("cannot list", dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        if name.starts_with(TMP_PREFIX) && path.is_dir() {
            std::fs::remove_dir_all(&path).map_err(|e| io_err("cannot remove", &path, e))?;
        } else if name.starts_with(&format!(".{LATEST_FILE}.tmp-")) && path.is_file() {
            std::fs::remove_file(&path).map_err(|e| io_err("cannot remove", &path, e))?;
        } else {
            continue;
        }
        removed.push(path);
    }
    removed.sort();
    Ok(removed)
}

/// Deletes all but the newest `k` complete checkpoints of `dir` ([`list`]'s order), never the
/// one [`latest`] returns. Each is first renamed to a temporary name, so a kill mid-delete
/// leaves a `.tmp-*` directory ([`cleanup`] removes it) and never a half-deleted checkpoint
/// that looks complete. Returns the checkpoints deleted. Call it on one rank (rank 0) after a
/// save.
pub fn keep(dir: &Path, k: usize) -> Result<Vec<PathBuf>> {
    let all = list(dir)?;
    let protected = latest(dir)?;
    let n_old = all.len().saturating_sub(k);
    let mut removed = Vec::new();
    for p in &all[..n_old] {
        if Some(p) == protected.as_ref() {
            continue;
        }
        let doomed = dir.join(format!("{TMP_PREFIX}deleting-{}", file_name(p)));
        std::fs::rename(p, &doomed).map_err(|e| io_err("cannot delete", p, e))?;
        std::fs::remove_dir_all(&doomed).map_err(|e| io_err("cannot remove", &doomed, e))?;
        removed.push(p.clone());
    }
    if !removed.is_empty() {
        fsync_dir(dir)?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order() {
        let mut v = vec!["step-10", "step-9", "step-000100", "a", "step-011"];
        v.sort_by(|a, b| natural(a, b));
        assert_eq!(v, ["a", "step-9", "step-10", "step-011", "step-000100"]);
    }

    #[test]
    fn names() {
        assert_eq!(checkpoint_name(140), "step-000140");
        assert!(check_name("step-000140").is_ok());
        for bad in ["", ".tmp-x", "a/b", "latest"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
