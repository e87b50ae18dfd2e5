//! The memory a training or inference run needs, in bytes, from the model's [`ModelShape`] and
//! the layout alone: the formulas `meshgrad train`'s preflight check refuses a run with. A rough
//! formula, in f32 bytes, meant to catch runs that cannot fit (a width of a million, a billion
//! layers) rather than to predict the peak to the megabyte:
//!
//! * **Parameters** `P`: the model's exact count, split in the parts tensor parallelism divides
//!   (the token table, an untied head, the attention and MLP matrices and their column-parallel
//!   biases) and the parts every tensor-parallel rank holds whole (position and token-type
//!   tables, norms, output biases, a head transform). A rank holds `split / tp + replicated` of
//!   the embedding, the head and `ceil(n_layer / pp)` blocks (with `pp > 1` the embedding and the
//!   head are counted on the same rank: an upper bound for the first and the last stage).
//! * **Model states**: parameters `4 P`; gradients `8 P` (the accumulated gradients, and the
//!   fresh ones autograd hands over in the backward or the checkpoint's buffer at the end);
//!   AdamW's two moments `8 P`. Under mixed precision ([`Precision::Bf16`], [`Precision::Fp8`])
//!   the working parameters are 2-byte copies (`2 P`), the fresh gradients too (gradients `4 P +
//!   2 P`), and the f32 master weights join the optimizer state (`4 P + 8 P`): the same 20 bytes
//!   per parameter in all, split as the run holds them. Sharded over `S` ranks as ZeRO does: ZeRO-1 divides the moments
//!   by `S`; ZeRO-2 also the gradients (`4 P / S`, plus the largest unit's fresh gradient); ZeRO-3
//!   (fsdp) the parameters too (`4 P / S`, plus the largest unit, a block or the embedding,
//!   gathered whole). At the end of a ZeRO-3 run every rank gathers its full parameters again
//!   (for the checkpoint), which the per-rank figure also covers.
//! * **Reference mode** adds to the gradients `(floor(log2 g) + 1) · 4 P` for the pending
//!   subtrees of the rank's `g` row groups and `dp · 4 P` for a tree-ordered reduction receiving
//!   every data-parallel rank's contribution (an upper bound), and its activations are those of
//!   one row group.
//! * **Activations**, per token of a micro-batch (`batch_size / dp` rows split into
//!   `microbatches`, of `positions` tokens), in values of 4 bytes (2 under mixed precision): per block, what the backward keeps:
//!   `4 C` outside the attention and the MLP (the block input, the two norms' outputs, the
//!   residual; divided by `tp` under sequence parallelism) and `4 C + 2 F` inside them (q/k/v,
//!   the attention output, the MLP's up-projection and activation of width `F`; `3 F` for a
//!   gated MLP; divided by `tp`), the fused attention keeping no `T x T` probabilities; that for
//!   every block of the rank plus one more for the backward's temporaries, and the `H T`
//!   attention scores of one block being computed (with activation checkpointing: the block
//!   inputs `C` plus two whole blocks); `4 C` for the embedding and the final norm (`8 C` with a
//!   head transform); `3 V / tp` for the logits, their softmax and their gradient. A pipeline
//!   rank holds `min(microbatches, pp)` micro-batches in flight (1F1B, zero bubble),
//!   `min(microbatches, 2 pp)` (interleaved) or all of them (GPipe): each keeps its blocks'
//!   values (or their inputs) and the embedding's, while the backward's temporaries, the
//!   attention scores and the logits exist for one micro-batch at a time.
//! * **Gathering**: with `tp` or `pp` above 1, rank 0 builds the whole model once more at the end
//!   (`4 P`) to write the checkpoint.
//!
//! The total is the largest rank's figure times the number of ranks, plus the gathering. The
//! arithmetic is checked (`checked_mul`, `checked_add`), and an overflow stays one through every
//! later step, divisions included: sizes whose products do not fit in 64 bits come out as
//! `u64::MAX` ([`MemoryEstimate::overflowed`]) instead of reaching an allocation.
//!
//! For inference ([`estimate_inference`]): parameters (`4 P`) and the activations of one forward
//! pass without gradients (two blocks of temporaries, the logits).

use std::fmt;
use std::ops::{Add, Mul};

