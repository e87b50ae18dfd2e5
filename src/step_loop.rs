//! The step loop every training run drives, whatever the model and the layout
//! ([`drive_loop`]): validation, the micro-steps, the rank's end of the step ([`GradSync`]),
//! clipping, the optimizer step (mixed precision and the f16 loss scale included), divergence
//! checks, metrics, progress, periodic checkpoints and stopping on a signal.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use crate::expert_load::PendingExperts;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use meshgrad_nn::optim::{AdamW, CosineSchedule, LossScaler};
use meshgrad_nn::Module;
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::metrics::{metrics_line, with_expert_load, with_loss_scale, ExpertMetrics};
use meshgrad_parallel::{Communicator, ReduceOp};
use meshgrad_tensor::DType;

use crate::config::TrainConfig;
use crate::run_setup::{precision_dtype, Verbosity};

/// A rank's end of a step, as [`drive_loop`] drives it: the trainer's
/// [`RankSync`](crate::rank_sync::RankSync) for every layout (one device included).
pub(crate) trait GradSync {
    /// Clears the gradients before a step's first backward.
    fn zero_grad(&self, opt: &AdamW);
    /// Completes gradient synchronisation after the final backward of a step.
    fn finish(&self) -> Result<()>;
    /// The mean of `local` over the data-parallel ranks (losses).
    fn mean(&self, local: f64) -> Result<f64>;
    /// Clips the global gradient norm to `max_norm` and returns the norm before clipping.
    fn clip(&self, max_norm: f64) -> Result<f64>;
    /// Reference mode's gradient norm: the square root of an order-free exact sum of squares,
    /// so no layout changes its bits.
    fn exact_norm(&self) -> Result<f64>;
    /// Scales the gradients as clipping to `max_norm` does when the global norm is `norm`.
    fn clip_with_norm(&self, max_norm: f64, norm: f64) -> Result<()>;
    /// The optimizer step with learning rate `lr`.
    fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()>;
    /// The optimizer step of a bf16 / f16 run whose loss was multiplied by `scale` (1 for
    /// bf16): the norm of the unscaled gradients and, unless it is NaN or infinite, the step
    /// with clipping to `max_norm` (0: none) and the unscaling applied in f32 on the master
    /// weights. Returns the norm, and whether the step was taken (false: nothing was changed).
    fn step_mixed(
        &self,
        opt: &mut AdamW,
        lr: f64,
        max_norm: f64,
        scale: f64,
    ) -> Result<(f64, bool)>;
}

/// The metrics file of a run resumed after `start_step` steps, open for appending: lines of
/// later steps (written by the run before it was stopped, after its checkpoint) are dropped,
/// through a temporary file renamed over the original.
fn reopen_metrics(path: &Path, start_step: usize) -> Result<std::fs::File> {
    let kept: String = match std::fs::read_to_string(path) {
        Ok(text) => text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s as usize <= start_step)
            })
            .map(|l| format!("{l}\n"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => {
            return Err(e).with_context(|| format!("reading metrics file {}", path.display()))
        }
    };
    meshgrad_nn::state::write_bytes_atomic(path, kept.as_bytes())
        .with_context(|| format!("rewriting metrics file {}", path.display()))?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .with_context(|| format!("opening metrics file {}", path.display()))
}

/// Progress output and the metrics file. Only the leader (rank 0) reports; the others get a
/// silent reporter.
pub(crate) struct Reporter {
    pub(crate) quiet: bool,
    pub(crate) pb: ProgressBar,
    metrics: Option<std::io::BufWriter<std::fs::File>>,
}

