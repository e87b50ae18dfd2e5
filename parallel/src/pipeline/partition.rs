//! Automatic partitioning of a layered model into pipeline stages.
//!
//! A model is described by its per-layer costs ([`ModelCosts`]): an optional input embedding,
//! `n` blocks and an optional output head, each a [`LayerCost`] (forward + backward time and the
//! bytes of its parameters, gradients, optimizer state and stashed activations). A partition
//! cuts the **blocks** into `P` contiguous, non-empty stages; the embedding always goes with the
//! first stage and the head with the last, exactly as [`StageSpec`] requires, so every partition
//! converts into stage specs ([`Partition::stage_specs`]).
//!
//! # Layers and blocks
//!
//! The layer list ([`ModelCosts::layers`]) is the embedding (if any), the blocks in order, then
//! the head (if any). With both, layer 0 is the embedding, layers `1..=n` are blocks `0..n` and
//! layer `n + 1` is the head. A stage is described both ways: [`StagePrediction::blocks`] (its
//! global block indices, those of [`StageSpec::blocks`]) and [`StagePrediction::layers`] (its
//! range in the layer list, embedding and head included). [`Partition::boundaries`] holds the
//! first **block** of each stage — always starting at 0 — which is what `--partition B0,B1,...`
//! takes and what [`Partition::fragment`] prints (`partition=0,3,6,9`).
//!
//! # Cost model
//!
//! * Time of a stage: the sum of its layers' `time_ms` (forward + backward of one microbatch).
//!   The pipeline's throughput is bounded by the slowest stage.
//! * Memory of stage `s`: the sum of its layers' parameter, gradient and optimizer bytes, plus
//!   `in_flight[s]` times the sum of its layers' activation bytes per microbatch, where
//!   `in_flight[s]` — the number of microbatches whose activations stage `s` holds at its peak —
//!   is given by the caller in a [`MemoryModel`]: `P - s` under 1F1B
//!   ([`MemoryModel::one_f_one_b`], capped at the number of microbatches), every microbatch
//!   under GPipe ([`MemoryModel::gpipe`]), or any list ([`MemoryModel::new`]).
//!
//! # Methods
//!
//! [`PartitionMethod`] is the `--partition` spec: `auto` or `speed` (minimise the slowest
//! stage's time), `memory` (minimise the largest stage's memory), `even` (equal numbers of
//! blocks, the remainder to the first stages) or explicit boundaries `B0,B1,...` (the first block
//! of each stage, e.g. `0,3,6,9` for four stages of a 12-block model).
//!
//! The optimising methods ([`optimize`]) solve a dynamic program over contiguous splits in
//! `O(P * n^2)`, under the optional per-stage memory limit ([`MemoryModel::limit_bytes`]: a
//! stage over it is never chosen; when no split fits, a one-line error names the smallest
//! achievable largest stage memory and the limit). Ties are broken deterministically: among the
//! splits optimal for the objective, those minimising the other objective (the largest stage
//! memory for `speed`, the slowest stage time for `memory`) are kept, and of those the
//! lexicographically smallest boundaries are chosen (earlier stages as short as possible).
//! `even` and explicit boundaries are predicted with the same cost model and also checked
//! against the memory limit.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use meshgrad_nn::StageSpec;
use meshgrad_tensor::{bail, Error, Result};

/// The cost of one layer (the embedding, a block or the head) for one microbatch.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCost {
    /// Name used in summaries (e.g. `embedding`, `h.3`, `head`).
    pub name: String,
    /// Forward + backward time of one microbatch, in milliseconds.
    pub time_ms: f64,
    /// Bytes of the layer's parameters.
    pub param_bytes: u64,
    /// Bytes of the layer's gradients.
    pub grad_bytes: u64,
    /// Bytes of the layer's optimizer state.
    pub optimizer_bytes: u64,
    /// Bytes of activations the layer keeps for the backward pass, per microbatch in flight.
    pub activation_bytes_per_microbatch: u64,
}