use meshgrad_nn::ModelShape;

use crate::layout::{ParallelLayout, ZeroStage};
use crate::pipeline::ScheduleKind;

/// Bytes of one value (f32, the dtype every run and checkpoint load uses).
const F32: u64 = 4;

/// The precision of a training run's parameters and activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// bf16 (or f16) weights, gradients and activations; f32 master weights and AdamW state.
    Bf16,
    /// As [`Precision::Bf16`], the matrix multiplications in fp8 (activations kept in bf16).
    Fp8,
}

impl Precision {
    /// Bytes of one working value (a parameter copy, an activation, a fresh gradient).
    pub fn bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::Fp8 => 2,
        }
    }

    /// The precision a `train.precision` or `--precision` value names (`f16` trains as `bf16`
    /// does, with a loss scale).
    pub fn parse(s: &str) -> Option<Precision> {
        match s {
            "f32" => Some(Precision::F32),
            "bf16" | "f16" => Some(Precision::Bf16),
            "fp8" => Some(Precision::Fp8),
            _ => None,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
        })
    }
}

/// A size in checked 64-bit arithmetic (`checked_add`, `checked_mul`): `None` once a step
/// overflows, and in every result computed from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct N(Option<u64>);

impl N {
    const fn of(x: u64) -> N {
        N(Some(x))
    }

    /// `self / d`, rounded up (`d` of 0 counts as 1).
    fn div_ceil(self, d: N) -> N {
        match (self.0, d.0) {
            (Some(a), Some(b)) => N(Some(a.div_ceil(b.max(1)))),
            _ => N(None),
        }
    }

    /// The larger, or `None` when either overflowed.
    fn max(self, o: N) -> N {
        N(self.0.zip(o.0).map(|(a, b)| a.max(b)))
    }

    /// The value, or `u64::MAX` after an overflow.
    fn get(self) -> u64 {
        self.0.unwrap_or(u64::MAX)
    }
}

impl Add for N {
    type Output = N;
    fn add(self, o: N) -> N {
        N(self.0.zip(o.0).and_then(|(a, b)| a.checked_add(b)))
    }
}

impl Mul for N {
    type Output = N;
    fn mul(self, o: N) -> N {
        N(self.0.zip(o.0).and_then(|(a, b)| a.checked_mul(b)))
    }
}

fn n(x: usize) -> N {
    N(u64::try_from(x).ok())
}

/// 1 when `on`, else 0.
fn flag(on: bool) -> N {
    N::of(u64::from(on))
}

/// A count of parameters, split into what tensor parallelism divides and what it replicates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Params {
    split: N,
    replicated: N,
}

impl Params {
    fn total(self) -> N {
        self.split + self.replicated
    }

    /// What one of `tp` tensor-parallel ranks holds.
    fn local(self, tp: usize) -> N {
        self.split.div_ceil(n(tp)) + self.replicated
    }

    fn times(self, k: N) -> Params {
        Params {
            split: self.split * k,
            replicated: self.replicated * k,
        }
    }

    fn plus(self, o: Params) -> Params {
        Params {
            split: self.split + o.split,
            replicated: self.replicated + o.replicated,
        }
    }
}

/// The parameters of one norm of width `c` (a weight, and a bias when `s.bias`).
fn norm(s: &ModelShape) -> N {
    n(s.n_embd) + flag(s.bias) * n(s.n_embd)
}

/// The embedding's parameters (token table split; positions, token types and a norm
/// replicated).
fn embedding(s: &ModelShape) -> Params {
    let c = n(s.n_embd);
    let positions = flag(s.learned_positions) * n(s.positions);
    Params {
        split: n(s.vocab_size) * c,
        replicated: (positions + n(s.type_vocab_size)) * c + flag(s.embedding_norm) * norm(s),
    }
}

