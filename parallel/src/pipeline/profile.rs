//! Measuring a layered model's per-layer costs on the device, for the partitioner.
//!
//! [`profile_layers`] runs forward + backward of small stages of a [`ModelStage`] model on the
//! device its `build` closure creates them on, and returns the [`ModelCosts`] that
//! [`PartitionMethod::partition`](super::partition::PartitionMethod::partition) consumes: the
//! embedding, every block and the head, each with its time and memory for one microbatch (the
//! `batch` given). [`profile_lines`] prints the result, one line per layer.
//!
//! # Method
//!
//! A [`ModelStage`] has no entry point for a single embedding or head, so they are measured by
//! difference. The probes are `n + 2` stages:
//!
//! * block `i` alone, `StageSpec::new(i..i + 1, false, false)`, for every block;
//! * the embedding with block 0, `StageSpec::new(0..1, true, false)`;
//! * block `n - 1` with the head, `StageSpec::new(n - 1..n, false, true)`.
//!
//! A stage without the embedding reads hidden states: the probes are fed, as a fresh leaf each
//! run, the output of the embedding probe on `batch` (whose shape every block takes). A run is
//! what a pipeline stage does for one microbatch: the forward, then the backward of the loss on
//! the head probe, or of an all-ones gradient of the output's shape (made once per probe,
//! outside the timing) elsewhere. Gradients accumulate across runs, as across the microbatches
//! of a step.
//!
//! * **Time.** After one first run (which creates any lazily initialised parameter and the
//!   gradients) and one memory run, `warmup_steps` rounds whose fastest run estimates each
//!   probe's run time, then `steps` timed rounds. Each round takes one sample of every probe,
//!   starting one probe later each round, so load from other processes falls on all probes
//!   alike instead of on whichever was measured when it came. A sample is as many back-to-back
//!   runs as make it last [`ProfileOptions::min_sample_ms`], divided by their number: every
//!   sample is then exposed alike to time slicing (on a shared machine a run shorter than the
//!   scheduler's slice usually escapes preemption and a longer one never does, which would
//!   make long layers look slower than short ones), and the clock's resolution does not matter.
//!   A probe's time is the median of its samples. A block costs its probe's time; the
//!   embedding costs the embedding probe's time minus block 0's, the head the head probe's time
//!   minus block `n - 1`'s (each clamped at 0).
//! * **Parameters.** Bytes (elements x dtype size) of each probe's parameters; the embedding's
//!   and the head's are the parameters of their probe that the block probe lacks (by name). The
//!   head's probe holds its own copy of a tied table (GPT's `wte.weight`), as the last stage of
//!   a pipeline of two stages or more does, so the layers' parameter bytes sum to the
//!   single-device model's plus one copy of the tied table.
//! * **Gradients** = the bytes of the trainable parameters (those that require grad);
//!   **optimizer state** = those bytes times
//!   [`ProfileOptions::optimizer_bytes_per_param_byte`] (AdamW: 2, its two moments having the
//!   parameter's dtype).
//! * **Activations.** Bytes allocated during the probe's forward and still live when it returns
//!   (what a stage holds between a microbatch's forward and its backward: the tensors saved for
//!   backward and the output), measured by the tensor crate's allocator accounting: the forward
//!   runs under a fresh [`MemoryTracker`] installed for this thread. The probe's input is not
//!   counted (it is the previous layer's output, counted there). Embedding and head again by
//!   difference (clamped at 0).
//!
//! # Limits
//!
//! * The profile holds every probe at once, so the whole model plus two blocks and a copy of the
//!   tied table must fit on the device.
//! * Times are wall-clock times of the stage's own compute on an otherwise idle pipeline: no
//!   communication, no overlap, no contention with other stages on the same device. On a shared
//!   or throttling machine they are noisy; more `steps` and a longer `min_sample_ms` narrow
//!   the median. On the CPU the kernels use the current rayon pool: profile inside a pool of
//!   the threads each stage will have (a stage sharing the cores with the others runs its
//!   parallel kernels slower than alone).
//! * The embedding's and the head's times are differences of two medians, so a layer much
//!   cheaper than a block is within noise of 0 (which is then what it gets).
//! * Activations count allocations on the calling thread only (kernels allocating on worker
//!   threads would escape), not the forward's transient peak, and count a boundary tensor once,
//!   on the layer that produces it: a pipeline on several devices also holds the received copy
//!   on the next stage. Activation checkpointing is measured as the stage is built.
//! * Optimizer state is a ratio, not measured: state that is not elementwise in the parameter's
//!   dtype (f32 master weights of bf16 parameters, per-parameter step counts) must be folded
//!   into the ratio by the caller.