impl LayerCost {
    /// A layer named `name` taking `time_ms`, with no memory (see [`LayerCost::with_memory`]).
    pub fn new(name: impl Into<String>, time_ms: f64) -> Self {
        LayerCost {
            name: name.into(),
            time_ms,
            param_bytes: 0,
            grad_bytes: 0,
            optimizer_bytes: 0,
            activation_bytes_per_microbatch: 0,
        }
    }

    /// Sets the memory figures: parameters, gradients, optimizer state and activations per
    /// microbatch in flight, in bytes.
    pub fn with_memory(mut self, param: u64, grad: u64, optimizer: u64, activation: u64) -> Self {
        self.param_bytes = param;
        self.grad_bytes = grad;
        self.optimizer_bytes = optimizer;
        self.activation_bytes_per_microbatch = activation;
        self
    }

    /// Bytes held whatever the number of microbatches in flight: parameters, gradients and
    /// optimizer state.
    pub fn state_bytes(&self) -> u64 {
        self.param_bytes
            .saturating_add(self.grad_bytes)
            .saturating_add(self.optimizer_bytes)
    }
}

/// The per-layer costs of a model: an optional embedding (pinned to the first stage), `n >= 1`
/// blocks (split between the stages) and an optional head (pinned to the last stage). See the
/// [module docs](self) for the layer indices.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCosts {
    layers: Vec<LayerCost>,
    embedding: bool,
    head: bool,
}

impl ModelCosts {
    /// The costs of a model with an optional embedding, its blocks in order and an optional
    /// head. Fails (one line) without blocks or on a time that is negative or not finite.
    pub fn new(
        embedding: Option<LayerCost>,
        blocks: Vec<LayerCost>,
        head: Option<LayerCost>,
    ) -> Result<Self> {
        if blocks.is_empty() {
            bail!("partition: a model needs at least one block to split into stages");
        }
        let has_embedding = embedding.is_some();
        let has_head = head.is_some();
        let layers: Vec<LayerCost> = embedding.into_iter().chain(blocks).chain(head).collect();
        for l in &layers {
            if !(l.time_ms.is_finite() && l.time_ms >= 0.0) {
                bail!(
                    "partition: layer {} has time {} ms (need a finite time >= 0)",
                    l.name,
                    l.time_ms
                );
            }
        }
        Ok(ModelCosts {
            layers,
            embedding: has_embedding,
            head: has_head,
        })
    }

    /// The layer list: the embedding (if any), the blocks, the head (if any).
    pub fn layers(&self) -> &[LayerCost] {
        &self.layers
    }

    /// Number of layers, embedding and head included.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of blocks (the units split between stages).
    pub fn n_blocks(&self) -> usize {
        self.layers.len() - usize::from(self.embedding) - usize::from(self.head)
    }

    /// Whether layer 0 is an embedding pinned to the first stage.
    pub fn has_embedding(&self) -> bool {
        self.embedding
    }

    /// Whether the last layer is a head pinned to the last stage.
    pub fn has_head(&self) -> bool {
        self.head
    }

    /// The blocks' costs, in order.
    pub fn blocks(&self) -> &[LayerCost] {
        &self.layers[usize::from(self.embedding)..self.layers.len() - usize::from(self.head)]
    }

    /// Layer index of block `block`.
    pub fn block_layer(&self, block: usize) -> usize {
        block + usize::from(self.embedding)
    }

    /// The layers of the stage holding blocks `blocks`: the embedding is included when the
    /// stage starts at block 0, the head when it ends at the last block.
    pub fn stage_layers(&self, blocks: Range<usize>) -> Range<usize> {
        let start = if blocks.start == 0 {
            0
        } else {
            self.block_layer(blocks.start)
        };
        let end = if blocks.end == self.n_blocks() {
            self.n_layers()
        } else {
            self.block_layer(blocks.end)
        };
        start..end
    }
}

/// How much memory each stage needs for activations, and the optional limit per stage.
///
/// Stage `s` of `P` holds the activations of `in_flight[s]` microbatches at its peak; its
/// predicted memory is its layers' parameters + gradients + optimizer state +
/// `in_flight[s]` x their activations per microbatch. The number of stages is
/// `in_flight.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryModel {
    /// Microbatches in flight on each stage (one entry per stage).
    pub in_flight: Vec<usize>,
    /// Largest memory a stage may need, in bytes (`None`: no limit).
    pub limit_bytes: Option<u64>,
}

