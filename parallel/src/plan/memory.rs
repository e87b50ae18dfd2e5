//! The memory a training or inference run needs, in bytes, from the model's [`ModelShape`] and
//! the layout alone: the formulas `meshgrad train`'s preflight check refuses a run with. A rough
//! formula, in f32 bytes, meant to catch runs that cannot fit (a width of a million, a billion
//! layers) rather than to predict the peak to the megabyte:
//!
//! * **Parameters** `P`: the model's exact count, split in the parts tensor parallelism divides
//!   (the token table, an untied head, the attention and MLP matrices and their column-parallel
//!   biases) and the parts every tensor-parallel rank holds whole (position and token-type
//!   tables, norms, output biases, a head transform). A rank holds `split / tp + replicated` of
//!   `ceil(n_layer / pp)` blocks and the embedding and the head (with `pp > 1`: the first stage
//!   the embedding, the last the head; the figure is the larger of the two stages').
//! * **Model states**: parameters `4 P`; gradients `8 P` (the accumulated gradients, and the
//!   fresh ones autograd hands over in the backward or the checkpoint's buffer at the end);
//!   AdamW's two moments `8 P`. Under mixed precision ([`Precision::Bf16`], [`Precision::Fp8`])
//!   the working parameters are 2-byte copies (`2 P`), the fresh gradients too (gradients `4 P +
//!   2 P`), and the f32 master weights join the optimizer state (`4 P + 8 P`): the same 20 bytes
//!   per parameter in all, split as the run holds them. In an f32 run outside reference mode
//!   the backward adds each fresh gradient to the accumulated one as soon as it is complete, so
//!   beside the activations only `4 P` of gradients exist; the second copy (DDP's buckets, the
//!   checkpoint's buffer) comes after the backward, and the figure is the larger of the two
//!   moments. Sharded over `S` ranks as ZeRO does: ZeRO-1 divides the moments
//!   by `S`; ZeRO-2 also the gradients (`4 P / S`, plus the largest unit's fresh gradient); ZeRO-3
//!   (fsdp) the parameters too (`4 P / S`, plus the largest unit, a block or the root unit,
//!   which holds the embedding, the final norm and an untied head, gathered whole). At the end of a ZeRO-3 run every rank gathers its full parameters again
//!   (for the checkpoint), which the per-rank figure also covers.
//! * **Reference mode** adds to the gradients `(floor(log2 g) + 1) · 4 P` for the pending
//!   subtrees of the rank's `g` row groups and `dp · 4 P` for a tree-ordered reduction receiving
//!   every data-parallel rank's contribution (an upper bound), and its activations are those of
//!   one row group.
//! * **Activations**, per token of a micro-batch (`batch_size / dp` rows split into
//!   `microbatches`, of `positions` tokens), in values of 4 bytes (2 under mixed precision): per block, what the backward keeps:
//!   `4 C` outside the attention and the MLP (the block input, the two norms' outputs, the
//!   residual) and, as meshgrad's graph keeps every op's inputs until the backward
//!   ([`Retention::Graph`]), the two output projections' outputs that the residual adds read
//!   (`2 C`; one with a mixture of experts), all divided by `tp` under sequence parallelism, and `4 C + 2 F` inside them (q/k/v,
//!   the attention output, the MLP's up-projection and activation of width `F`; `3 F` for a
//!   gated MLP; unless the attention reads the fused qkv projection in place (GPT), `4 C` more
//!   for the heads-first copies of q, k, v and of its output, with rotary positions the rotated
//!   ones, plus the key/value width kept before the repetition; divided by `tp`), the fused attention
//!   keeping no `T x T` probabilities; under sequence parallelism also the column-parallel
//!   projections' gathered inputs (`2 C`). Training's dropouts: each residual-stream dropout (two
//!   per block, one after the embedding) keeps its mask and its output (`2 C`, divided by `tp`
//!   under sequence parallelism); attention-probability dropout (BERT's) composes attention from
//!   ops that keep the scores, their softmax, the mask and the dropped probabilities (`4 H T`,
//!   divided by `tp`), and its backward holds their gradients (`3 H T / tp`) once the logits'
//!   temporaries are gone. That for every block of the rank, plus the backward's
//!   temporaries (the gradients of one block's inside values, with a mixture of experts `2 C`
//!   per token copy, one expert's values at a time; no attention scores: the fused
//!   kernels work through them in tiles) (with activation checkpointing: the block inputs `C`
//!   plus one whole block recomputed, and the gradients of half of its inside values); `2 C` for the embedding on its stage (under `tp` also its
//!   vocabulary-parallel partial lookup and its sum over the ranks, `2 C`) and `2 C` for the final norm on the head's (`6 C`
//!   with a head transform; under `tp` also the loss-parallel cross-entropy's `2 V / tp`);
//!   `2 V / tp` for the logits and their gradient (the fused cross-entropy keeps the
//!   log-sum-exp alone) on the stage that computes them, which the backward's temporaries
//!   replace (the larger of the two counts; with recomputation both). Measured on the CPU
//!   against this (`benches/memory_vs_predicted.sh`): 57 runs of the GPT, Llama, BERT and a
//!   Mixtral within 3.2% on average, all but one within 10%. A pipeline's first stage holds
//!   `min(microbatches, pp)` micro-batches in flight (1F1B, zero bubble), `min(microbatches,
//!   2 pp)` (interleaved) or all of them (GPipe), the last stage one under 1F1B: each keeps its
//!   blocks' values (or their inputs), the embedding's and its boundary values (the input it
//!   received and the output it sent, `2 C`, without recomputation), while the backward's temporaries
//!   and the logits exist for one micro-batch at a time. Under zero bubble
//!   every stage holds `min(microbatches, pp)` until their weight backwards, each also with its
//!   projections' output gradients (`3 C + F` split by `tp`, `2 C`).
//! * **Context parallelism** (`cp=C`): a rank holds `positions / C` tokens of each row, so every
//!   per-token figure above counts `1 / C` of the tokens; a model whose attention reads the fused
//!   qkv projection in place keeps the heads-first copies of q, k, v and the attention output
//!   (`4 C`, split by `tp`), as the others always do; ring attention adds, for the micro-batch being computed, the
//!   key and value blocks in flight (the backward's message carries keys, values and their
//!   gradients, received beside the held one: `8` key/value widths per token, a key/value width
//!   being every query head's, `n_embd`, as grouped-query attention's heads are repeated before
//!   the ring) and the partial
//!   output being combined (`C`), split by `tp`. All-gather attention (`--cp-mode allgather`)
//!   instead keeps the keys and values its two query chunks read (`(2C + 1) / 2` local lengths
//!   each, in place of the local ones), holds every rank's keys and values twice while it
//!   gathers them (`4 cp` key/value widths). ZeRO shards over `dp_shard x cp` ranks.
//! * **Mixture of experts** (`n_experts > 0`): a block holds `n_experts` MLPs and a router
//!   (`C x n_experts`); tensor parallelism leaves both whole on every rank (each routes the same
//!   tokens), expert parallelism (`ep=E`) divides the experts by `E`; under ep ZeRO shards the other
//!   parameters over the data-parallel ranks and a rank's experts at the same stage over the
//!   `D / E` ranks holding the same ones (optimizer state under ZeRO-1, + gradients under
//!   ZeRO-2, whose whole expert gradients exist until their reduction after the backward, +
//!   parameters under ZeRO-3, one block's held experts gathered at a time; whole when
//!   `D = E`), and without ep it shards the experts with the rest (then, under ZeRO-2/3, all of a rank's
//!   unsharded gradients exist through the backward, one copy in an f32 run, and after it,
//!   beside their shards, since their reductions wait for its end). Per token a block keeps, instead of one MLP's values, those of
//!   its `k` experts and, per copy, the copy the experts read, the output its expert wrote, the
//!   experts' outputs concatenated, the output gathered back and weighted (`5 C`), the token's
//!   flattened input and summed output (`2 C`) and the router's logits and probabilities (`2
//!   n_experts`), none split by `tp`; under ep also the
//!   dispatch's received rows, their regrouping, the returned outputs in source order and the
//!   return all-to-all's output (`4 C` per copy): the all-to-alls are taken to bring each rank
//!   as many token copies as it sends (balanced routing; an uneven one brings more).
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