/// One block's parameters: the attention and MLP matrices and their column-parallel biases are
/// split; the two norms and the row-parallel output biases are replicated.
fn block(s: &ModelShape) -> Params {
    let (c, f, b, two) = (n(s.n_embd), n(s.ffn), flag(s.bias), N::of(2));
    // The key/value width: one head's width per key/value head.
    let kv = n(s.n_embd / s.n_head.max(1)) * n(s.n_kv_head);
    // Up and down (and a gate); the up projections' biases.
    let (mlp_mats, mlp_up) = if s.gated_mlp {
        (N::of(3), two)
    } else {
        (two, N::of(1))
    };
    Params {
        // q and o (c x c), k and v (c x kv), q/k/v biases, the MLP matrices and up biases.
        split: two * c * c + two * c * kv + b * (c + two * kv) + mlp_mats * c * f + b * mlp_up * f,
        // Two norms, the output projections' biases.
        replicated: two * norm(s) + two * b * c,
    }
}

/// The head's parameters: a final norm, an untied matrix (split with the vocabulary), a head
/// transform (dense layer and norm, replicated) with its logits bias (split).
fn head(s: &ModelShape) -> Params {
    let c = n(s.n_embd);
    let v = n(s.vocab_size);
    Params {
        split: flag(!s.tied) * v * c + flag(s.head_transform) * v,
        replicated: flag(s.final_norm) * norm(s) + flag(s.head_transform) * (c * c + c + norm(s)),
    }
}

/// The parameters of `blocks` blocks with the embedding and the head.
fn with_blocks(s: &ModelShape, blocks: usize) -> Params {
    embedding(s).plus(block(s).times(n(blocks))).plus(head(s))
}

/// The number of parameters of `shape` (`None` when it does not fit in 64 bits).
pub fn num_parameters(shape: &ModelShape) -> Option<u64> {
    with_blocks(shape, shape.n_layer).total().0
}

/// f32 values one token keeps in one block for the backward, `(outside, inside)` the attention
/// and the MLP, and the attention scores one token needs while a block runs (see the module
/// docs).
fn block_activations(s: &ModelShape, seq: usize) -> (N, N, N) {
    let (c, f, h, t) = (n(s.n_embd), n(s.ffn), n(s.n_head), n(seq.min(s.positions)));
    let four = N::of(4);
    // The gated MLP keeps its gate, its up projection and their product.
    let mlp = if s.gated_mlp { N::of(3) } else { N::of(2) } * f;
    (four * c, four * c + mlp, h * t)
}

/// f32 values one token keeps outside the blocks, besides the logits: embedding and final norm,
/// and a head transform.
fn edge_activations(s: &ModelShape) -> N {
    let per = if s.head_transform { 8 } else { 4 };
    N::of(per) * n(s.n_embd)
}

/// The memory a run needs, in bytes (see the module docs for the formula). The per-rank figures
/// are those of the largest rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Ranks.
    pub ranks: usize,
    /// Parameter bytes per rank.
    pub params: u64,
    /// Gradient bytes per rank, with the backward's fresh gradients (0 for inference).
    pub grads: u64,
    /// AdamW state bytes per rank (0 for inference).
    pub optimizer: u64,
    /// Activation bytes per rank.
    pub activations: u64,
    /// Bytes per rank at its peak: the sum of the four above, or, for ZeRO-3, the end of the run
    /// when that is larger (every rank gathers its full parameters).
    pub per_rank: u64,
    /// Bytes of the whole model that rank 0 builds at the end to gather a tensor- or
    /// pipeline-parallel run (0 otherwise).
    pub gather: u64,
    /// The total: `per_rank * ranks + gather`; `u64::MAX` when the sizes overflow.
    pub total: u64,
}

impl MemoryEstimate {
    /// Whether the sizes overflowed 64-bit arithmetic (the figures that did are `u64::MAX`; no
    /// machine can hold the run).
    pub fn overflowed(&self) -> bool {
        self.total == u64::MAX
    }
}

impl fmt::Display for MemoryEstimate {
    /// `about 1.2 GiB (2 ranks x 600.0 MiB: parameters ..., gradients ..., AdamW state ...,
    /// activations ...)`, or `more than 16 EiB (...)` when the sizes overflow.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.overflowed() {
            write!(f, "more than 16 EiB (the sizes overflow 64-bit arithmetic")?;
        } else {
            write!(f, "about {} (", human(self.total))?;
            if self.ranks > 1 {
                write!(f, "{} ranks x {}: ", self.ranks, human(self.per_rank))?;
            }
            write!(f, "parameters {}", human(self.params))?;
            if self.grads > 0 || self.optimizer > 0 {
                write!(
                    f,
                    ", gradients {}, AdamW state {}",
                    human(self.grads),
                    human(self.optimizer)
                )?;
            }
            write!(f, ", activations {}", human(self.activations))?;
            if self.ranks > 1 {
                write!(f, " per rank")?;
            }
            if self.gather > 0 {
                write!(f, "; {} to gather the model at the end", human(self.gather))?;
            }
        }
        write!(f, ")")
    }
}