impl MemoryModel {
    /// `in_flight.len()` stages, stage `s` holding `in_flight[s]` microbatches, no limit.
    pub fn new(in_flight: Vec<usize>) -> Self {
        MemoryModel {
            in_flight,
            limit_bytes: None,
        }
    }

    /// 1F1B over `stages` stages and `microbatches` microbatches: stage `s` holds
    /// `min(stages - s, microbatches)` microbatches (its warm-up forwards plus the one in
    /// steady state).
    pub fn one_f_one_b(stages: usize, microbatches: usize) -> Self {
        MemoryModel::new(
            (0..stages)
                .map(|s| (stages - s).min(microbatches))
                .collect(),
        )
    }

    /// GPipe (all forwards, then all backwards): every stage holds all `microbatches`.
    pub fn gpipe(stages: usize, microbatches: usize) -> Self {
        MemoryModel::new(vec![microbatches; stages])
    }

    /// The same model with a per-stage memory limit of `bytes`.
    pub fn with_limit(mut self, bytes: u64) -> Self {
        self.limit_bytes = Some(bytes);
        self
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.in_flight.len()
    }
}

/// What the optimising partitioner minimises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Objective {
    /// The slowest stage's time (ties: then the largest stage memory).
    Speed,
    /// The largest stage's memory (ties: then the slowest stage time).
    Memory,
}

impl fmt::Display for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Objective::Speed => "speed",
            Objective::Memory => "memory",
        })
    }
}

/// The predicted cost of one stage.
#[derive(Clone, Debug, PartialEq)]
pub struct StagePrediction {
    /// Its range in the layer list ([`ModelCosts::layers`]), embedding and head included.
    pub layers: Range<usize>,
    /// Its blocks (global block indices, as in [`StageSpec::blocks`]).
    pub blocks: Range<usize>,
    /// Name of its first layer.
    pub first_layer: String,
    /// Name of its last layer.
    pub last_layer: String,
    /// Forward + backward time of one microbatch, in milliseconds.
    pub time_ms: f64,
    /// Predicted peak memory, in bytes (see [`MemoryModel`]).
    pub memory_bytes: u64,
}

/// A split of a model into pipeline stages, with each stage's predicted cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    /// The first block of each stage (`boundaries[0] == 0`, strictly increasing).
    pub boundaries: Vec<usize>,
    /// Each stage's layers and predicted cost, in order.
    pub stages: Vec<StagePrediction>,
}

impl Partition {
    /// Number of stages.
    pub fn n_stages(&self) -> usize {
        self.stages.len()
    }

    /// Time of the slowest stage, in milliseconds.
    pub fn max_time_ms(&self) -> f64 {
        self.stages.iter().map(|s| s.time_ms).fold(0.0, f64::max)
    }

    /// Memory of the largest stage, in bytes.
    pub fn max_memory_bytes(&self) -> u64 {
        self.stages
            .iter()
            .map(|s| s.memory_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The value of `objective` for this partition: the slowest stage's time (ms) or the
    /// largest stage's memory (bytes, as `f64`).
    pub fn objective_value(&self, objective: Objective) -> f64 {
        match objective {
            Objective::Speed => self.max_time_ms(),
            Objective::Memory => self.max_memory_bytes() as f64,
        }
    }

    /// Number of blocks of each stage.
    pub fn block_counts(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.blocks.len()).collect()
    }

    /// The stages as [`StageSpec`]s (the first with the embedding, the last with the head).
    pub fn stage_specs(&self) -> Result<Vec<StageSpec>> {
        let n = self.stages.last().map_or(0, |s| s.blocks.end);
        StageSpec::split(n, &self.block_counts())
    }

    /// The boundaries as `--partition` takes them: `0,3,6,9`.
    pub fn boundaries_string(&self) -> String {
        join(&self.boundaries)
    }

    /// The run summary's fragment: `partition=0,3,6,9` (the first block of each stage).
    pub fn fragment(&self) -> String {
        format!("partition={}", self.boundaries_string())
    }

    /// One line per stage: its index, blocks, layers (first..last names), predicted time and
    /// memory, e.g. `stage 0: blocks 0..3 (embedding..h.2, 4 layers): 17.00 ms, 1.50 MiB`.
    pub fn summary_lines(&self) -> Vec<String> {
        self.stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                format!(
                    "stage {i}: blocks {}..{} ({}..{}, {} layer{}): {:.2} ms, {}",
                    s.blocks.start,
                    s.blocks.end,
                    s.first_layer,
                    s.last_layer,
                    s.layers.len(),
                    if s.layers.len() == 1 { "" } else { "s" },
                    s.time_ms,
                    format_bytes(s.memory_bytes)
                )
            })
            .collect()
    }
}