use meshgrad_autograd::distributed::CpMode;
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

/// A count of parameters, split into what tensor parallelism divides, what it replicates, and a
/// mixture of experts' experts (whole on every tensor-parallel rank, divided by expert
/// parallelism).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Params {
    split: N,
    replicated: N,
    experts: N,
}

impl Params {
    fn total(self) -> N {
        self.split + self.replicated + self.experts
    }

    /// What one of `tp` tensor-parallel ranks holds besides the experts.
    fn dense(self, tp: usize) -> N {
        self.split.div_ceil(n(tp)) + self.replicated
    }

    fn times(self, k: N) -> Params {
        Params {
            split: self.split * k,
            replicated: self.replicated * k,
            experts: self.experts * k,
        }
    }

    fn plus(self, o: Params) -> Params {
        Params {
            split: self.split + o.split,
            replicated: self.replicated + o.replicated,
            experts: self.experts + o.experts,
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
        experts: N::of(0),
    }
}

/// One block's parameters: the attention and MLP matrices and their column-parallel biases are
/// split; the two norms and the row-parallel output biases are replicated. A mixture of experts
/// holds `n_experts` MLPs (experts) and a router (`C x n_experts`, replicated), none split by
/// tensor parallelism.
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
    // The MLP matrices and up biases (its output bias is counted with the replicated ones).
    let mlp = mlp_mats * c * f + b * mlp_up * f;
    let moe = s.n_experts > 0;
    Params {
        // q and o (c x c), k and v (c x kv), q/k/v biases, a dense MLP.
        split: two * c * c + two * c * kv + b * (c + two * kv) + flag(!moe) * mlp,
        // Two norms, the output projections' biases, a router.
        replicated: two * norm(s) + two * b * c + flag(moe) * c * n(s.n_experts),
        experts: flag(moe) * n(s.n_experts) * mlp,
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
        experts: N::of(0),
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

/// f32 values one token keeps in one block for the backward: outside the attention and the
/// MLP, inside them (split by tensor parallelism) and in a mixture of experts (whole on every
/// tensor-parallel rank; see the module docs).
struct BlockValues {
    outside: N,
    inside: N,
    experts: N,
}

fn block_activations(s: &ModelShape, retention: Retention) -> BlockValues {
    let (c, f) = (n(s.n_embd), n(s.ffn));
    let four = N::of(4);
    // The gated MLP keeps its gate, its up projection and their product.
    let mlp = if s.gated_mlp { N::of(3) } else { N::of(2) } * f;
    // Unless attention reads the fused qkv projection in place: the heads-first copies of q,
    // k and v that it reads and of the output it writes (with rotary positions, q and k are
    // rotated into theirs, and the key/value heads are kept once more before their repetition
    // for the query heads).
    let kv = n(s.n_embd / s.n_head.max(1)) * n(s.n_kv_head);
    let copies = flag(!s.fused_qkv) * four * c + flag(!s.learned_positions) * kv;
    let moe = s.n_experts > 0;
    // A mixture of experts: each of the token's `k` experts keeps its MLP values, and each copy
    // of the token the copy the experts read, the output its expert wrote, the experts'
    // outputs concatenated, the output gathered back to the token and weighted (`5 C`); the
    // token its flattened input and the summed output (`2 C`), the router its logits and
    // probabilities.
    let k = n(s.mlps_per_token());
    let experts = flag(moe) * (k * (mlp + N::of(5) * c) + N::of(2) * c + N::of(2) * n(s.n_experts));
    // meshgrad's graph also keeps the output projections' outputs, which only the residual
    // adds read (a mixture of experts' output is counted with the experts).
    let projections = flag(retention == Retention::Graph) * (c + flag(!moe) * c);
    BlockValues {
        outside: four * c + projections,
        inside: four * c + flag(!moe) * mlp + copies,
        experts,
    }
}

/// f32 values one token keeps per block for training's dropouts (none in inference), outside
/// the attention and the MLP and inside them: each residual-stream dropout (after the attention
/// and after the MLP) its mask and its output (`2 C` each, `4 C`); a composed attention with
/// probability dropout (BERT's) its scores, their softmax, the mask and the dropped
/// probabilities (`4 H T`, split by tensor parallelism with the heads).
fn dropout_values(s: &ModelShape) -> (N, N) {
    let outside = flag(s.dropout) * N::of(4) * n(s.n_embd);
    let inside = flag(s.attention_dropout) * N::of(4) * n(s.n_head) * n(s.positions);
    (outside, inside)
}

/// The width of the MLP's up projections' outputs per token: `F`, or `2 F` with a gate.
fn mlp_width(s: &ModelShape) -> N {
    flag(s.gated_mlp) * n(s.ffn) + n(s.ffn)
}

/// f32 values one token keeps outside the blocks, besides the logits: `2 C` on the stage with
/// the embedding, `2 C` for the final norm (`6 C` with a head transform) on the stage with the
/// head.
fn edge_activations(s: &ModelShape, embedding: bool, head: bool) -> N {
    let head_per = if s.head_transform { 6 } else { 2 };
    (N::of(2) * flag(embedding) + N::of(head_per) * flag(head)) * n(s.n_embd)
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

/// Which activations the training framework keeps for the backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Retention {
    /// meshgrad's autograd: every op's inputs stay with the graph until the backward reaches
    /// the op, so also the output projections' outputs that the residual adds read (`C` for
    /// the attention's and `C` for a dense MLP's per block; a mixture of experts' output is
    /// counted with the experts), which no backward reads.
    #[default]
    Graph,
    /// PyTorch's autograd (Megatron-LM): only what the backward functions save.
    Saved,
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
    /// Ring or all-gather attention under context parallelism.
    pub cp_mode: CpMode,
    /// Recompute every block's activations in the backward (keep the block inputs only).
    pub checkpoint_blocks: bool,
    /// Reference mode's row group (rows of one accumulation), `None` outside reference mode.
    pub reference_row_group: Option<usize>,
    /// Parameters' and activations' precision.
    pub precision: Precision,
    /// Which activations the framework keeps ([`Retention::Graph`]: meshgrad's).
    pub retention: Retention,
}

impl<'a> TrainingRun<'a> {
    /// `batch_size` rows of `model` under `layout`, each data-parallel rank's in one
    /// micro-batch: 1F1B, no sequence parallelism, ring attention under cp, no recomputation,
    /// outside reference mode, f32, meshgrad's [`Retention::Graph`]. Set the rest with struct
    /// update syntax.
    pub fn new(model: ModelShape, layout: &'a ParallelLayout, batch_size: usize) -> Self {
        TrainingRun {
            model,
            layout,
            batch_size,
            microbatches: 1,
            schedule: ScheduleKind::OneFOneB,
            sequence_parallel: false,
            cp_mode: CpMode::Ring,
            checkpoint_blocks: false,
            reference_row_group: None,
            precision: Precision::F32,
            retention: Retention::Graph,
        }
    }
}

/// The memory `run` needs (see the module docs for the formula).
///
/// ```
/// use meshgrad_nn::LlamaConfig;
/// use meshgrad_parallel::plan::memory::{estimate_training, TrainingRun};
/// let layout = "fsdp=4".parse().unwrap();
/// let run = TrainingRun::new(LlamaConfig::new(32000, 512, 256, 4, 8).shape(), &layout, 8);
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
    let blocks = shape.n_layer.div_ceil(pp.max(1));
    // The largest rank: without a pipeline the one stage holds everything; with one, the first
    // stage (the embedding, the most micro-batches in flight) or the last (the head and the
    // logits).
    let stages = if pp > 1 {
        let (first, last) = held_by_end_stages(run.schedule, run.microbatches.max(1), pp);
        vec![
            Stage {
                params: embedding(shape).plus(block(shape).times(n(blocks))),
                in_flight: first.held,
                pending_weight: first.pending_weight,
                embedding: true,
                logits: false,
            },
            Stage {
                params: block(shape).times(n(blocks)).plus(head(shape)),
                in_flight: last.held,
                pending_weight: last.pending_weight,
                embedding: false,
                logits: true,
            },
        ]
    } else {
        vec![Stage {
            params: with_blocks(shape, blocks),
            in_flight: 1,
            pending_weight: 0,
            embedding: true,
            logits: true,
        }]
    };
    let largest = stages
        .iter()
        .map(|stage| stage_memory(run, stage, blocks))
        .max_by_key(|m| m.per_rank.get())
        .expect("at least one stage");
    let gather = if tp > 1 || pp > 1 {
        with_blocks(shape, shape.n_layer).total() * N::of(F32)
    } else {
        N::of(0)
    };
    let total = largest.per_rank * n(ranks) + gather;
    MemoryEstimate {
        ranks,
        params: largest.params.get(),
        grads: largest.grads.get(),
        optimizer: largest.optimizer.get(),
        activations: largest.activations.get(),
        per_rank: largest.per_rank.get(),
        gather: gather.get(),
        total: total.get(),
    }
}

/// A pipeline stage as the estimate sees it: its parameters (before tensor parallelism), the
/// micro-batches whose activations it holds at once, how many of them at most also hold their
/// output gradients for a weight backward still to come, and whether it holds the embedding and
/// computes the logits.
struct Stage {
    params: Params,
    in_flight: usize,
    pending_weight: usize,
    embedding: bool,
    logits: bool,
}

/// One rank's figures (see [`MemoryEstimate`]).
struct RankMemory {
    params: N,
    grads: N,
    optimizer: N,
    activations: N,
    per_rank: N,
}

/// The memory of a rank of `stage` (`blocks` blocks) in `run` (see the module docs).
fn stage_memory(run: &TrainingRun, stage: &Stage, blocks: usize) -> RankMemory {
    let shape = &run.model;
    let layout = run.layout;
    let tp = layout.tp();
    let microbatches = run.microbatches.max(1);
    // Under ep, the layout's ZeRO shards what is not an expert over the data-parallel ranks,
    // and the experts (split `ep` ways) at the same stage over the `D / ep` ranks holding the
    // same ones (`ExpertDataParallel`; whole when there is one). Without ep, ZeRO shards the
    // experts with the rest.
    let ep = layout.ep() > 1;
    let experts = flag(ep) * stage.params.experts.div_ceil(n(layout.ep()));
    let dense = stage.params.dense(tp) + flag(!ep) * stage.params.experts;
    let local = dense + experts;
    // The largest unit: a block, or the root unit (what the stage holds besides its blocks:
    // the embedding, the head's norm and untied matrix); a block's experts in it without ep.
    let root = flag(stage.embedding) * embedding(shape).dense(tp)
        + flag(stage.logits) * head(shape).dense(tp);
    let unit = (block(shape).dense(tp) + flag(!ep) * block(shape).experts).max(root);
    // A mixture of experts under ZeRO-2/3 without ep reduces its gradients after the backward
    // (an expert may get no tokens on some rank: `ShardConfig::sometimes_unused`), so all of
    // the rank's unsharded gradients exist at once.
    let unused = !ep && shape.n_experts > 0;
    let bytes = |x: N| x * N::of(F32);
    // Working copies: f32, or 2-byte copies beside f32 master weights (in the optimizer state).
    let half = N::of(run.precision.bytes());
    let mixed = flag(run.precision != Precision::F32);
    let grads_of = |x: N| bytes(x) + x * half;
    // Whole gradients that a reduction waits for: the backward adds each fresh one to the
    // accumulated one at once in an f32 run outside reference mode (one copy).
    let one_copy = run.precision == Precision::F32 && run.reference_row_group.is_none();
    let whole_of = |x: N| if one_copy { bytes(x) } else { grads_of(x) };
    let optimizer_of = |x: N| bytes(x * (N::of(2) + mixed));
    let (mut params, mut grads, mut optimizer) =
        (local * half, grads_of(local), optimizer_of(local));
    let shard = n(layout.shard_degree());
    let sharded = |x: N| x.div_ceil(shard);
    // The experts' replicas (`D / ep`), over which ZeRO shards them; ZeRO-3 gathers one block's
    // held experts at a time (none with a single replica: nothing to shard, nothing gathered).
    let replicas = (layout.data_parallel_degree() / layout.ep().max(1)).max(1);
    let e_sharded = |x: N| x.div_ceil(n(replicas));
    let e_unit = flag(ep && replicas > 1) * block(shape).experts.div_ceil(n(layout.ep()));
    match layout.zero() {
        None => {}
        Some(ZeroStage::One) => {
            optimizer = sharded(optimizer_of(dense)) + e_sharded(optimizer_of(experts))
        }
        Some(ZeroStage::Two) => {
            // The experts' whole gradients exist until their reduction after the backward (an
            // expert may get no tokens on a rank), then their shard.
            grads =
                sharded(bytes(dense)) + unit * half + whole_of(experts) + e_sharded(bytes(experts));
            optimizer = sharded(optimizer_of(dense)) + e_sharded(optimizer_of(experts));
        }
        Some(ZeroStage::Three) => {
            params =
                sharded(dense * half) + unit * half + e_sharded(experts * half) + e_unit * half;
            grads =
                sharded(bytes(dense)) + unit * half + whole_of(experts) + e_sharded(bytes(experts));
            optimizer = sharded(optimizer_of(dense)) + e_sharded(optimizer_of(experts));
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

    // Activations of the micro-batches (reference mode: row groups) in flight.
    let rows = match run.reference_row_group {
        Some(row_group) => row_group,
        None => run.batch_size.div_ceil(dp).div_ceil(microbatches),
    };
    // Context parallelism: each rank holds `1 / cp` of every row's tokens.
    let cp = layout.cp().max(1);
    let seq = shape.positions;
    let tokens = n(rows) * n(seq.div_ceil(cp));
    let tp_n = n(tp);
    let sp_n = if run.sequence_parallel {
        tp_n
    } else {
        N::of(1)
    };
    let BlockValues {
        outside,
        inside,
        experts,
    } = block_activations(shape, run.retention);
    let (dropped_outside, dropped_inside) = dropout_values(shape);
    let outside = outside + dropped_outside;
    // All-gather attention keeps, for the backward, the keys and values its two query chunks
    // read (`(2C + 1) / 2` local lengths of each) instead of the local ones. Context
    // parallelism carries the keys and values of every query head (grouped-query attention's
    // are repeated before the ring or the all-gather): `C` wide each.
    let kv = n(shape.n_embd);
    let gathered = flag(cp > 1 && run.cp_mode == CpMode::AllGather);
    // Under context parallelism a model whose attention otherwise reads the fused qkv
    // projection in place keeps the heads-first copies of q, k and v that the ring or the
    // all-gather reads, and of the output it writes (`4 C`), as the others always do.
    let heads_first = flag(cp > 1 && shape.fused_qkv) * N::of(4) * n(shape.n_embd);
    // Expert parallelism's dispatch keeps, per token copy, the rows the first all-to-all
    // received, their regrouping by expert, the outputs put back in source order and what the
    // second all-to-all returned (`4 C`), with routing taken as balanced.
    let dispatch = flag(shape.n_experts > 0 && layout.ep() > 1)
        * n(shape.mlps_per_token())
        * N::of(4)
        * n(shape.n_embd);
    let experts = experts + dispatch;
    let one_block = outside.div_ceil(sp_n)
        + (inside + dropped_inside).div_ceil(tp_n)
        + (gathered * n(2 * cp - 1) * kv + heads_first).div_ceil(tp_n)
        + experts
        + tp_plumbing(shape, tp, run.sequence_parallel);
    // What every micro-batch in flight keeps, and the temporaries of the one being computed:
    // the gradients of one block's attention and MLP values and of tensor parallelism's
    // communication (the residual-width gradients replace one another); with recomputation
    // the recomputed block, kept whole until its backward ends, beside the gradients of half
    // of its inside values (the MLP's, then the attention's: measured, a GPT of 2 to 8 blocks
    // peaks 1-4% above this). A mixture of experts runs its experts' backwards one at a time:
    // the gradients of each copy's gathered-back output and of the experts' concatenated
    // outputs (`2 C` per copy) are what it adds. A composed attention's backward (BERT's
    // probability dropout) holds the gradients of the dropped probabilities, the probabilities
    // and the scores (`3 H T`, split by `tp`).
    let expert_grads =
        flag(shape.n_experts > 0) * n(shape.mlps_per_token()) * N::of(2) * n(shape.n_embd);
    let score_grads = flag(shape.attention_dropout)
        * (N::of(3) * n(shape.n_head) * n(shape.positions)).div_ceil(tp_n);
    let backward = inside.div_ceil(tp_n)
        + expert_grads
        + score_grads
        + tp_plumbing(shape, tp, run.sequence_parallel);
    let (kept, temporaries) = if run.checkpoint_blocks {
        (
            n(blocks) * n(shape.n_embd).div_ceil(sp_n),
            one_block + backward.div_ceil(N::of(2)),
        )
    } else {
        (n(blocks) * one_block, backward)
    };
    // A pipeline stage also keeps each micro-batch's boundary values: the input it received and
    // the copy of the output it sent (`C` each). With recomputation the received input is the
    // first block's input, already counted, and the sent copy is not told apart.
    let boundary = flag(layout.pp() > 1 && !run.checkpoint_blocks) * N::of(2) * n(shape.n_embd);
    // The embedding's dropout keeps its mask and its output (`2 C`).
    let embedding_dropout = flag(stage.embedding && shape.dropout) * N::of(2) * n(shape.n_embd);
    let kept = kept
        + (edge_activations(shape, stage.embedding, stage.logits) + embedding_dropout)
            .div_ceil(sp_n)
        + tp_edge(shape, tp, stage)
        + boundary;
    // The logits and their gradient (the fused cross-entropy keeps the log-sum-exp alone).
    let logits = flag(stage.logits) * (N::of(2) * n(shape.vocab_size)).div_ceil(tp_n);
    // Ring attention: the key and value blocks in flight (forward: the held pair and the
    // received one; backward: both with their gradients, `8` key/value widths) and the partial
    // output being combined (`C`), split by tensor parallelism. All-gather attention: every
    // rank's keys and values as gathered and in sequence order (`4 C` local widths; in the
    // backward their gradients before the reduce-scatter).
    let ring = match run.cp_mode {
        CpMode::Ring => flag(cp > 1) * (N::of(8) * kv + n(shape.n_embd)),
        CpMode::AllGather => gathered * N::of(4) * n(cp) * kv,
    }
    .div_ceil(tp_n);
    // The logits and their gradient are gone when the blocks' backward begins: the larger of
    // the two; with recomputation both count (measured).
    let temporaries = if run.checkpoint_blocks {
        temporaries + logits
    } else {
        temporaries.max(logits)
    } + ring;
    // A micro-batch whose weight backward is still to come also holds the gradients of its
    // projections' outputs (q/k/v and the MLP's up projections split by tensor parallelism, the
    // two output projections' `C` each as the residual stream is split).
    let output_grads = n(blocks)
        * (if shape.n_experts > 0 {
            (N::of(3) * n(shape.n_embd)).div_ceil(tp_n)
                + n(shape.mlps_per_token()) * mlp_width(shape)
        } else {
            (N::of(3) * n(shape.n_embd) + mlp_width(shape)).div_ceil(tp_n)
        } + (N::of(2) * n(shape.n_embd)).div_ceil(sp_n));
    let activations = tokens
        * (n(stage.in_flight) * kept + n(stage.pending_weight) * output_grads + temporaries)
        * half;

    // Two moments can be the peak: the backward, while the activations are still held, and
    // after it, when every gradient copy exists. In an f32 run outside reference mode, the
    // backward adds each parameter's fresh gradient to the accumulated one as soon as it is
    // complete (the first micro-batch's becomes it): one copy (4 P) exists beside the
    // activations; the second copy (DDP's buckets, a checkpoint's buffer) comes once the
    // activations are freed. A mixture of experts under ZeRO-2/3 without ep keeps all of the
    // rank's unsharded gradients through the backward (their reduction waits for its end): one
    // copy in such a run, as without ZeRO; after the backward, beside their shards.
    let stage_23 = matches!(layout.zero(), Some(ZeroStage::Two | ZeroStage::Three));
    let grads = if unused && stage_23 {
        grads.max(grads_of(local))
    } else {
        grads
    };
    let grads_in_backward = if one_copy && (!stage_23 || unused) {
        bytes(local)
    } else {
        grads
    };
    let training =
        (params + grads_in_backward + optimizer + activations).max(params + grads + optimizer);
    let per_rank = if layout.zero() == Some(ZeroStage::Three) {
        // The end of the run: every rank gathers its full (tp-local) parameters.
        training.max(local * half + grads + optimizer)
    } else {
        training
    };
    RankMemory {
        params,
        grads,
        optimizer,
        activations,
        per_rank,
    }
}

/// Values per token and block that tensor parallelism's communication keeps beyond one
/// device's (`tp` of 1: none): under sequence parallelism each column-parallel projection's
/// input gathered along the sequence (two per block, `C` each; its backward reads it). The
/// row-parallel projections' partial products and sums are freed as soon as they are used.
fn tp_plumbing(shape: &ModelShape, tp: usize, sequence_parallel: bool) -> N {
    if tp <= 1 || !sequence_parallel {
        return N::of(0);
    }
    N::of(2) * n(shape.n_embd)
}

/// Values per token outside the blocks that tensor parallelism keeps beyond one device's: on
/// the stage with the embedding its vocabulary-parallel partial lookup and the lookup summed
/// over the ranks (`2 C`; both stay with the graph until the backward), on the stage with the
/// head the loss-parallel cross-entropy's per-rank logits statistics and gradient (`2 V / tp`).
fn tp_edge(shape: &ModelShape, tp: usize, stage: &Stage) -> N {
    if tp <= 1 {
        return N::of(0);
    }
    flag(stage.embedding) * N::of(2) * n(shape.n_embd)
        + flag(stage.logits) * (N::of(2) * n(shape.vocab_size)).div_ceil(n(tp))
}

/// Micro-batches whose activations the first and the last stage of a `pp`-stage pipeline
/// hold at once: [`in_flight`] for the first; for the last one under 1F1B one, under GPipe and
/// the interleaved schedule the same as the first. Under zero bubble every stage holds
/// `min(microbatches, pp)` until their weight backwards (what the schedule simulator counts as
/// `peak_held` for the generated schedule; a test checks it), each with its projections' output
/// gradients, since the input backward leaves them for the weight backward.
fn held_by_end_stages(schedule: ScheduleKind, microbatches: usize, pp: usize) -> (Held, Held) {
    let first = in_flight(schedule, microbatches, pp);
    let plain = |held| Held {
        held,
        pending_weight: 0,
    };
    match schedule {
        ScheduleKind::OneFOneB => (plain(first), plain(1)),
        ScheduleKind::ZeroBubble => {
            let held = Held {
                held: microbatches.min(pp),
                pending_weight: microbatches.min(pp),
            };
            (held, held)
        }
        _ => (plain(first), plain(first)),
    }
}

/// What a pipeline stage holds at once (see [`held_by_end_stages`]).
#[derive(Clone, Copy)]
struct Held {
    held: usize,
    pending_weight: usize,
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
    let b = block_activations(shape, Retention::Graph);
    let per_token = N::of(2) * (b.outside + b.inside + b.experts)
        + edge_activations(shape, true, true)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{simulate, Costs, Schedule};

    #[test]
    fn activations_grow_with_the_context_not_its_square() {
        // The fused attention works through the scores in tiles (measured here: a 2-layer GPT
        // of width 64, batch 2, peaks at 8.6, 15.5, 29.4 and 57.1 MiB for 256 to 2048 tokens):
        // a token's values do not depend on the context length.
        let run = |positions: usize| {
            let mut model = meshgrad_nn::GptConfig {
                vocab_size: 256,
                block_size: positions,
                n_layer: 2,
                n_head: 4,
                n_embd: 64,
                dropout: 0.0,
                bias: true,
                layer_norm_eps: 1e-5,
            }
            .shape();
            model.positions = positions;
            let layout = ParallelLayout::default();
            estimate_training(&TrainingRun::new(model, &layout, 2)).activations
        };
        assert_eq!(run(2048), 2 * run(1024));
        assert_eq!(run(1024), 4 * run(256));
    }

    #[test]
    fn zero_shards_the_experts_with_the_rest_or_over_their_replicas_under_expert_parallelism() {
        let mut model = meshgrad_nn::LlamaConfig::new(1024, 128, 128, 4, 4).shape();
        (model.n_experts, model.experts_per_token) = (8, 2);
        let total = num_parameters(&model).unwrap();
        // One expert: gate, up and down projections of `C x F` each.
        let experts = 4 * 8 * 3 * 128 * model.ffn as u64;
        let estimate = |spec: &str| {
            let layout = spec.parse().unwrap();
            estimate_training(&TrainingRun {
                precision: Precision::F32,
                ..TrainingRun::new(model, &layout, 8)
            })
        };
        let optimizer = |spec: &str| estimate(spec).optimizer;
        // AdamW's two f32 moments: 8 bytes a parameter. Without ep, fsdp=4 shards all of them
        // four ways; with ep=2 each rank holds half of the experts and shards their moments over
        // the 2 ranks holding the same ones (the rest four ways); with fsdp=2,ep=2 no other rank
        // holds the same experts: their moments stay whole.
        assert_eq!(optimizer("fsdp=4"), (8 * total).div_ceil(4));
        let dense = total - experts;
        for spec in ["fsdp=4,ep=2", "zero1=4,ep=2", "zero2=4,ep=2"] {
            assert_eq!(
                optimizer(spec),
                (8 * dense).div_ceil(4) + 8 * experts / 2 / 2,
                "{spec}"
            );
        }
        assert_eq!(optimizer("dp=4,ep=2"), 8 * dense + 8 * experts / 2);
        assert_eq!(
            optimizer("fsdp=2,ep=2"),
            (8 * dense).div_ceil(2) + 8 * experts / 2
        );
        assert_eq!(
            optimizer("hsdp=2x2,ep=2"),
            (8 * dense).div_ceil(2) + 8 * experts / 2 / 2
        );
        // ZeRO-3's parameters: a quarter of the dense ones and its largest unit (here the root:
        // the 1024 x 128 embedding, the untied head and the final norm), a half of the held
        // experts (a quarter of them all) and one block's held ones.
        let params = |spec: &str| estimate(spec).params;
        let block_experts = experts / 4 / 2;
        let z3 = params("fsdp=4,ep=2");
        let z1 = params("zero1=4,ep=2");
        assert_eq!(z1, 4 * dense + 4 * experts / 2);
        assert!(z3 < z1);
        let unit = z3 - (4 * dense).div_ceil(4) - 4 * experts / 4 - 4 * block_experts;
        assert_eq!(unit, 4 * (2 * 1024 * 128 + 128));
    }

    #[test]
    fn zero_bubble_holds_what_the_simulator_counts() {
        for pp in [2, 3, 4, 8] {
            for m in [1, 2, pp, 2 * pp, 3 * pp + 1] {
                let schedule = Schedule::generate(ScheduleKind::ZeroBubble, pp, m, None).unwrap();
                let report = simulate(&schedule, &Costs::uniform(1.0, 1.0, 1.0, 0.0)).unwrap();
                let (first, last) = held_by_end_stages(ScheduleKind::ZeroBubble, m, pp);
                assert_eq!(first.held, report.peak_held[0], "pp={pp} m={m}");
                assert_eq!(last.held, report.peak_held[pp - 1], "pp={pp} m={m}");
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_what_the_simulator_counts() {
        for pp in [2, 3, 4] {
            for m in [1, pp, 2 * pp] {
                let schedule = Schedule::generate(ScheduleKind::OneFOneB, pp, m, None).unwrap();
                let report = simulate(&schedule, &Costs::uniform(1.0, 1.0, 1.0, 0.0)).unwrap();
                let (first, last) = held_by_end_stages(ScheduleKind::OneFOneB, m, pp);
                assert_eq!(first.held, report.peak_activations[0], "pp={pp} m={m}");
                assert_eq!(last.held, report.peak_activations[pp - 1], "pp={pp} m={m}");
            }
        }
    }
}