impl Reporter {
    /// The leader's reporter: a progress bar (unless quiet) and the metrics file, if configured.
    /// A run resumed after `start_step` steps keeps the metrics file's lines of those steps
    /// (dropping any later ones a killed run wrote) and appends; a new run starts the file.
    pub(crate) fn leader(
        cfg: &TrainConfig,
        verbosity: Verbosity,
        start_step: usize,
    ) -> Result<Reporter> {
        let metrics = match &cfg.metrics {
            None => None,
            Some(p) => {
                if let Some(dir) = Path::new(p).parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
                let file = if start_step == 0 {
                    std::fs::File::create(p)
                        .with_context(|| format!("creating metrics file {p}"))?
                } else {
                    reopen_metrics(Path::new(p), start_step)?
                };
                Some(std::io::BufWriter::new(file))
            }
        };
        let quiet = verbosity == Verbosity::Quiet;
        let pb = if quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::with_draw_target(
                Some(cfg.train.steps as u64),
                ProgressDrawTarget::stderr(),
            )
        };
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb.set_position(start_step as u64);
        Ok(Reporter { quiet, pb, metrics })
    }

    /// A reporter that reports nothing (ranks other than the leader).
    pub(crate) fn silent() -> Reporter {
        Reporter {
            quiet: true,
            pb: ProgressBar::hidden(),
            metrics: None,
        }
    }

    /// Prints a log line (above the progress bar when there is one).
    pub(crate) fn say(&self, s: String) {
        if self.quiet {
        } else if self.pb.is_hidden() {
            println!("{s}");
        } else {
            self.pb.println(s);
        }
    }

    /// Writes one metrics line and flushes it, so the file holds every finished step even if
    /// the run is killed.
    pub(crate) fn metrics(&mut self, line: String) -> Result<()> {
        if let Some(w) = self.metrics.as_mut() {
            writeln!(w, "{line}")
                .and_then(|()| w.flush())
                .context("writing metrics")?;
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<()> {
        self.pb.finish_and_clear();
        if let Some(mut w) = self.metrics {
            w.flush().context("writing metrics")?;
        }
        Ok(())
    }
}

/// A rank's share of a step, as its micro-step returns it: the loss (the global loss is
/// `sync.mean(loss) * loss_scale`) and, for a mixture of experts, the step's expert load on
/// this rank, reduced over the ranks after the gradient synchronisation.
pub(crate) struct StepShare {
    pub(crate) loss: f64,
    pub(crate) experts: Option<PendingExperts>,
}

/// The training objective's share added to the global cross-entropy: the coefficient times the
/// load-balancing loss (0 for a dense model).
fn aux_term(experts: &Option<(ExpertMetrics, f64)>) -> f64 {
    experts.as_ref().map_or(0.0, |(m, coef)| coef * m.aux_loss)
}

/// What the training loop reports back.
pub(crate) struct LoopResult {
    pub(crate) initial_val_loss: f64,
    pub(crate) final_val_loss: f64,
    pub(crate) final_train_loss: f64,
    pub(crate) tokens_per_s: f64,
    pub(crate) elapsed_s: f64,
}

/// What a training loop does besides training: where it starts (a resumed run starts after the
/// step its checkpoint was saved at), when it saves, and how the ranks agree to stop on a signal.
pub(crate) struct RunControl<'a> {
    /// The first step to run.
    pub(crate) start_step: usize,
    /// Every rank of the run, to agree on stopping (all ranks stop after the same step); `None`
    /// on one device.
    pub(crate) world: Option<&'a dyn Communicator>,
    /// Save a checkpoint after every this many steps.
    pub(crate) save_every: Option<usize>,
    /// Saves a checkpoint of the model (this rank's part), the optimizer and an f16 run's loss
    /// scaler after `steps` completed steps (every rank calls it); returns where.
    #[allow(clippy::type_complexity)]
    pub(crate) save:
        Option<&'a dyn Fn(usize, &dyn Module, &AdamW, Option<&LossScaler>) -> Result<String>>,
}

impl RunControl<'_> {
    /// Whether any rank was asked to stop (a collective over `world` when there is one).
    fn stop_requested(&self) -> Result<bool> {
        // No handler in this process (library use): nothing can ask, and every rank (a thread
        // of this process, or a process of the same binary) knows it without a collective.
        let Some(signal) = crate::stop::installed() else {
            return Ok(false);
        };
        let local = signal.requested();
        match self.world {
            None => Ok(local),
            Some(w) => Ok(all_reduce_scalar(w, f64::from(u8::from(local)), ReduceOp::Max)? > 0.0),
        }
    }
}