/// The stage lines of [`Partition::summary_lines`], one per line.
impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, line) in self.summary_lines().iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            f.write_str(line)?;
        }
        Ok(())
    }
}

/// Bytes in binary units with two decimals (`512 B`, `1.50 KiB`, `3.25 GiB`).
pub fn format_bytes(bytes: u64) -> String {
    crate::plan::memory::binary_bytes(bytes, 2)
}

fn join(v: &[usize]) -> String {
    v.iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The `--partition` spec: `auto` (= `speed`), `speed`, `memory`, `even` or explicit boundaries
/// `B0,B1,...` (the first block of each stage, e.g. `0,3,6,9`).
///
/// Parsing checks what the spec alone allows (numbers, starting at 0, strictly increasing);
/// [`PartitionMethod::validate`] checks explicit boundaries against the number of stages and
/// blocks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PartitionMethod {
    /// Minimise the slowest stage's time (`auto`, `speed`).
    Speed,
    /// Minimise the largest stage's memory (`memory`).
    Memory,
    /// Equal numbers of blocks, the remainder to the first stages (`even`).
    Even,
    /// The first block of each stage (`0,3,6,9`).
    Explicit(Vec<usize>),
}

impl PartitionMethod {
    /// The objective the method optimises, if it optimises one.
    pub fn objective(&self) -> Option<Objective> {
        match self {
            PartitionMethod::Speed => Some(Objective::Speed),
            PartitionMethod::Memory => Some(Objective::Memory),
            PartitionMethod::Even | PartitionMethod::Explicit(_) => None,
        }
    }

    /// Parses `spec` and validates it against `stages` stages of `n_blocks` blocks.
    pub fn parse_for(spec: &str, stages: usize, n_blocks: usize) -> Result<Self> {
        let m: PartitionMethod = spec.parse()?;
        m.validate(stages, n_blocks)?;
        Ok(m)
    }

    /// Checks the method against `stages` stages of `n_blocks` blocks (one-line errors naming
    /// the numbers): `1 <= stages <= n_blocks`, and explicit boundaries are exactly `stages`
    /// entries, start at 0, strictly increase and stay below `n_blocks`.
    pub fn validate(&self, stages: usize, n_blocks: usize) -> Result<()> {
        check_stage_count(stages, n_blocks)?;
        if let PartitionMethod::Explicit(b) = self {
            check_boundaries(b, stages, n_blocks)?;
        }
        Ok(())
    }

    /// The partition this method gives for `costs` under `memory` (see [`optimize`], [`even`]
    /// and [`explicit`]).
    pub fn partition(&self, costs: &ModelCosts, memory: &MemoryModel) -> Result<Partition> {
        match self {
            PartitionMethod::Speed => optimize(costs, memory, Objective::Speed),
            PartitionMethod::Memory => optimize(costs, memory, Objective::Memory),
            PartitionMethod::Even => even(costs, memory),
            PartitionMethod::Explicit(b) => explicit(costs, memory, b),
        }
    }
}