/// Bytes in binary units with one decimal: `512 B`, `1.5 KiB`, `44.7 TiB`.
pub fn human(bytes: u64) -> String {
    binary_bytes(bytes, 1)
}

/// Bytes in binary units (KiB to EiB) with `decimals` decimals; below 1 KiB, whole bytes.
pub fn binary_bytes(bytes: u64, decimals: usize) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.decimals$} {}", UNITS[unit])
}

/// A training run, as the memory estimate needs it.
#[derive(Clone, Copy, Debug)]
pub struct TrainingRun<'a> {
    /// The model (its `positions` is the sequence length every row has).
    pub model: ModelShape,
    /// The ranks and how they divide the work.
    pub layout: &'a ParallelLayout,
    /// Rows of one optimizer step, over all data-parallel ranks.
    pub batch_size: usize,
    /// Micro-batches each data-parallel rank splits its rows into (at least 1).
    pub microbatches: usize,
    /// The pipeline schedule (with `pp > 1`).
    pub schedule: ScheduleKind,
    /// Sequence parallelism (divides the activations outside attention and MLP by `tp`).
    pub sequence_parallel: bool,
    /// Recompute every block's activations in the backward (keep the block inputs only).
    pub checkpoint_blocks: bool,
    /// Reference mode's row group (rows of one accumulation), `None` outside reference mode.
    pub reference_row_group: Option<usize>,
    /// Parameters' and activations' precision.
    pub precision: Precision,
}