use std::collections::HashSet;
use std::time::Instant;

use meshgrad_autograd::Var;
use meshgrad_nn::{ModelStage, Module, StageSpec};
use meshgrad_tensor::alloc::{with_tracker, MemoryTracker};
use meshgrad_tensor::{bail, Error, Result, Tensor};

use super::partition::{format_bytes, LayerCost, ModelCosts};

/// How [`profile_layers`] measures.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileOptions {
    /// Untimed rounds (every probe once) before the timed ones; their fastest run sets how many
    /// runs a sample takes (without warm-up, the first run does).
    pub warmup_steps: usize,
    /// Timed rounds (at least 1); each probe's time is the median of its `steps` samples.
    pub steps: usize,
    /// Shortest duration of one sample, in milliseconds: a probe faster than this is run
    /// several times back to back per sample (see the [module docs](self)).
    pub min_sample_ms: f64,
    /// Bytes of optimizer state per byte of trainable parameters: 2 for AdamW (two moments in
    /// the parameter's dtype), 1 for SGD with momentum, 0 for plain SGD.
    pub optimizer_bytes_per_param_byte: f64,
}

impl Default for ProfileOptions {
    /// 2 warm-up rounds, 5 timed rounds of samples of at least 10 ms, AdamW's optimizer state.
    fn default() -> Self {
        ProfileOptions {
            warmup_steps: 2,
            steps: 5,
            min_sample_ms: 10.0,
            optimizer_bytes_per_param_byte: 2.0,
        }
    }
}

impl ProfileOptions {
    /// `warmup_steps` untimed and `steps` timed rounds, samples of at least 10 ms, AdamW's
    /// optimizer state.
    pub fn new(warmup_steps: usize, steps: usize) -> Self {
        ProfileOptions {
            warmup_steps,
            steps,
            ..ProfileOptions::default()
        }
    }

    /// The same options with samples of at least `ms` milliseconds.
    pub fn with_min_sample_ms(mut self, ms: f64) -> Self {
        self.min_sample_ms = ms;
        self
    }

    /// The same options with `ratio` bytes of optimizer state per trainable parameter byte.
    pub fn with_optimizer_state(mut self, ratio: f64) -> Self {
        self.optimizer_bytes_per_param_byte = ratio;
        self
    }

    fn validate(&self) -> Result<()> {
        if self.steps == 0 {
            bail!("profile: steps is 0 (need at least one timed run per layer)");
        }
        let ms = self.min_sample_ms;
        if !(ms.is_finite() && ms >= 0.0) {
            bail!("profile: min_sample_ms is {ms} (need a finite number >= 0)");
        }
        let r = self.optimizer_bytes_per_param_byte;
        if !(r.is_finite() && r >= 0.0) {
            bail!("profile: optimizer_bytes_per_param_byte is {r} (need a finite number >= 0)");
        }
        Ok(())
    }
}

