//! Do several runs train alike? The lockstep check behind `meshgrad compare`: each run's
//! losses, validation losses and gradient norms (read from its [metrics file](crate::metrics))
//! against a reference run's, step by step ([`diff_series`], [`RunComparison`]), and a model's
//! final weights against the reference model's, tensor by tensor ([`read_weights`],
//! [`diff_weights`]). Every layout of a run (data, sharded, tensor and pipeline parallel) should
//! train as one device does, and reference mode bit for bit: this is how that is checked.
//!
//! Values are compared as the f64 the metrics file holds. The file writes each float in its
//! shortest round-trip form, so two values are equal exactly when their strings in the files
//! are equal: "identical" below means bit for bit.
//!
//! ```
//! use meshgrad_parallel::compare::RunComparison;
//! use meshgrad_parallel::metrics::{RunMetrics, StepMetrics};
//!
//! let run = |name: &str, losses: &[f64]| RunMetrics {
//!     name: name.into(),
//!     steps: losses
//!         .iter()
//!         .enumerate()
//!         .map(|(i, &loss)| (i + 1, StepMetrics { loss, val_loss: None, grad_norm: None }))
//!         .collect(),
//! };
//! let reference = run("one device", &[5.5, 5.0, 4.0]);
//! let c = RunComparison::new(&reference, &run("dp=2", &[5.5, 5.0, 4.1]));
//! assert_eq!(c.loss.first_difference, Some((3, 4.0, 4.1)));
//! assert_eq!(
//!     c.loss.describe("loss"),
//!     "loss: first differs at step 3 (4 vs 4.1), largest relative difference 2.500e-2 at \
//!      step 3, over 3 common steps"
//! );
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use meshgrad_tensor::{Error, Result};

use crate::metrics::{RunMetrics, StepMetrics};

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

    /// The report line of the series called `what`: `<what>: identical at all N common steps`,
    /// `<what>: first differs at step S (a vs b), largest relative difference X at step T, over N
    /// common steps`, or `<what>: none`, with the count of steps in only one of the runs.
    pub fn describe(&self, what: &str) -> String {
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
    pub fn loss_gap(&self) -> (f64, bool) {
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
        .collect::<Result<_>>()
        .map_err(|e| Error::Msg(format!("reading weights {}: {e}", file.display())))
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
        return Err(Error::Msg(format!(
            "{} and {} hold different tensors (e.g. {only:?}): not the same model",
            names.0, names.1
        )));
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
            return Err(Error::Msg(format!(
                "{name} has {} elements in {} but {} in {}",
                a.len(),
                names.0,
                b.len(),
                names.1
            )));
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
    /// The report line: `weights: identical (N tensors)`, or how many tensors differ, the
    /// relative L2 difference over all weights and the largest one's.
    pub fn describe(&self) -> String {
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
}