impl FromStr for PartitionMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        match t {
            "auto" | "speed" => return Ok(PartitionMethod::Speed),
            "memory" => return Ok(PartitionMethod::Memory),
            "even" => return Ok(PartitionMethod::Even),
            _ => {}
        }
        let mut b = Vec::new();
        for part in t.split(',') {
            let p = part.trim();
            match p.parse::<usize>() {
                Ok(v) => b.push(v),
                Err(_) => bail!(
                    "--partition: `{p}` in `{t}` is not a block index (expected auto, speed, \
                     memory, even or the first block of each stage, e.g. 0,3,6,9)"
                ),
            }
        }
        check_boundary_order(&b)?;
        Ok(PartitionMethod::Explicit(b))
    }
}

impl fmt::Display for PartitionMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PartitionMethod::Speed => f.write_str("speed"),
            PartitionMethod::Memory => f.write_str("memory"),
            PartitionMethod::Even => f.write_str("even"),
            PartitionMethod::Explicit(b) => f.write_str(&join(b)),
        }
    }
}

fn check_stage_count(stages: usize, n_blocks: usize) -> Result<()> {
    if stages == 0 {
        bail!("partition: 0 stages (need at least 1)");
    }
    if stages > n_blocks {
        bail!(
            "partition: {stages} stages but only {n_blocks} blocks (each stage needs at least \
             one block)"
        );
    }
    Ok(())
}

fn check_boundary_order(b: &[usize]) -> Result<()> {
    if b.first() != Some(&0) {
        bail!(
            "--partition {}: the first stage must start at block 0, not {}",
            join(b),
            b.first().map_or("nothing".to_string(), |v| v.to_string())
        );
    }
    for w in b.windows(2) {
        if w[1] <= w[0] {
            bail!(
                "--partition {}: boundaries must strictly increase ({} then {})",
                join(b),
                w[0],
                w[1]
            );
        }
    }
    Ok(())
}

fn check_boundaries(b: &[usize], stages: usize, n_blocks: usize) -> Result<()> {
    check_boundary_order(b)?;
    if b.len() != stages {
        bail!(
            "--partition {}: {} boundaries for {stages} stages (give the first block of each \
             stage)",
            join(b),
            b.len()
        );
    }
    let last = *b.last().expect("checked non-empty");
    if last >= n_blocks {
        bail!(
            "--partition {}: boundary {last} leaves the last stage no block (the model has \
             {n_blocks} blocks, 0 to {})",
            join(b),
            n_blocks - 1
        );
    }
    Ok(())
}

/// Per-range sums, computed once: `time[i][j]`, `state[i][j]` and `act[i][j]` for the stage
/// holding blocks `i..j` (embedding included when `i == 0`, head when `j == n`). Each entry is
/// a fixed function of `(i, j)`, so comparisons between stages are exact and deterministic.
struct RangeTable {
    n: usize,
    time: Vec<f64>,
    state: Vec<u64>,
    act: Vec<u64>,
}

impl RangeTable {
    fn new(costs: &ModelCosts) -> Self {
        let n = costs.n_blocks();
        let w = n + 1;
        let mut time = vec![0.0; w * w];
        let mut state = vec![0u64; w * w];
        let mut act = vec![0u64; w * w];
        let layers = costs.layers();
        fn add(acc: &mut (f64, u64, u64), l: &LayerCost) {
            acc.0 += l.time_ms;
            acc.1 = acc.1.saturating_add(l.state_bytes());
            acc.2 = acc.2.saturating_add(l.activation_bytes_per_microbatch);
        }
        for i in 0..n {
            let mut acc = (0.0f64, 0u64, 0u64);
            if i == 0 && costs.has_embedding() {
                add(&mut acc, &layers[0]);
            }
            for j in i + 1..=n {
                add(&mut acc, &layers[costs.block_layer(j - 1)]);
                let mut stage = acc;
                if j == n && costs.has_head() {
                    add(&mut stage, &layers[layers.len() - 1]);
                }
                time[i * w + j] = stage.0;
                state[i * w + j] = stage.1;
                act[i * w + j] = stage.2;
            }
        }
        RangeTable {
            n,
            time,
            state,
            act,
        }
    }

    fn time(&self, i: usize, j: usize) -> f64 {
        self.time[i * (self.n + 1) + j]
    }

