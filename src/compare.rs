//! `meshgrad compare`: do several runs train alike? Reads the metrics files (`--metrics`, one JSON
//! line per step) of several runs, compares each run's losses, validation losses and gradient
//! norms with the first run's, step by step, and optionally draws the loss curves into a PNG.
//!
//! Values are compared as the f64 the metrics file holds. The file writes each float in its
//! shortest round-trip form, so two values are equal exactly when their strings in the files
//! are equal: "identical" below means bit for bit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// One step's figures from a metrics file.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepMetrics {
    /// Mean training loss of the step (NaN when the file holds `null`, as it does for NaN).
    pub loss: f64,
    /// Validation loss, on the steps that validated.
    pub val_loss: Option<f64>,
    /// Gradient norm before clipping, when the file has one.
    pub grad_norm: Option<f64>,
}

/// The metrics of one run, by step.
#[derive(Clone, Debug)]
pub struct RunMetrics {
    /// How the run is named in the output (the file's path as given).
    pub name: String,
    /// Every step's figures, in step order.
    pub steps: BTreeMap<usize, StepMetrics>,
}

/// Reads a metrics file written by `meshgrad train --metrics`. Lines of a later step replace
/// earlier lines of the same step. Fails, naming the file and line, on a line that is not a
/// JSON object with a `step` and a `loss`.
pub fn read_metrics(path: &Path) -> Result<RunMetrics> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading metrics file {}", path.display()))?;
    let mut steps = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let step = v
            .get("step")
            .and_then(|s| s.as_u64())
            .with_context(|| format!("{}: no integer \"step\"", at()))?;
        let number = |key: &str| -> Result<Option<f64>> {
            match v.get(key) {
                None => Ok(None),
                // serde_json writes NaN and infinities as null.
                Some(serde_json::Value::Null) => Ok(Some(f64::NAN)),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .with_context(|| format!("{}: \"{key}\" is not a number", at())),
            }
        };
        let loss = number("loss")?.with_context(|| format!("{}: no \"loss\"", at()))?;
        steps.insert(
            step as usize,
            StepMetrics {
                loss,
                val_loss: number("val_loss")?,
                grad_norm: number("grad_norm")?,
            },
        );
    }
    if steps.is_empty() {
        bail!("metrics file {} has no steps", path.display());
    }
    Ok(RunMetrics {
        name: path.display().to_string(),
        steps,
    })
}

/// How one series (losses, validation losses or gradient norms) of a run differs from the
/// reference run's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeriesDiff {
    /// Steps where both runs have a value.
    pub common: usize,
    /// Steps where only one of the two runs has a value.
    pub unmatched: usize,
    /// The first common step whose values differ: (step, reference value, this run's value).
    pub first_difference: Option<(usize, f64, f64)>,
    /// The largest relative difference over the common steps and its step.
    pub largest: Option<(usize, f64)>,
}

impl SeriesDiff {
    /// Whether every common value is identical and no step is unmatched.
    pub fn identical(&self) -> bool {
        self.first_difference.is_none() && self.unmatched == 0
    }

    /// The largest relative difference (0 when there is none).
    pub fn largest_relative(&self) -> f64 {
        self.largest.map_or(0.0, |(_, d)| d)
    }