/// The part of the training loop that does not depend on the model (GPT or BERT): validation
/// before the first step; each step, `micro_step(step)` runs the forward and backward passes of
/// this rank's micro-batches and returns this rank's share of the step's loss (the global loss is
/// `sync.mean(share) * loss_scale`); then gradient synchronisation, clipping, the optimizer step,
/// the divergence checks (a non-finite gradient norm, when clipping computes one, stops before
/// the optimizer step; a non-finite loss or validation loss stops the run), validation with `val`
/// every `eval_interval` steps and at the end, the metrics line (flushed), the log line and the
/// progress bar.
///
/// A mixture of experts' step ([`StepShare::experts`]): the reported `loss` is the training
/// objective, the cross-entropy plus the coefficient times the load-balancing loss, and the
/// metrics line carries `aux_loss` and the expert load ([`with_expert_load`]). Validation
/// reports the cross-entropy alone.
///
/// Mixed precision (`train.precision` bf16 or f16): the step is [`GradSync::step_mixed`]
/// (unscaling and clipping applied in f32 on the master weights). f16 runs pass the `scaler`
/// whose scale `micro_step` multiplied the loss by: a step whose gradients are not finite is
/// skipped (parameters and AdamW state untouched, AdamW's step counts not advanced; the run's
/// step counter, learning-rate schedule and data still advance, so a skipped step's batch is
/// not retried), the scale is halved, and the skip is reported on stdout and in the metrics
/// line (`"skipped": true`); every f16 metrics line carries `"loss_scale"`, the scale after
/// this step's update (the one the next step uses). A bf16 step with non-finite gradients
/// stops the run as an f32 one does.
#[allow(clippy::too_many_arguments)]
pub(crate) fn drive_loop(
    cfg: &TrainConfig,
    model: &dyn Module,
    opt: &mut AdamW,
    schedule: &CosineSchedule,
    sync: &dyn GradSync,
    rep: &mut Reporter,
    loss_scale: f64,
    scaler: Option<&std::cell::RefCell<LossScaler>>,
    mut micro_step: impl FnMut(usize) -> Result<StepShare>,
    mut val: impl FnMut() -> Result<f64>,
    ctl: &RunControl<'_>,
) -> Result<LoopResult> {
    let (t, b) = (cfg.model.block_size, cfg.train.batch_size);
    let half = precision_dtype(cfg)? != DType::F32;
    let initial_val = val()?;
    rep.say(format!("step 0: val_loss={initial_val:.4}"));

    let started = Instant::now();
    let mut last_loss = f64::NAN;
    let mut last_val = initial_val;
    let mut tokens_done = 0usize;
    for step in ctl.start_step..cfg.train.steps {
        if let Some(w) = ctl.world {
            crate::flight::test_stop_hook(w.global_rank(), step);
        }
        let t0 = Instant::now();
        sync.zero_grad(opt);
        let share = micro_step(step)?;
        sync.finish()?;
        let experts = share.experts.map(PendingExperts::reduce).transpose()?;
        let lr = schedule.lr_at(step);
        let mut skipped = false;
        let grad_norm = if half {
            let scale = scaler.map_or(1.0, |s| s.borrow().scale());
            let (norm, taken) = sync.step_mixed(opt, lr, cfg.train.grad_clip, scale)?;
            if let Some(s) = scaler {
                let new_scale = s.borrow_mut().update(taken);
                if !taken {
                    skipped = true;
                    rep.say(format!(
                        "step {}: non-finite gradients in f16, step skipped, loss scale -> {}",
                        step + 1,
                        new_scale
                    ));
                }
            }
            norm
        } else if cfg.train.reference {
            // Computed even without clipping: reference mode reports the norm it promises.
            let norm = sync.exact_norm()?;
            if cfg.train.grad_clip > 0.0 {
                sync.clip_with_norm(cfg.train.grad_clip, norm)?;
            }
            norm
        } else if cfg.train.grad_clip > 0.0 {
            sync.clip(cfg.train.grad_clip)?
        } else {
            f64::NAN
        };
        let must_be_finite = (half && scaler.is_none()) || cfg.train.grad_clip > 0.0;
        if must_be_finite && !skipped && !grad_norm.is_finite() {
            // Stop before the optimizer step spreads it into the weights. The norm is global,
            // so every rank stops here, after the same collectives.
            let loss = sync.mean(share.loss)? * loss_scale + aux_term(&experts);
            if !loss.is_finite() {
                anyhow::bail!("training diverged: loss is {loss} at step {}", step + 1);
            }
            anyhow::bail!(
                "training diverged: the gradient norm is {grad_norm} at step {} (loss {loss:.4})",
                step + 1
            );
        }
        if !half {
            sync.step(opt, lr)?;
        }
        last_loss = sync.mean(share.loss)? * loss_scale + aux_term(&experts);
        if !last_loss.is_finite() {
            anyhow::bail!(
                "training diverged: loss is {last_loss} at step {}",
                step + 1
            );
        }
        let dt = t0.elapsed().as_secs_f64();
        tokens_done += b * t;
        let tps = (b * t) as f64 / dt;
        let is_last = step + 1 == cfg.train.steps;
        let eval_now =
            is_last || (cfg.train.eval_interval > 0 && (step + 1) % cfg.train.eval_interval == 0);
        let val = if eval_now { Some(val()?) } else { None };
        if let Some(v) = val.filter(|v| !v.is_finite()) {
            anyhow::bail!(
                "training diverged: the validation loss is {v} after step {}",
                step + 1
            );
        }
        if let Some(v) = val {
            last_val = v;
            rep.say(format!("step {}: val_loss={v:.4}", step + 1));
        }
        let mut line = metrics_line(step + 1, last_loss, lr, tps, grad_norm, val);
        if let Some(s) = scaler {
            line = with_loss_scale(&line, s.borrow().scale(), skipped);
        }
        if let Some((m, _)) = &experts {
            line = with_expert_load(&line, m);
        }
        rep.metrics(line)?;
        if cfg.train.log_interval > 0
            && (step + 1) % cfg.train.log_interval == 0
            && rep.pb.is_hidden()
            && !rep.quiet
        {
            println!(
                "step {:>5}/{} | loss {last_loss:.4} | lr {lr:.2e} | {tps:.0} tok/s",
                step + 1,
                cfg.train.steps
            );
        }
        rep.pb
            .set_message(format!("loss {last_loss:.4} | {tps:.0} tok/s"));
        rep.pb.inc(1);
        let done = step + 1;
        let stop = ctl.stop_requested()?;
        let periodic = ctl.save_every.is_some_and(|n| n > 0 && done % n == 0);
        let saved = match ctl.save {
            // The last step is saved when the run saves periodically, and always when it
            // resumed: `checkpoints/latest` then names this run's final state, not the state
            // it resumed from (which `export` and `--resume` would otherwise take for it).
            Some(save)
                if periodic
                    || stop
                    || (is_last && (ctl.save_every.is_some() || ctl.start_step > 0)) =>
            {
                let scaler = scaler.map(|s| s.borrow().clone());
                Some(save(done, model, opt, scaler.as_ref())?)
            }
            _ => None,
        };
        if let Some(at) = &saved {
            rep.say(format!("step {done}: checkpoint {at}"));
        }
        if stop && !is_last {
            rep.pb.abandon();
            match saved {
                Some(at) => anyhow::bail!(
                    "stopped by a signal after step {done} of {}; checkpoint {at}; continue with \
                     --resume",
                    cfg.train.steps
                ),
                None => anyhow::bail!(
                    "stopped by a signal after step {done} of {}; no checkpoint written",
                    cfg.train.steps
                ),
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(LoopResult {
        initial_val_loss: initial_val,
        final_val_loss: last_val,
        final_train_loss: last_loss,
        tokens_per_s: tokens_done as f64 / elapsed,
        elapsed_s: elapsed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_autograd::Var;
    use meshgrad_nn::optim::{AdamWConfig, Optimizer, ParamGroup};
    use meshgrad_nn::ParamBuilder;
    use meshgrad_tensor::{Device, Tensor};

    /// One device's end of a step over `params`, which [`drive_loop`]'s checks see.
    struct OneDevice(Vec<Var>);

    impl GradSync for OneDevice {
        fn zero_grad(&self, opt: &AdamW) {
            opt.zero_grad();
        }
        fn finish(&self) -> Result<()> {
            Ok(())
        }
        fn mean(&self, local: f64) -> Result<f64> {
            Ok(local)
        }
        fn clip(&self, max_norm: f64) -> Result<f64> {
            Ok(meshgrad_nn::optim::clip_grad_norm(&self.0, max_norm)?)
        }
        fn exact_norm(&self) -> Result<f64> {
            unreachable!("not in reference mode")
        }
        fn clip_with_norm(&self, _max_norm: f64, _norm: f64) -> Result<()> {
            unreachable!("not in reference mode")
        }
        fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
            Ok(opt.step(lr)?)
        }
        fn step_mixed(&self, _: &mut AdamW, _: f64, _: f64, _: f64) -> Result<(f64, bool)> {
            unreachable!("f32 only")
        }
    }

    /// Runs `drive_loop` on one parameter whose gradient `grad(step)` sets, with a loss of
    /// `loss(step)`, and returns the error message.
    fn diverge(grad: impl Fn(usize) -> f32, loss: impl Fn(usize) -> f64, clip: f64) -> String {
        let mut cfg = TrainConfig::default();
        cfg.train.steps = 3;
        cfg.train.grad_clip = clip;
        let p = Var::leaf(Tensor::from_vec(vec![1f32; 4], 4, Device::Cpu).unwrap());
        let group = ParamGroup {
            params: vec![("p".to_string(), p.clone())],
            weight_decay: 0.0,
            lr_scale: 1.0,
        };
        let mut opt = AdamW::new(vec![group], AdamWConfig::default()).unwrap();
        let schedule = CosineSchedule::new(1e-3, 1e-4, 1, 3).unwrap();
        let params = vec![p.clone()];
        let micro_step = |step: usize| -> Result<StepShare> {
            let g = Tensor::from_vec(vec![grad(step); 4], 4, Device::Cpu)?;
            p.set_grad(Some(g));
            Ok(StepShare {
                loss: loss(step),
                experts: None,
            })
        };
        let mut rep = Reporter::silent();
        let ctl = RunControl {
            start_step: 0,
            world: None,
            save_every: None,
            save: None,
        };
        // Only a save hook would read the model; there is none.
        let model = ParamBuilder::new(0)
            .build(|p| meshgrad_nn::Linear::new(p, 1, 1))
            .unwrap();
        let r = drive_loop(
            &cfg,
            &model,
            &mut opt,
            &schedule,
            &OneDevice(params),
            &mut rep,
            1.0,
            None,
            micro_step,
            || Ok(1.0),
            &ctl,
        );
        match r {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn non_finite_gradients_and_losses_stop_the_run() {
        // Finite values train.
        assert_eq!(diverge(|_| 0.5, |_| 2.0, 1.0), "");
        // A NaN gradient at the second step, with a finite loss: stopped, naming the norm.
        let msg = diverge(|s| if s == 1 { f32::NAN } else { 0.5 }, |_| 2.0, 1.0);
        assert!(
            msg.contains("training diverged: the gradient norm is NaN at step 2"),
            "{msg}"
        );
        let msg = diverge(|s| if s == 0 { f32::INFINITY } else { 0.5 }, |_| 2.0, 1.0);
        assert!(msg.contains("gradient norm is inf at step 1"), "{msg}");
        // A NaN loss is named as such, with or without a NaN gradient.
        let msg = diverge(|_| f32::NAN, |_| f64::NAN, 1.0);
        assert!(
            msg.contains("training diverged: loss is NaN at step 1"),
            "{msg}"
        );
        let msg = diverge(|_| 0.5, |s| if s == 2 { f64::NAN } else { 2.0 }, 1.0);
        assert!(msg.contains("loss is NaN at step 3"), "{msg}");
        // Without clipping no norm is computed; the NaN weights show in the validation loss
        // after the last step at the latest (here the fake validation stays finite, so the
        // loss check is what stops it).
        let msg = diverge(|_| 0.5, |s| if s == 1 { f64::INFINITY } else { 2.0 }, 0.0);
        assert!(msg.contains("loss is inf at step 2"), "{msg}");
    }
}
