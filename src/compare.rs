//! `meshgrad compare`: do several runs train alike? Reads the metrics files (`--metrics`, one JSON
//! line per step) of several runs, compares each run's losses, validation losses and gradient
//! norms with the first run's, step by step (and, with `--weights`, their final weights), prints
//! the report and optionally draws the loss curves into a PNG. The comparisons themselves are
//! [`meshgrad_parallel::compare`]'s.

use std::path::PathBuf;

use anyhow::{bail, Result};
use meshgrad_parallel::compare::{diff_weights, read_weights, RunComparison};
use meshgrad_parallel::metrics::read_metrics;

/// What `meshgrad compare` does: options from the command line.
#[derive(Clone, Debug)]
pub struct CompareOptions {
    /// Metrics files; the first is the reference.
    pub files: Vec<PathBuf>,
    /// Where to draw the loss curves (PNG).
    pub plot: Option<PathBuf>,
    /// The runs' final weights (`--out` folders or safetensors files), one per metrics file in
    /// the same order, or none.
    pub weights: Vec<PathBuf>,
    /// Fail when a run's losses or weights differ from the reference's by more than this
    /// relative amount (0: demand identical losses), or when the runs have different steps.
    /// (Weights that are NaN or infinite where the reference's are not always fail.)
    pub max_relative_difference: Option<f64>,
}

/// Runs `meshgrad compare`: prints one line per run against the first, then a summary line
/// `compare: runs=N identical=K largest_relative_loss_difference=X`.
pub fn run(opts: &CompareOptions) -> Result<()> {
    if opts.files.len() < 2 {
        bail!(
            "compare needs at least two metrics files (got {}): the first is the reference",
            opts.files.len()
        );
    }
    if let Some(t) = opts.max_relative_difference {
        if !(t >= 0.0 && t.is_finite()) {
            bail!("--max-relative-difference must be a finite number >= 0, got {t}");
        }
    }
    if !opts.weights.is_empty() && opts.weights.len() != opts.files.len() {
        bail!(
            "--weights names {} models for {} metrics files: give one per run, in the same order",
            opts.weights.len(),
            opts.files.len()
        );
    }
    let weights = opts
        .weights
        .iter()
        .map(|p| read_weights(p))
        .collect::<meshgrad_tensor::Result<Vec<_>>>()?;
    let runs = opts
        .files
        .iter()
        .map(|p| read_metrics(p))
        .collect::<meshgrad_tensor::Result<Vec<_>>>()?;
    let reference = &runs[0];
    let first = reference.steps.keys().next().copied().unwrap_or(0);
    let last = reference.steps.keys().next_back().copied().unwrap_or(0);
    println!(
        "reference: {} ({} steps, {first}..{last})",
        reference.name,
        reference.steps.len()
    );
    let mut identical = 0;
    let mut largest: f64 = 0.0;
    let mut failures = Vec::new();
    let mut largest_weights: Option<f64> = None;
    for (i, run) in runs.iter().enumerate().skip(1) {
        let c = RunComparison::new(reference, run);
        println!("{}:", c.name);
        println!("  {}", c.loss.describe("loss"));
        println!("  {}", c.val_loss.describe("val_loss"));
        println!("  {}", c.grad_norm.describe("grad_norm"));
        if let Some(w0) = weights.first() {
            let names = (
                opts.weights[0].display().to_string(),
                opts.weights[i].display().to_string(),
            );
            let d = diff_weights(w0, &weights[i], (&names.0, &names.1))?;
            println!("  {}", d.describe());
            let worst = d.worst.as_ref().map_or(0.0, |w| w.1);
            largest_weights = Some(largest_weights.unwrap_or(0.0).max(worst));
            let over = opts.max_relative_difference.is_some_and(|t| worst > t);
            if worst.is_infinite() || over {
                failures.push(format!(
                    "{}: weights differ by {worst:.3e} (relative L2{})",
                    names.1,
                    if worst.is_infinite() {
                        ", NaN or infinite where the reference is not"
                    } else {
                        ""
                    }
                ));
            }
        }
        let (gap, unmatched) = c.loss_gap();
        if c.loss.identical() && c.val_loss.identical() {
            identical += 1;
        }
        largest = largest.max(gap);
        if let Some(t) = opts.max_relative_difference {
            if gap > t || unmatched {
                failures.push(format!(
                    "{}: largest relative loss difference {gap:.3e}{}",
                    c.name,
                    if unmatched {
                        " and steps missing from one of the runs"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    if let Some(path) = &opts.plot {
        crate::compare_plot::draw(&runs, path)?;
        println!("plot: {}", path.display());
    }
    let weights_field = largest_weights
        .map(|w| format!(" largest_relative_weight_difference={w:.3e}"))
        .unwrap_or_default();
    println!(
        "compare: runs={} identical={identical} largest_relative_loss_difference={largest:.3e}{weights_field}",
        runs.len()
    );
    if !failures.is_empty() {
        bail!(
            "{} difference(s) from {} beyond {}: {}",
            failures.len(),
            reference.name,
            match opts.max_relative_difference {
                Some(t) => format!("{t:e}"),
                None => "what can be compared".to_string(),
            },
            failures.join("; ")
        );
    }
    Ok(())
}