    fn describe(&self, what: &str) -> String {
        if self.common == 0 && self.unmatched == 0 {
            return format!("{what}: none");
        }
        let mut s = match self.first_difference {
            None => format!(
                "{what}: identical at all {} common step{}",
                self.common,
                plural(self.common)
            ),
            Some((step, a, b)) => {
                let (ls, l) = self.largest.unwrap_or((step, f64::INFINITY));
                format!(
                    "{what}: first differs at step {step} ({a} vs {b}), largest relative \
                     difference {l:.3e} at step {ls}, over {} common step{}",
                    self.common,
                    plural(self.common)
                )
            }
        };
        if self.unmatched > 0 {
            s.push_str(&format!(
                " ({} step{} in only one of the runs)",
                self.unmatched,
                plural(self.unmatched)
            ));
        }
        s
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `|a - b| / |a|` (`|a - b| / max(|a|, |b|)` when `a` is 0); 0 for identical values, infinite
/// when exactly one of them is NaN.
pub fn relative_difference(a: f64, b: f64) -> f64 {
    if a == b || (a.is_nan() && b.is_nan()) {
        return 0.0;
    }
    if a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite() {
        return f64::INFINITY;
    }
    let scale = if a != 0.0 { a.abs() } else { b.abs() };
    (a - b).abs() / scale
}

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Compares one series of `run` with the reference's; `get` picks the series.
pub fn diff_series(
    reference: &RunMetrics,
    run: &RunMetrics,
    get: impl Fn(&StepMetrics) -> Option<f64>,
) -> SeriesDiff {
    let mut d = SeriesDiff::default();
    let steps: std::collections::BTreeSet<usize> = reference
        .steps
        .keys()
        .chain(run.steps.keys())
        .copied()
        .collect();
    for step in steps {
        let a = reference.steps.get(&step).and_then(&get);
        let b = run.steps.get(&step).and_then(&get);
        match (a, b) {
            (Some(a), Some(b)) => {
                d.common += 1;
                if !same(a, b) && d.first_difference.is_none() {
                    d.first_difference = Some((step, a, b));
                }
                let r = relative_difference(a, b);
                if d.largest.is_none_or(|(_, l)| r > l) {
                    d.largest = Some((step, r));
                }
            }
            (None, None) => {}
            _ => d.unmatched += 1,
        }
    }
    d
}

/// How a run compares with the reference run.
#[derive(Clone, Debug)]
pub struct RunComparison {
    /// The run's name.
    pub name: String,
    /// Training losses.
    pub loss: SeriesDiff,
    /// Validation losses.
    pub val_loss: SeriesDiff,
    /// Gradient norms.
    pub grad_norm: SeriesDiff,
}

impl RunComparison {
    /// Compares `run` with `reference`.
    pub fn new(reference: &RunMetrics, run: &RunMetrics) -> RunComparison {
        RunComparison {
            name: run.name.clone(),
            loss: diff_series(reference, run, |m| Some(m.loss)),
            val_loss: diff_series(reference, run, |m| m.val_loss),
            grad_norm: diff_series(reference, run, |m| m.grad_norm),
        }
    }

    /// The largest relative difference of the losses (training and validation) and whether any
    /// step is in only one of the runs.
    fn loss_gap(&self) -> (f64, bool) {
        (
            self.loss
                .largest_relative()
                .max(self.val_loss.largest_relative()),
            self.loss.unmatched + self.val_loss.unmatched > 0,
        )
    }
}

/// How a model's weights differ from the reference model's.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightsDiff {
    /// Tensors compared.
    pub tensors: usize,
    /// Tensors that are not bit for bit equal.
    pub differing: usize,
    /// The tensor with the largest relative L2 difference `|a - b| / |a|`, and that difference.
    pub worst: Option<(String, f64)>,
    /// The relative L2 difference over all weights together.
    pub whole: f64,
}

/// The weights file of a run: `path` itself when it is a file, else `path/model.safetensors`
/// (a run's `--out` folder).
fn weights_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("model.safetensors")
    } else {
        path.to_path_buf()
    }
}

/// Reads a model's weights (a safetensors file or a run's `--out` folder) as f64, by name.
pub fn read_weights(path: &Path) -> Result<BTreeMap<String, Vec<f64>>> {
    let file = weights_file(path);
    meshgrad_nn::state::load_safetensors(&file)?
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_vec_f64()?)))
        .collect::<meshgrad_tensor::Result<_>>()
        .with_context(|| format!("reading weights {}", file.display()))
}

/// Compares two models' weights tensor by tensor; fails, naming both files, when their tensor
/// names or shapes differ.
pub fn diff_weights(
    reference: &BTreeMap<String, Vec<f64>>,
    other: &BTreeMap<String, Vec<f64>>,
    names: (&str, &str),
) -> Result<WeightsDiff> {
    if reference.len() != other.len() || reference.keys().ne(other.keys()) {
        let only: Vec<&String> = reference
            .keys()
            .filter(|k| !other.contains_key(*k))
            .chain(other.keys().filter(|k| !reference.contains_key(*k)))
            .take(5)
            .collect();
        bail!(
            "{} and {} hold different tensors (e.g. {only:?}): not the same model",
            names.0,
            names.1
        );
    }
    let mut d = WeightsDiff {
        tensors: reference.len(),
        differing: 0,
        worst: None,
        whole: 0.0,
    };
    let (mut num_all, mut den_all) = (0.0f64, 0.0f64);
    for (name, a) in reference {
        let b = &other[name];
        if a.len() != b.len() {
            bail!(
                "{name} has {} elements in {} but {} in {}",
                a.len(),
                names.0,
                b.len(),
                names.1
            );
        }
        let (mut num, mut den) = (0.0f64, 0.0f64);
        let mut equal = true;
        // A NaN or an infinity on one side that the other does not have at the same place is
        // an infinite difference (NaN would compare as no difference at all).
        let mut unbounded = false;
        for (x, y) in a.iter().zip(b) {
            let same = x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
            equal &= same;
            if same {
                den += if x.is_finite() { x * x } else { 0.0 };
                continue;
            }
            if !(x.is_finite() && y.is_finite()) {
                unbounded = true;
                continue;
            }
            num += (x - y) * (x - y);
            den += x * x;
        }
        if !equal {
            d.differing += 1;
        }
        let rel = if unbounded {
            f64::INFINITY
        } else if num == 0.0 {
            0.0
        } else {
            (num / den.max(f64::MIN_POSITIVE)).sqrt()
        };
        num_all = if unbounded {
            f64::INFINITY
        } else {
            num_all + num
        };
        den_all += den;
        if d.worst.as_ref().is_none_or(|(_, w)| rel > *w) {
            d.worst = Some((name.clone(), rel));
        }
    }
    d.whole = if num_all == 0.0 {
        0.0
    } else {
        (num_all / den_all.max(f64::MIN_POSITIVE)).sqrt()
    };
    Ok(d)
}