/// Measures the per-layer costs of a model of `n_blocks` blocks on the device `build` creates
/// its stages on, running forward + backward of one microbatch `batch` (see the
/// [module docs](self) for the method and its limits).
///
/// `build(spec)` must create the model's stage `spec`, as the pipeline would (same config,
/// dtype, device, activation checkpointing). The result has the embedding (`embedding`), the
/// blocks (named by the common module path of their parameters, e.g. `h.3` or
/// `bert.encoder.layer.3`) and the head (`head`). One-line errors for `n_blocks` 0, bad
/// options, a stage that fails to build or to run (naming it).
pub fn profile_layers<S: ModelStage>(
    n_blocks: usize,
    build: impl Fn(StageSpec) -> Result<S>,
    batch: &S::Batch,
    opts: &ProfileOptions,
) -> Result<ModelCosts> {
    if n_blocks == 0 {
        bail!("profile: n_blocks is 0 (a model needs at least one block)");
    }
    opts.validate()?;
    let make = |spec: StageSpec| -> Result<Probe<S>> {
        let stage = build(spec.clone()).map_err(|e| {
            Error::msg(format!("profile: building the stage of {spec} failed: {e}"))
        })?;
        if stage.spec() != &spec {
            bail!(
                "profile: asked to build the stage of {spec}, got one of {}",
                stage.spec()
            );
        }
        Ok(Probe {
            stage,
            input: None,
            grad: None,
            first_ms: f64::INFINITY,
            warmup_ms: f64::INFINITY,
            reps: 1,
            times: Vec::with_capacity(opts.steps),
            activation_bytes: 0,
        })
    };

    // The embedding probe's output is every other probe's input.
    let mut embedding = make(StageSpec::new(0..1, true, false))?;
    let hidden = embedding.first_run(batch)?;
    let mut probes: Vec<Probe<S>> = Vec::with_capacity(n_blocks + 2);
    for i in 0..n_blocks {
        probes.push(make(StageSpec::new(i..i + 1, false, false))?);
    }
    probes.push(make(StageSpec::new(n_blocks - 1..n_blocks, false, true))?);
    for p in &mut probes {
        p.input = Some(hidden.clone());
        p.first_run(batch)?;
    }
    probes.push(embedding);

    for p in &mut probes {
        p.measure_activations(batch)?;
    }
    let np = probes.len();
    for _ in 0..opts.warmup_steps {
        for p in &mut probes {
            let ms = p.timed(batch, 1)?;
            p.warmup_ms = p.warmup_ms.min(ms);
        }
    }
    for p in &mut probes {
        let est = if opts.warmup_steps > 0 {
            p.warmup_ms
        } else {
            p.first_ms
        };
        p.reps = (opts.min_sample_ms / est.max(1e-6)).ceil().clamp(1.0, 1e6) as usize;
    }
    for round in 0..opts.steps {
        for k in 0..np {
            let p = &mut probes[(round + k) % np];
            let ms = p.timed(batch, p.reps)?;
            p.times.push(ms);
        }
    }

    let embedding = probes.pop().expect("pushed above");
    let head = probes.pop().expect("pushed above");
    let ratio = opts.optimizer_bytes_per_param_byte;
    let blocks: Vec<LayerCost> = probes
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = p.stage.named_parameters();
            let name = common_path(&params).unwrap_or_else(|| format!("block {i}"));
            layer_cost(name, p.median_ms(), &params, ratio, p.activation_bytes)
        })
        .collect();
    let minus = |name: &str, probe: &Probe<S>, block: &Probe<S>| {
        let params = params_not_in(&probe.stage, &block.stage);
        let time = (probe.median_ms() - block.median_ms()).max(0.0);
        let act = probe
            .activation_bytes
            .saturating_sub(block.activation_bytes);
        layer_cost(name.to_string(), time, &params, ratio, act)
    };
    let embedding_cost = minus("embedding", &embedding, &probes[0]);
    let head_cost = minus("head", &head, &probes[n_blocks - 1]);
    ModelCosts::new(Some(embedding_cost), blocks, Some(head_cost))
}

/// One line per layer of `costs`: its name, time and memory, e.g.
/// `h.3: 1.234 ms, params 1.50 MiB, grads 1.50 MiB, optimizer 3.00 MiB, activations 96.00 KiB`
/// (activations per microbatch in flight).
pub fn profile_lines(costs: &ModelCosts) -> Vec<String> {
    costs
        .layers()
        .iter()
        .map(|l| {
            format!(
                "{}: {:.3} ms, params {}, grads {}, optimizer {}, activations {}",
                l.name,
                l.time_ms,
                format_bytes(l.param_bytes),
                format_bytes(l.grad_bytes),
                format_bytes(l.optimizer_bytes),
                format_bytes(l.activation_bytes_per_microbatch)
            )
        })
        .collect()
}

/// One probe stage, its input (hidden states; `None` for the embedding's) and measurements.
struct Probe<S> {
    stage: S,
    input: Option<Tensor>,
    /// The gradient of the output its backward starts from (`None` on the head: the loss's).
    grad: Option<Tensor>,
    /// Time of the first run, and of the fastest warm-up run (ms).
    first_ms: f64,
    warmup_ms: f64,
    /// Runs per sample.
    reps: usize,
    /// The samples: ms per run.
    times: Vec<f64>,
    activation_bytes: u64,
}