    /// Memory of blocks `i..j` as stage `stage` of `memory`.
    fn memory(&self, memory: &MemoryModel, stage: usize, i: usize, j: usize) -> u64 {
        let k = i * (self.n + 1) + j;
        self.state[k].saturating_add(self.act[k].saturating_mul(memory.in_flight[stage] as u64))
    }
}

/// Min over splits of blocks `0..n` into `p` non-empty stages of the max over stages of
/// `value(stage, i, j)`, where `None` forbids a stage. `None` when no split is allowed.
fn min_max<V: Copy + PartialOrd>(
    n: usize,
    p: usize,
    value: impl Fn(usize, usize, usize) -> Option<V>,
) -> Option<V> {
    // best[j]: best value for blocks 0..j split into the stages so far.
    let mut best: Vec<Option<V>> = (0..=n)
        .map(|j| if j >= 1 { value(0, 0, j) } else { None })
        .collect();
    for k in 1..p {
        let mut next: Vec<Option<V>> = vec![None; n + 1];
        // Stage k ends at j >= k + 1 and leaves p - k - 1 blocks at least for the rest.
        for (j, slot) in next
            .iter_mut()
            .enumerate()
            .take(n - (p - k - 1) + 1)
            .skip(k + 1)
        {
            let mut cur: Option<V> = None;
            for (i, prev) in best.iter().enumerate().take(j).skip(k) {
                let (Some(prev), Some(v)) = (*prev, value(k, i, j)) else {
                    continue;
                };
                let m = if v > prev { v } else { prev };
                if cur.is_none_or(|c| m < c) {
                    cur = Some(m);
                }
            }
            *slot = cur;
        }
        best = next;
    }
    best[n]
}

/// The lexicographically smallest boundaries of a split of blocks `0..n` into `p` stages each
/// allowed by `ok(stage, i, j)`, if any.
fn smallest_boundaries(
    n: usize,
    p: usize,
    ok: impl Fn(usize, usize, usize) -> bool,
) -> Option<Vec<usize>> {
    // feasible[k][i]: blocks i..n split into stages k..p.
    let mut feasible = vec![vec![false; n + 1]; p + 1];
    feasible[p][n] = true;
    for k in (0..p).rev() {
        for i in 0..n {
            feasible[k][i] = (i + 1..=n).any(|j| feasible[k + 1][j] && ok(k, i, j));
        }
    }
    if !feasible[0][0] {
        return None;
    }
    let mut bounds = vec![0];
    let mut i = 0;
    for k in 0..p {
        let j = (i + 1..=n).find(|&j| feasible[k + 1][j] && ok(k, i, j))?;
        if k + 1 < p {
            bounds.push(j);
        }
        i = j;
    }
    Some(bounds)
}

/// The partition minimising `objective` over all splits of the blocks into
/// `memory.stages()` non-empty contiguous stages, each within `memory.limit_bytes`; ties are
/// broken by the other objective, then by the lexicographically smallest boundaries (see the
/// [module docs](self)). Fails (one line) on a bad stage count, or when no split fits the limit,
/// naming the smallest achievable largest stage memory and the limit.
pub fn optimize(
    costs: &ModelCosts,
    memory: &MemoryModel,
    objective: Objective,
) -> Result<Partition> {
    let p = memory.stages();
    let n = costs.n_blocks();
    check_stage_count(p, n)?;
    let t = RangeTable::new(costs);
    let limit = memory.limit_bytes.unwrap_or(u64::MAX);
    let mem = |k: usize, i: usize, j: usize| t.memory(memory, k, i, j);
    let fits = |k: usize, i: usize, j: usize| mem(k, i, j) <= limit;

    // The best largest memory and slowest time, each under the limit and any bound found before.
    let best_mem = |max_time: f64| {
        min_max(n, p, |k, i, j| {
            (fits(k, i, j) && t.time(i, j) <= max_time).then(|| mem(k, i, j))
        })
    };
    let best_time = |max_mem: u64| {
        min_max(n, p, |k, i, j| {
            (fits(k, i, j) && mem(k, i, j) <= max_mem).then(|| t.time(i, j))
        })
    };
    let found = match objective {
        Objective::Speed => best_time(u64::MAX).and_then(|tm| best_mem(tm).map(|m| (tm, m))),
        Objective::Memory => best_mem(f64::INFINITY).and_then(|m| best_time(m).map(|tm| (tm, m))),
    };
    let Some((max_time, max_mem)) = found else {
        let smallest = min_max(n, p, |k, i, j| Some(mem(k, i, j))).unwrap_or(u64::MAX);
        bail!(
            "partition: no split of {n} blocks into {p} stages fits the per-stage memory limit of \
             {} ({limit} bytes); the smallest achievable largest stage needs {} ({smallest} bytes)",
            format_bytes(limit),
            format_bytes(smallest)
        );
    };
    let boundaries = smallest_boundaries(n, p, |k, i, j| {
        fits(k, i, j) && t.time(i, j) <= max_time && mem(k, i, j) <= max_mem
    })
    .expect("the optimal bounds are achieved by some split");
    predict(costs, memory, &boundaries)
}