/// The memory `run` needs (see the module docs for the formula).
///
/// ```
/// use meshgrad_nn::LlamaConfig;
/// use meshgrad_parallel::plan::memory::{estimate_training, TrainingRun};
/// use meshgrad_parallel::pipeline::ScheduleKind;
/// let layout = "fsdp=4".parse().unwrap();
/// let run = TrainingRun {
///     model: LlamaConfig::new(32000, 512, 256, 4, 8).shape(),
///     layout: &layout,
///     batch_size: 8,
///     microbatches: 1,
///     schedule: ScheduleKind::OneFOneB,
///     sequence_parallel: false,
///     checkpoint_blocks: false,
///     reference_row_group: None,
///     precision: Default::default(),
/// };
/// let est = estimate_training(&run);
/// // ZeRO-3 over 4 ranks: a quarter of AdamW's state on each of them.
/// let single = Default::default();
/// let one = estimate_training(&TrainingRun { layout: &single, ..run });
/// assert_eq!(est.ranks, 4);
/// assert_eq!(est.optimizer, one.optimizer.div_ceil(4));
/// ```
pub fn estimate_training(run: &TrainingRun) -> MemoryEstimate {
    let shape = &run.model;
    let layout = run.layout;
    let (tp, pp) = (layout.tp(), layout.pp());
    let ranks = layout.world_size();
    let microbatches = run.microbatches.max(1);

    // Parameters of the largest rank.
    let blocks = shape.n_layer.div_ceil(pp.max(1));
    let local = with_blocks(shape, blocks).local(tp);
    let unit = block(shape).local(tp).max(embedding(shape).local(tp));
    let bytes = |x: N| x * N::of(F32);
    // Working copies: f32, or 2-byte copies beside f32 master weights (in the optimizer state).
    let half = N::of(run.precision.bytes());
    let mixed = flag(run.precision != Precision::F32);
    let (mut params, mut grads, mut optimizer) = (
        local * half,
        bytes(local) + local * half,
        bytes(local * (N::of(2) + mixed)),
    );
    let shard = n(layout.dp_shard());
    let sharded = |x: N| x.div_ceil(shard);
    match layout.zero() {
        None => {}
        Some(ZeroStage::One) => optimizer = sharded(optimizer),
        Some(ZeroStage::Two) => {
            grads = sharded(bytes(local)) + unit * half;
            optimizer = sharded(optimizer);
        }
        Some(ZeroStage::Three) => {
            params = sharded(params) + unit * half;
            grads = sharded(bytes(local)) + unit * half;
            optimizer = sharded(optimizer);
        }
    }

    // Reference mode: the row groups' tree keeps up to one pending gradient per level beside
    // the accumulated one (log2 of the rank's row groups, plus one), and each tree-ordered
    // reduction receives every data-parallel rank's contribution (the largest is a ZeRO unit or
    // a DDP bucket, counted as the whole local gradient).
    let dp = layout.data_parallel_degree().max(1);
    if let Some(row_group) = run.reference_row_group {
        let groups = (run.batch_size / row_group.max(1) / dp).max(1);
        let levels = usize::BITS - groups.leading_zeros();
        grads = grads + bytes(local) * n(levels as usize) + bytes(local) * n(dp);
    }

    // Activations of the micro-batches (reference mode: row groups) in flight on the largest
    // rank.
    let rows = match run.reference_row_group {
        Some(row_group) => row_group,
        None => run.batch_size.div_ceil(dp).div_ceil(microbatches),
    };
    let seq = shape.positions;
    let tokens = n(rows) * n(seq);
    let in_flight = in_flight(run.schedule, microbatches, pp);
    let tp_n = n(tp);
    let sp_n = if run.sequence_parallel {
        tp_n
    } else {
        N::of(1)
    };
    let (outside, inside, scores) = block_activations(shape, seq);
    let one_block = outside.div_ceil(sp_n) + inside.div_ceil(tp_n);
    // What every micro-batch in flight keeps, and the temporaries of the one being computed.
    let (kept, temporaries) = if run.checkpoint_blocks {
        (
            n(blocks) * n(shape.n_embd).div_ceil(sp_n),
            N::of(2) * one_block,
        )
    } else {
        (n(blocks) * one_block, one_block)
    };
    let kept = kept + edge_activations(shape).div_ceil(sp_n);
    let temporaries =
        temporaries + scores.div_ceil(tp_n) + (N::of(3) * n(shape.vocab_size)).div_ceil(tp_n);
    let activations = tokens * (n(in_flight) * kept + temporaries) * half;

    let training = params + grads + optimizer + activations;
    let per_rank = if layout.zero() == Some(ZeroStage::Three) {
        // The end of the run: every rank gathers its full (tp-local) parameters.
        training.max(local * half + grads + optimizer)
    } else {
        training
    };
    let gather = if tp > 1 || pp > 1 {
        with_blocks(shape, shape.n_layer).total() * N::of(F32)
    } else {
        N::of(0)
    };
    let total = per_rank * n(ranks) + gather;
    MemoryEstimate {
        ranks,
        params: params.get(),
        grads: grads.get(),
        optimizer: optimizer.get(),
        activations: activations.get(),
        per_rank: per_rank.get(),
        gather: gather.get(),
        total: total.get(),
    }
}

/// Micro-batches whose activations a rank of a `pp`-stage pipeline holds at once (1 without
/// a pipeline; see the module docs).
pub fn in_flight(schedule: ScheduleKind, microbatches: usize, pp: usize) -> usize {
    if pp <= 1 {
        return 1;
    }
    match schedule {
        ScheduleKind::GPipe => microbatches,
        ScheduleKind::Interleaved => microbatches.min(pp.saturating_mul(2)),
        _ => microbatches.min(pp),
    }
}

/// The memory that loading `shape` and running one forward pass without gradients over `rows`
/// sequences of its full context needs (one rank; see the module docs).
pub fn estimate_inference(shape: &ModelShape, rows: u64) -> MemoryEstimate {
    let params = N(num_parameters(shape)) * N::of(F32);
    let tokens = N::of(rows) * n(shape.positions);
    let (outside, inside, scores) = block_activations(shape, shape.positions);
    let per_token = N::of(2) * (outside + inside)
        + scores
        + edge_activations(shape)
        + N::of(2) * n(shape.vocab_size);
    let activations = tokens * per_token * N::of(F32);
    let total = params + activations;
    MemoryEstimate {
        ranks: 1,
        params: params.get(),
        grads: 0,
        optimizer: 0,
        activations: activations.get(),
        per_rank: total.get(),
        gather: 0,
        total: total.get(),
    }
}
