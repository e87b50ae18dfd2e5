//! A run's output folder (`--out`): whether it already holds a run, and where the run's
//! checkpoints live inside it (`OUT/checkpoints/step-NNNNNN`, with `OUT/checkpoints/latest`
//! naming the newest complete one).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

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

/// Refuses to train into a folder that already holds a run, unless the run continues it
/// (`resume`) or starts over (`overwrite`, which removes the old run's final model, config,
/// tokenizer and checkpoints first). One line, naming the folder and what is in it.
pub fn prepare_out_dir(out: &Path, resume: bool, overwrite: bool) -> Result<()> {
    remove_stale_temp_files(out)?;
    let Some(marker) = run_marker(out) else {
        return Ok(());
    };
    if resume {
        return Ok(());
    }
    if !overwrite {
        anyhow::bail!(
            "{} already holds a run ({} exists); continue it with --resume {}, or pass \
             --overwrite to start over",
            out.display(),
            marker.display(),
            out.display()
        );
    }
    // The old run goes before any work: its final model (config first, so a folder left half
    // removed does not load) and its checkpoints.
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
        // Under mpirun every rank prepares the same folder at once: another may remove the
        // same entries first.
        let mut r = gone_ok(std::fs::remove_dir_all(&ckpts));
        if r.is_err() && ckpts.exists() {
            r = gone_ok(std::fs::remove_dir_all(&ckpts));
        }
        r.with_context(|| format!("--overwrite: removing {}", ckpts.display()))?;
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
/// (only one run trains into a folder at a time, so none of them is being written).
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

    #[test]
    fn a_folder_with_a_run_is_refused_unless_resumed_or_overwritten() {
        let dir = std::env::temp_dir().join(format!("meshgrad-run-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(checkpoints_dir(&dir).join("step-000001")).unwrap();
        let e = prepare_out_dir(&dir, false, false).unwrap_err().to_string();
        assert!(
            e.contains("already holds a run") && e.contains("--resume"),
            "{e}"
        );
        prepare_out_dir(&dir, true, false).unwrap();
        assert!(checkpoints_dir(&dir).exists());
        prepare_out_dir(&dir, false, true).unwrap();
        assert!(!checkpoints_dir(&dir).exists());
        prepare_out_dir(&dir, false, false).unwrap();
        prepare_out_dir(&dir.join("absent"), false, false).unwrap();
        // A killed save's temporary file goes; other files stay.
        std::fs::write(dir.join(".model.safetensors.tmp-123-0"), b"x").unwrap();
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        prepare_out_dir(&dir, false, false).unwrap();
        assert!(!dir.join(".model.safetensors.tmp-123-0").exists());
        assert!(dir.join("notes.txt").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
