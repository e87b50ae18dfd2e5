//! The metrics file of a training run (`meshgrad train --metrics FILE`): one JSON object per line
//! and step, written by the trainer ([`metrics_line`], [`with_loss_scale`]) and read back by
//! `meshgrad compare` ([`read_metrics`]) to check that runs under different layouts train
//! alike (see [`compare`](crate::compare)).
//!
//! A line holds `step` (counted from 1), `loss` (the step's mean training loss), `lr`,
//! `tokens_per_s` and `grad_norm` (before clipping), `val_loss` on the steps that validated, an
//! f16 run's `loss_scale` and `skipped`, and a mixture of experts' `aux_loss`,
//! `expert_tokens_max`, `expert_tokens_mean` and `expert_tokens_dropped` (see
//! [`with_expert_load`]; its `loss` is the training objective, cross-entropy plus the
//! coefficient times `aux_loss`). Floats are written in their shortest round-trip form
//! (NaN and the infinities as `null`), so two values are equal exactly when their strings are.
//!
//! ```
//! use meshgrad_parallel::metrics::{metrics_line, read_metrics};
//!
//! let dir = std::env::temp_dir().join(format!("metrics-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("metrics.jsonl");
//! let lines = [
//!     metrics_line(1, 5.5, 1e-3, 1000.0, 2.0, None),
//!     metrics_line(2, 5.0, 1e-3, 1000.0, 1.5, Some(5.25)),
//! ];
//! std::fs::write(&path, lines.join("\n") + "\n").unwrap();
//! let run = read_metrics(&path)?;
//! assert_eq!(run.steps[&2].loss, 5.0);
//! assert_eq!(run.steps[&2].val_loss, Some(5.25));
//! assert_eq!(run.steps[&1].grad_norm, Some(2.0));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use meshgrad_tensor::{Error, Result};

/// One step's metrics line: `step`, `loss`, `lr`, `tokens_per_s`, `grad_norm`, and `val_loss`
/// when the step validated.
pub fn metrics_line(
    step: usize,
    loss: f64,
    lr: f64,
    tokens_per_s: f64,
    grad_norm: f64,
    val: Option<f64>,
) -> String {
    let mut m = serde_json::json!({
        "step": step,
        "loss": loss,
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        "grad_norm": grad_norm,
    });
    if let Some(v) = val {
        m["val_loss"] = serde_json::json!(v);
    }
    m.to_string()
}

/// A metrics line with an f16 run's `"loss_scale"` and `"skipped"` (whether the step was skipped
/// for non-finite gradients) added; a line that is not JSON is returned unchanged.
pub fn with_loss_scale(line: &str, scale: f64, skipped: bool) -> String {
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(mut m) => {
            m["loss_scale"] = serde_json::json!(scale);
            m["skipped"] = serde_json::json!(skipped);
            m.to_string()
        }
        Err(_) => line.to_string(),
    }
}

/// A mixture-of-experts step's figures in its metrics line ([`with_expert_load`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertMetrics {
    /// The load-balancing loss, averaged over the step's sequences and the layers (without its
    /// coefficient; `loss` includes `coefficient * aux_loss`).
    pub aux_loss: f64,
    /// Token copies routed to the busiest expert of any layer over the step.
    pub tokens_max: f64,
    /// Token copies per expert over the step, averaged over the experts and the layers.
    pub tokens_mean: f64,
    /// Token copies dropped for capacity over the step (0 when dropless).
    pub dropped: f64,
}

/// A metrics line with a mixture-of-experts step's `"aux_loss"`, `"expert_tokens_max"`,
/// `"expert_tokens_mean"` and `"expert_tokens_dropped"` added; a line that is not JSON is
/// returned unchanged.
pub fn with_expert_load(line: &str, m: &ExpertMetrics) -> String {
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(mut v) => {
            v["aux_loss"] = serde_json::json!(m.aux_loss);
            v["expert_tokens_max"] = serde_json::json!(m.tokens_max);
            v["expert_tokens_mean"] = serde_json::json!(m.tokens_mean);
            v["expert_tokens_dropped"] = serde_json::json!(m.dropped);
            v.to_string()
        }
        Err(_) => line.to_string(),
    }
}

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
    /// How the run is named in reports (the file's path as given).
    pub name: String,
    /// Every step's figures, in step order.
    pub steps: BTreeMap<usize, StepMetrics>,
}

/// Reads a metrics file written by `meshgrad train --metrics`. Lines of a later step replace
/// earlier lines of the same step. Fails, naming the file and line, on a line that is not a
/// JSON object with a `step` and a `loss`, and on a file without steps.
pub fn read_metrics(path: &Path) -> Result<RunMetrics> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Msg(format!("reading metrics file {}: {e}", path.display())))?;
    let mut steps = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Error::Msg(format!("{}: not JSON: {e}", at())))?;
        let step = v
            .get("step")
            .and_then(|s| s.as_u64())
            .ok_or_else(|| Error::Msg(format!("{}: no integer \"step\"", at())))?;
        let number = |key: &str| -> Result<Option<f64>> {
            match v.get(key) {
                None => Ok(None),
                // serde_json writes NaN and infinities as null.
                Some(serde_json::Value::Null) => Ok(Some(f64::NAN)),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| Error::Msg(format!("{}: \"{key}\" is not a number", at()))),
            }
        };
        let loss = number("loss")?.ok_or_else(|| Error::Msg(format!("{}: no \"loss\"", at())))?;
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
        return Err(Error::Msg(format!(
            "metrics file {} has no steps",
            path.display()
        )));
    }
    Ok(RunMetrics {
        name: path.display().to_string(),
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_metrics_lines_and_reports_bad_ones() {
        let dir = std::env::temp_dir().join(format!("meshgrad-metrics-{}", std::process::id()));
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
        let e = read_metrics(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.jsonl line 2") && e.contains("step"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn lines_hold_the_written_values_and_the_loss_scale() {
        let line = metrics_line(3, 4.25, 1e-3, 1234.5, f64::NAN, Some(4.5));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["step"], 3);
        assert_eq!(v["loss"], 4.25);
        assert!(v["grad_norm"].is_null(), "{line}");
        assert_eq!(v["val_loss"], 4.5);
        let scaled = with_loss_scale(&line, 65536.0, true);
        let v: serde_json::Value = serde_json::from_str(&scaled).unwrap();
        assert_eq!(
            (v["loss_scale"].as_f64(), v["skipped"].as_bool()),
            (Some(65536.0), Some(true))
        );
        assert_eq!(with_loss_scale("not json", 1.0, false), "not json");
    }
}