impl<S: ModelStage> Probe<S> {
    fn forward(&self, batch: &S::Batch) -> Result<Var> {
        let input = self.input.as_ref().map(|t| Var::leaf(t.clone()));
        self.stage
            .forward_stage(batch, input.as_ref())
            .map_err(|e| self.error("forward", e))
    }

    fn backward(&self, out: Var) -> Result<()> {
        match &self.grad {
            Some(g) => out.backward_with(g.clone()),
            None => out.backward(),
        }
        .map_err(|e| self.error("backward", e))
    }

    fn run(&self, batch: &S::Batch) -> Result<()> {
        let out = self.forward(batch)?;
        self.backward(out)
    }

    /// Milliseconds per run of `reps` runs back to back.
    fn timed(&self, batch: &S::Batch, reps: usize) -> Result<f64> {
        let start = Instant::now();
        for _ in 0..reps {
            self.run(batch)?;
        }
        Ok(start.elapsed().as_secs_f64() * 1e3 / reps as f64)
    }

    /// The first run: makes the output gradient (all ones) of a stage without the head, and
    /// returns the output's value.
    fn first_run(&mut self, batch: &S::Batch) -> Result<Tensor> {
        let start = Instant::now();
        let out = self.forward(batch)?;
        let value = out.tensor().clone();
        if !self.stage.spec().head {
            self.grad = Some(value.ones_like()?);
        }
        self.backward(out)?;
        self.first_ms = start.elapsed().as_secs_f64() * 1e3;
        Ok(value)
    }

    /// Bytes allocated by the forward and still live when it returns (a fresh tracker).
    fn measure_activations(&mut self, batch: &S::Batch) -> Result<()> {
        let tracker = MemoryTracker::new();
        let out = with_tracker(tracker.clone(), || self.forward(batch))?;
        self.activation_bytes = tracker.stats().current as u64;
        self.backward(out)
    }

    fn median_ms(&self) -> f64 {
        let mut t = self.times.clone();
        t.sort_by(f64::total_cmp);
        let n = t.len();
        if n % 2 == 1 {
            t[n / 2]
        } else {
            (t[n / 2 - 1] + t[n / 2]) / 2.0
        }
    }

    fn error(&self, what: &str, e: Error) -> Error {
        Error::msg(format!(
            "profile: {what} of the stage of {} failed: {e}",
            self.stage.spec()
        ))
    }
}

fn layer_cost(
    name: String,
    time_ms: f64,
    params: &[(String, Var)],
    optimizer_ratio: f64,
    activation_bytes: u64,
) -> LayerCost {
    let bytes = |v: &Var| (v.tensor().elem_count() * v.tensor().dtype().size_in_bytes()) as u64;
    let param: u64 = params.iter().map(|(_, v)| bytes(v)).sum();
    let grad: u64 = params
        .iter()
        .filter(|(_, v)| v.requires_grad())
        .map(|(_, v)| bytes(v))
        .sum();
    let optimizer = (grad as f64 * optimizer_ratio).round() as u64;
    LayerCost::new(name, time_ms).with_memory(param, grad, optimizer, activation_bytes)
}

/// The parameters of `stage` whose names `other` lacks.
fn params_not_in<S: Module>(stage: &S, other: &S) -> Vec<(String, Var)> {
    let names: HashSet<String> = other
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    stage
        .named_parameters()
        .into_iter()
        .filter(|(n, _)| !names.contains(n))
        .collect()
}

/// The longest common module path (dotted prefix) of the parameters' modules: `h.3` for
/// `h.3.ln_1.weight` and `h.3.attn.c_attn.weight`. `None` when they share none.
fn common_path(params: &[(String, Var)]) -> Option<String> {
    let mut parts: Option<Vec<&str>> = None;
    for (name, _) in params {
        let mut module: Vec<&str> = name.split('.').collect();
        module.pop();
        parts = Some(match parts {
            None => module,
            Some(p) => p
                .iter()
                .zip(&module)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| *a)
                .collect(),
        });
    }
    parts.filter(|p| !p.is_empty()).map(|p| p.join("."))
}