impl WeightsDiff {
    fn describe(&self) -> String {
        match (&self.worst, self.differing) {
            (_, 0) => format!("weights: identical ({} tensors)", self.tensors),
            (Some((name, w)), n) => format!(
                "weights: {n} of {} tensors differ, relative L2 difference {:.3e} over all, \
                 largest {w:.3e} ({name})",
                self.tensors, self.whole
            ),
            (None, _) => "weights: none".into(),
        }
    }
}

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
        .collect::<Result<Vec<_>>>()?;
    let runs = opts
        .files
        .iter()
        .map(|p| read_metrics(p))
        .collect::<Result<Vec<_>>>()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn run_of(name: &str, losses: &[(usize, f64)]) -> RunMetrics {
        RunMetrics {
            name: name.into(),
            steps: losses
                .iter()
                .map(|&(s, l)| {
                    (
                        s,
                        StepMetrics {
                            loss: l,
                            val_loss: None,
                            grad_norm: None,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn first_difference_and_largest_relative() {
        let a = run_of("a", &[(1, 4.0), (2, 3.0), (3, 2.0)]);
        let b = run_of("b", &[(1, 4.0), (2, 3.0000003), (3, 2.2)]);
        let d = diff_series(&a, &b, |m| Some(m.loss));
        assert_eq!(d.common, 3);
        assert_eq!(d.first_difference, Some((2, 3.0, 3.0000003)));
        let (step, rel) = d.largest.unwrap();
        assert_eq!(step, 3);
        assert!((rel - 0.1).abs() < 1e-12, "{rel}");
        assert!(!d.identical());
    }

    #[test]
    fn identical_runs_and_unmatched_steps() {
        let a = run_of("a", &[(1, 4.0), (2, 3.0)]);
        let d = diff_series(&a, &a.clone(), |m| Some(m.loss));
        assert!(d.identical());
        assert_eq!(d.largest_relative(), 0.0);
        let short = run_of("c", &[(1, 4.0)]);
        let d = diff_series(&a, &short, |m| Some(m.loss));
        assert_eq!((d.common, d.unmatched), (1, 1));
        assert!(!d.identical());
    }

    #[test]
    fn weights_relative_l2_per_tensor_and_overall() {
        let w = |v: &[(&str, &[f64])]| -> BTreeMap<String, Vec<f64>> {
            v.iter().map(|(n, x)| (n.to_string(), x.to_vec())).collect()
        };
        let a = w(&[("x", &[3.0, 4.0]), ("y", &[0.0, 0.0, 12.0])]);
        // x: |(0, 0.5)| / |(3, 4)| = 0.1; overall 0.5 / 13.
        let b = w(&[("x", &[3.0, 4.5]), ("y", &[0.0, 0.0, 12.0])]);
        let d = diff_weights(&a, &b, ("a", "b")).unwrap();
        assert_eq!((d.tensors, d.differing), (2, 1));
        let (name, worst) = d.worst.clone().unwrap();
        assert_eq!(name, "x");
        assert!((worst - 0.1).abs() < 1e-15, "{worst}");
        assert!((d.whole - 0.5 / 13.0).abs() < 1e-15, "{}", d.whole);
        let same = diff_weights(&a, &a, ("a", "a")).unwrap();
        assert_eq!((same.differing, same.whole), (0, 0.0));
        let other = w(&[("x", &[3.0, 4.0]), ("z", &[0.0, 0.0, 12.0])]);
        let e = diff_weights(&a, &other, ("a", "c"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a and c hold different tensors"), "{e}");
        let short = w(&[("x", &[3.0]), ("y", &[0.0, 0.0, 12.0])]);
        let e = diff_weights(&a, &short, ("a", "s"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("x has 2 elements in a but 1 in s"), "{e}");
    }

    #[test]
    fn nan_and_zero_handling() {
        assert_eq!(relative_difference(f64::NAN, f64::NAN), 0.0);
        assert_eq!(relative_difference(1.0, f64::NAN), f64::INFINITY);
        assert_eq!(relative_difference(0.0, 2.0), 1.0);
        assert_eq!(relative_difference(-0.0, 0.0), 0.0);
    }

    #[test]
    fn reads_metrics_lines_and_reports_bad_ones() {
        let dir = std::env::temp_dir().join(format!("meshgrad-compare-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jsonl");
        std::fs::write(
            &good,
            "{\"step\":1,\"loss\":5.5,\"grad_norm\":1.25}\n\
             {\"step\":2,\"loss\":null,\"val_loss\":4.5}\n",
        )
        .unwrap();
        let m = read_metrics(&good).unwrap();
        assert_eq!(m.steps[&1].grad_norm, Some(1.25));
        assert!(m.steps[&2].loss.is_nan());
        assert_eq!(m.steps[&2].val_loss, Some(4.5));
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, "{\"step\":1,\"loss\":5.5}\n{\"loss\":1}\n").unwrap();
        let e = format!("{:#}", read_metrics(&bad).unwrap_err());
        assert!(e.contains("bad.jsonl line 2") && e.contains("step"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