/// The `even` partition: `memory.stages()` stages of equal numbers of blocks, the remainder to
/// the first stages (the embedding with the first stage, the head with the last), predicted
/// with the cost model. Fails (one line) on a bad stage count or a stage over the memory limit.
pub fn even(costs: &ModelCosts, memory: &MemoryModel) -> Result<Partition> {
    let p = memory.stages();
    let n = costs.n_blocks();
    check_stage_count(p, n)?;
    let mut boundaries = Vec::with_capacity(p);
    let mut start = 0;
    for s in 0..p {
        boundaries.push(start);
        start += n / p + usize::from(s < n % p);
    }
    let part = predict(costs, memory, &boundaries)?;
    check_limit(&part, memory)?;
    Ok(part)
}

/// The partition of explicit `boundaries` (the first block of each stage), predicted with the
/// cost model. Fails (one line, naming the numbers) on boundaries that are not exactly
/// `memory.stages()` strictly increasing blocks from 0, or a stage over the memory limit.
pub fn explicit(
    costs: &ModelCosts,
    memory: &MemoryModel,
    boundaries: &[usize],
) -> Result<Partition> {
    let part = predict(costs, memory, boundaries)?;
    check_limit(&part, memory)?;
    Ok(part)
}

/// The predicted costs of the stages starting at `boundaries` (the first block of each stage),
/// without checking the memory limit. Fails (one line) on boundaries that do not split the
/// blocks into `memory.stages()` non-empty stages.
pub fn predict(
    costs: &ModelCosts,
    memory: &MemoryModel,
    boundaries: &[usize],
) -> Result<Partition> {
    let p = memory.stages();
    let n = costs.n_blocks();
    check_stage_count(p, n)?;
    check_boundaries(boundaries, p, n)?;
    let t = RangeTable::new(costs);
    let layers = costs.layers();
    let stages = (0..p)
        .map(|s| {
            let i = boundaries[s];
            let j = boundaries.get(s + 1).copied().unwrap_or(n);
            let lr = costs.stage_layers(i..j);
            StagePrediction {
                first_layer: layers[lr.start].name.clone(),
                last_layer: layers[lr.end - 1].name.clone(),
                layers: lr,
                blocks: i..j,
                time_ms: t.time(i, j),
                memory_bytes: t.memory(memory, s, i, j),
            }
        })
        .collect();
    Ok(Partition {
        boundaries: boundaries.to_vec(),
        stages,
    })
}

fn check_limit(part: &Partition, memory: &MemoryModel) -> Result<()> {
    if let Some(limit) = memory.limit_bytes {
        if let Some((s, st)) = part
            .stages
            .iter()
            .enumerate()
            .find(|(_, st)| st.memory_bytes > limit)
        {
            bail!(
                "partition {}: stage {s} (blocks {}..{}) needs {} ({} bytes), over the per-stage \
                 memory limit of {} ({limit} bytes)",
                part.boundaries_string(),
                st.blocks.start,
                st.blocks.end,
                format_bytes(st.memory_bytes),
                st.memory_bytes,
                format_bytes(limit)
            );
        }
    }
    Ok(())
}
