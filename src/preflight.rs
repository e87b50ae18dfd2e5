//! Checks before work: `meshgrad train` makes sure that its output can be written and that the
//! run fits in memory before it reads data or builds a model; `eval` and `generate` check a
//! checkpoint's sizes against memory before they build its model. Each failure is one line.
//!
//! **Output.** [`check_output`] creates the `out` directory (and the metrics file's directory),
//! writes a probe file there and removes it; an existing metrics file must be a writable file.
//!
//! **Memory.** [`estimate_training`] gives the bytes a run needs, per rank and in all, from the
//! config and the layout alone, and [`check_memory`] compares the total over the ranks of this
//! process (they are threads of one process) with the memory the machine has available
//! ([`available_memory`]: `MemAvailable` in `/proc/meminfo`, lowered to a cgroup v2 limit when
//! there is one; the comparison is skipped where neither can be read, e.g. off Linux). The
//! estimate is a rough formula, in f32 bytes, meant to catch runs that cannot fit (a width of a
//! million, a billion layers) rather than to predict the peak to the megabyte:
//!
//! * **Parameters** `P`: the model's exact count, split in the parts tensor parallelism divides
//!   (the token table, the attention and MLP matrices and their column-parallel biases) and the
//!   parts every tensor-parallel rank holds whole (position table, layer norms, output biases).
//!   A rank holds `split / tp + replicated` of the embedding, the head and `ceil(n_layer / pp)`
//!   blocks (with `pp > 1` the embedding and the head are counted on the same rank: an upper
//!   bound for the first and the last stage).
//! * **Model states**: parameters `4 P`; gradients `8 P` (the accumulated gradients, and the
//!   fresh ones autograd hands over in the backward or the checkpoint's buffer at the end); AdamW's
//!   two moments `8 P`. Sharded over `S` ranks as ZeRO does: ZeRO-1 divides the moments by `S`;
//!   ZeRO-2 also the gradients (`4 P / S`, plus the largest unit's fresh gradient); ZeRO-3
//!   (fsdp) the parameters too (`4 P / S`, plus the largest unit, a block or the embedding,
//!   gathered whole). At the end of a ZeRO-3 run every rank gathers its full parameters again
//!   (for the checkpoint), which the per-rank figure also covers.
//! * **Reference mode** adds to the gradients `(floor(log2 g) + 1) · 4 P` for the pending
//!   subtrees of the rank's `g` row groups and `dp · 4 P` for a tree-ordered reduction receiving
//!   every data-parallel rank's contribution (an upper bound), and its activations are those of
//!   one row group (`train.row_group` rows).
//! * **Activations**, per token of a micro-batch (`batch_size / dp` rows split into
//!   `microbatches`, of `block_size` tokens), in f32 values: per block, what the backward keeps:
//!   `4 C` outside the attention and the MLP (the block input, the two norms' outputs, the
//!   residual; divided by `tp` under sequence parallelism) and `4 C + 2 F` inside them (q/k/v,
//!   the attention output, the MLP's up-projection and activation of width `F`; divided by
//!   `tp`), the fused attention keeping no `T x T` probabilities; that for every block of the
//!   rank plus one more for the backward's temporaries, and the `H T` attention scores of one
//!   block being computed (with activation checkpointing: the block inputs `C` plus two whole
//!   blocks); `4 C` for the embedding and the final norm (`8 C` with BERT's prediction head);
//!   `3 V / tp` for the logits, their softmax and their gradient. A pipeline rank holds
//!   `min(microbatches, pp)` micro-batches in flight (1F1B, zero bubble), `min(microbatches,
//!   2 pp)` (interleaved) or all of them (GPipe).
//! * **Gathering**: with `tp` or `pp` above 1, rank 0 builds the whole model once more at the end
//!   (`4 P`) to write the checkpoint.
//!
//! The total is the largest rank's figure times the number of ranks, plus the gathering. The
//! arithmetic is checked (`checked_mul`, `checked_add`), and an overflow stays one through every
//! later step, divisions included: sizes whose products do not fit in 64 bits are refused as
//! needing more than 16 EiB, whatever the machine, instead of reaching an allocation ("capacity
//! overflow"). `MESHGRAD_NO_MEMORY_CHECK=1` skips the comparison with the machine (for a run the
//! estimate wrongly refuses), not the overflow check.
//!
//! For `eval` and `generate`, [`check_checkpoint`] reads a final model's `config.json` (and
//! [`check_model_memory`] takes a training checkpoint's config) and estimates its parameters
//! (`4 P`) and the activations of one forward pass without gradients (two blocks of
//! temporaries, the logits) over [`INFERENCE_ROWS`] windows.

use std::fmt;
use std::ops::{Add, Mul};
use std::path::Path;

use anyhow::{Context, Result};
use meshgrad_nn::bert::BertConfig;
use meshgrad_nn::state::{hf_bert, hf_gpt2, hf_llama};
use meshgrad_nn::{GptConfig, LlamaConfig};
use meshgrad_parallel::pipeline::ScheduleKind;
use meshgrad_parallel::{ParallelLayout, ZeroStage};

use crate::config::TrainConfig;
use crate::run_setup::{ActivationCheckpointing, TrainOptions};

/// The environment variable that, set to anything but `0` or nothing, skips the comparison of
/// the memory estimate with the machine's available memory.
pub const SKIP_MEMORY_CHECK: &str = "MESHGRAD_NO_MEMORY_CHECK";

/// Rows of one forward pass that [`check_checkpoint`] assumes (`eval` evaluates 8 windows at a
/// time; `generate` runs one sequence).
pub const INFERENCE_ROWS: u64 = 8;

/// Bytes of one value (f32, the dtype every run and checkpoint load uses).
const F32: u64 = 4;

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

/// The model kind, for the parts only one of them has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// A GPT decoder with a tied head.
    Gpt,
    /// A BERT encoder with the masked-LM head.
    Bert,
    /// A Llama decoder: RMSNorm without biases, grouped-query attention, a gated (SwiGLU) MLP,
    /// no position table, its head tied or not.
    Llama,
}

/// A model's sizes, as the memory estimate needs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// GPT or BERT.
    pub kind: ModelKind,
    /// Token ids (BERT: with its special tokens).
    pub vocab_size: usize,
    /// Positions (the context length).
    pub positions: usize,
    /// Blocks (layers).
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Width of the MLP's hidden layer.
    pub ffn: usize,
    /// Whether linears and norms have biases.
    pub bias: bool,
    /// Token types (BERT; 0 for GPT).
    pub type_vocab_size: usize,
    /// Key/value heads per block (`n_head` but for a grouped-query Llama).
    pub n_kv_head: usize,
    /// Whether the head is the token table (always for GPT and BERT).
    pub tied: bool,
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

impl ModelShape {
    /// The model a training config builds (BERT's vocabulary has its five special tokens; both
    /// are padded to a multiple of `model.vocab_multiple`).
    pub fn from_train_config(cfg: &TrainConfig) -> ModelShape {
        let m = &cfg.model;
        if m.kind == crate::config::ModelKind::Llama {
            return ModelShape::from_llama(&crate::model_configs::llama_config(cfg));
        }
        let bert = m.kind == crate::config::ModelKind::Bert;
        ModelShape {
            kind: if bert {
                ModelKind::Bert
            } else {
                ModelKind::Gpt
            },
            vocab_size: m.padded_vocab(if bert {
                m.vocab_size.saturating_add(5)
            } else {
                m.vocab_size
            }),
            positions: m.block_size,
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_embd: m.n_embd,
            ffn: m.n_embd.saturating_mul(4),
            bias: m.bias || bert,
            type_vocab_size: if bert { 2 } else { 0 },
            n_kv_head: m.n_head,
            tied: true,
        }
    }

    /// The shape of a GPT config.
    pub fn from_gpt(c: &GptConfig) -> ModelShape {
        ModelShape {
            kind: ModelKind::Gpt,
            vocab_size: c.vocab_size,
            positions: c.block_size,
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_embd: c.n_embd,
            ffn: c.n_embd.saturating_mul(4),
            bias: c.bias,
            type_vocab_size: 0,
            n_kv_head: c.n_head,
            tied: true,
        }
    }

    /// The shape of a BERT config.
    pub fn from_bert(c: &BertConfig) -> ModelShape {
        ModelShape {
            kind: ModelKind::Bert,
            vocab_size: c.vocab_size,
            positions: c.max_position_embeddings,
            n_layer: c.num_hidden_layers,
            n_head: c.num_attention_heads,
            n_embd: c.hidden_size,
            ffn: c.intermediate_size,
            bias: true,
            type_vocab_size: c.type_vocab_size,
            n_kv_head: c.num_attention_heads,
            tied: true,
        }
    }

    /// The shape of a Llama config.
    pub fn from_llama(c: &LlamaConfig) -> ModelShape {
        ModelShape {
            kind: ModelKind::Llama,
            vocab_size: c.vocab_size,
            positions: c.n_positions,
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_embd: c.n_embd,
            ffn: c.intermediate_size,
            bias: false,
            type_vocab_size: 0,
            n_kv_head: c.n_kv_head,
            tied: c.tie_embeddings,
        }
    }

    /// The embedding's parameters (token table split; positions, token types and BERT's norm
    /// replicated).
    fn embedding(&self) -> Params {
        let c = n(self.n_embd);
        let (norm, positions) = match self.kind {
            ModelKind::Gpt => (N::of(0), n(self.positions)),
            ModelKind::Bert => (c * N::of(2), n(self.positions)),
            ModelKind::Llama => (N::of(0), N::of(0)),
        };
        Params {
            split: n(self.vocab_size) * c,
            replicated: (positions + n(self.type_vocab_size)) * c + norm,
        }
    }

    /// One block's parameters: the attention and MLP matrices and their column-parallel biases
    /// are split; the norms and the row-parallel output biases are replicated.
    fn block(&self) -> Params {
        let (c, f) = (n(self.n_embd), n(self.ffn));
        if self.kind == ModelKind::Llama {
            // q and o (c x c), k and v (c x kv width), gate, up and down (c x f); two RMSNorm
            // weights. No biases.
            let kv = n(self.n_embd / self.n_head.max(1)) * n(self.n_kv_head);
            return Params {
                split: N::of(2) * c * c + N::of(2) * c * kv + N::of(3) * c * f,
                replicated: N::of(2) * c,
            };
        }
        let b = N::of(u64::from(self.bias));
        let two = N::of(2);
        let three = N::of(3);
        Params {
            // q, k, v (weights and biases), the attention output projection, the MLP's up and
            // down projections, the up-projection's bias.
            split: three * c * c + three * b * c + c * c + two * c * f + b * f,
            // Two norms (weight and bias), the output projections' biases.
            replicated: two * (c + b * c) + two * b * c,
        }
    }

    /// The head's parameters: GPT's final norm (its head is the token table); BERT's transform
    /// (dense and norm, replicated) and its decoder bias (split with the vocabulary).
    fn head(&self) -> Params {
        let c = n(self.n_embd);
        match self.kind {
            ModelKind::Gpt => Params {
                split: N::of(0),
                replicated: c + N::of(u64::from(self.bias)) * c,
            },
            ModelKind::Bert => Params {
                split: n(self.vocab_size),
                replicated: c * c + N::of(3) * c,
            },
            // The final RMSNorm, and an untied head.
            ModelKind::Llama => Params {
                split: if self.tied {
                    N::of(0)
                } else {
                    n(self.vocab_size) * c
                },
                replicated: c,
            },
        }
    }

    /// The parameters of `blocks` blocks with the embedding and the head.
    fn with_blocks(&self, blocks: usize) -> Params {
        self.embedding()
            .plus(self.block().times(n(blocks)))
            .plus(self.head())
    }

    /// The number of parameters (`None` when it does not fit in 64 bits).
    pub fn num_parameters(&self) -> Option<u64> {
        self.with_blocks(self.n_layer).total().0
    }

    /// f32 values one token keeps in one block for the backward, `(outside, inside)` the
    /// attention and the MLP, and the attention scores one token needs while a block runs (see
    /// the module docs).
    fn block_activations(&self, seq: usize) -> (N, N, N) {
        let (c, f, h, t) = (
            n(self.n_embd),
            n(self.ffn),
            n(self.n_head),
            n(seq.min(self.positions)),
        );
        let four = N::of(4);
        // The gated MLP keeps its gate, its up projection and their product.
        let mlp = match self.kind {
            ModelKind::Llama => N::of(3) * f,
            _ => N::of(2) * f,
        };
        (four * c, four * c + mlp, h * t)
    }

    /// f32 values one token keeps outside the blocks, besides the logits: embedding and final
    /// norm, and BERT's prediction-head transform.
    fn edge_activations(&self) -> N {
        let c = n(self.n_embd);
        match self.kind {
            ModelKind::Gpt | ModelKind::Llama => N::of(4) * c,
            ModelKind::Bert => N::of(8) * c,
        }
    }
}

/// The memory a run needs, in bytes (see the module docs for the formula). The per-rank figures
/// are those of the largest rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Ranks (threads of this process).
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
    format!("{v:.1} {}", UNITS[unit])
}

/// The memory a training run of `cfg` (resolved: its vocabulary is the tokenizer's) needs on
/// `layout` (one device when `None`) with `opts` (micro-batches, sequence parallelism, pipeline
/// schedule, activation checkpointing). See the module docs for the formula.
pub fn estimate_training(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
) -> MemoryEstimate {
    let shape = ModelShape::from_train_config(cfg);
    let one = ParallelLayout::default();
    let layout = layout.unwrap_or(&one);
    let (tp, pp) = (layout.tp(), layout.pp());
    let ranks = layout.world_size();
    let microbatches = opts.microbatches.max(1);

    // Parameters of the largest rank.
    let blocks = shape.n_layer.div_ceil(pp.max(1));
    let stage = shape.with_blocks(blocks);
    let local = stage.local(tp);
    let unit = shape.block().local(tp).max(shape.embedding().local(tp));
    let bytes = |x: N| x * N::of(F32);
    let (mut params, mut grads, mut optimizer) = (
        bytes(local),
        bytes(local * N::of(2)),
        bytes(local * N::of(2)),
    );
    let shard = n(layout.dp_shard());
    let sharded = |x: N| x.div_ceil(shard);
    match layout.zero() {
        None => {}
        Some(ZeroStage::One) => optimizer = sharded(optimizer),
        Some(ZeroStage::Two) => {
            grads = sharded(bytes(local)) + bytes(unit);
            optimizer = sharded(optimizer);
        }
        Some(ZeroStage::Three) => {
            params = sharded(params) + bytes(unit);
            grads = sharded(bytes(local)) + bytes(unit);
            optimizer = sharded(optimizer);
        }
    }

    // Reference mode: the row groups' tree keeps up to one pending gradient per level beside
    // the accumulated one (log2 of the rank's row groups, plus one), and each tree-ordered
    // reduction receives every data-parallel rank's contribution (the largest is a ZeRO unit or
    // a DDP bucket, counted as the whole local gradient).
    let dp = layout.data_parallel_degree().max(1);
    if cfg.train.reference {
        let groups = (cfg.train.batch_size / cfg.train.row_group.max(1) / dp).max(1);
        let levels = usize::BITS - groups.leading_zeros();
        grads = grads + bytes(local) * n(levels as usize) + bytes(local) * n(dp);
    }

    // Activations of the micro-batches (reference mode: row groups) in flight on the largest
    // rank.
    let rows = if cfg.train.reference {
        cfg.train.row_group
    } else {
        cfg.train.batch_size.div_ceil(dp).div_ceil(microbatches)
    };
    let seq = cfg.model.block_size;
    let tokens = n(rows) * n(seq);
    let in_flight = if pp > 1 {
        match opts.pipeline.schedule {
            ScheduleKind::GPipe => microbatches,
            ScheduleKind::Interleaved => microbatches.min(pp.saturating_mul(2)),
            _ => microbatches.min(pp),
        }
    } else {
        1
    };
    let tp_n = n(tp);
    let sp_n = if opts.sequence_parallel {
        tp_n
    } else {
        N::of(1)
    };
    let (outside, inside, scores) = shape.block_activations(seq);
    let block = outside.div_ceil(sp_n) + inside.div_ceil(tp_n);
    let all_blocks = matches!(opts.activation_checkpointing, ActivationCheckpointing::All);
    let blocks_values = if all_blocks {
        n(blocks) * n(shape.n_embd).div_ceil(sp_n) + N::of(2) * block
    } else {
        (n(blocks) + N::of(1)) * block
    };
    let per_token = blocks_values
        + scores.div_ceil(tp_n)
        + shape.edge_activations().div_ceil(sp_n)
        + (N::of(3) * n(shape.vocab_size)).div_ceil(tp_n);
    let activations = tokens * n(in_flight) * per_token * N::of(F32);

    let training = params + grads + optimizer + activations;
    let per_rank = if layout.zero() == Some(ZeroStage::Three) {
        // The end of the run: every rank gathers its full (tp-local) parameters.
        training.max(local * N::of(F32) + grads + optimizer)
    } else {
        training
    };
    let gather = if tp > 1 || pp > 1 {
        shape.with_blocks(shape.n_layer).total() * N::of(F32)
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

/// The memory that loading `shape` and running one forward pass without gradients over `rows`
/// sequences of its full context needs (one rank; see the module docs).
pub fn estimate_inference(shape: &ModelShape, rows: u64) -> MemoryEstimate {
    let params = N(shape.num_parameters()) * N::of(F32);
    let tokens = N::of(rows) * n(shape.positions);
    let (outside, inside, scores) = shape.block_activations(shape.positions);
    let per_token = N::of(2) * (outside + inside)
        + scores
        + shape.edge_activations()
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

/// Memory the machine can give this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure comes from, for messages.
    pub source: &'static str,
}

/// The memory available to this process: `MemAvailable` in `/proc/meminfo`, or what is left
/// under the cgroup v2 limit (`/sys/fs/cgroup/memory.max` less `memory.current`) when that is
/// smaller. `None` where neither can be read.
pub fn available_memory() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| parse_meminfo(&t))
        .map(|bytes| Available {
            bytes,
            source: "MemAvailable in /proc/meminfo",
        });
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cgroup = match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(current)) => {
            match (max.trim().parse::<u64>(), current.trim().parse::<u64>()) {
                (Ok(max), Ok(current)) => Some(Available {
                    bytes: max.saturating_sub(current),
                    source: "the cgroup limit in /sys/fs/cgroup/memory.max",
                }),
                _ => None,
            }
        }
        _ => None,
    };
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(if b.bytes < a.bytes { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line["MemAvailable:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    let scale = match parts.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(scale)
}

/// Whether [`SKIP_MEMORY_CHECK`] is set.
fn skip_memory_check() -> bool {
    std::env::var_os(SKIP_MEMORY_CHECK).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Refuses `estimate` when it is above `available` (or overflowed), with one line naming both
/// figures; `what` says what needs the memory ("this run", "checkpoint DIR"), `hint` how to need
/// less (may be empty).
pub fn check_memory_against(
    estimate: &MemoryEstimate,
    available: Option<Available>,
    what: &str,
    hint: &str,
) -> Result<()> {
    let too_much = match available {
        _ if estimate.overflowed() => true,
        Some(a) => estimate.total > a.bytes,
        None => false,
    };
    if !too_much {
        return Ok(());
    }
    let have = match available {
        Some(a) => format!("only {} is available ({})", human(a.bytes), a.source),
        None => "no machine has that much".to_string(),
    };
    anyhow::bail!(
        "not enough memory for {what}: it needs {estimate} but {have}; {hint}set \
         {SKIP_MEMORY_CHECK}=1 to skip this check"
    )
}

/// [`check_memory_against`] the machine's [`available_memory`]; the comparison is skipped (an
/// overflow is still refused) when [`SKIP_MEMORY_CHECK`] is set or the memory cannot be read.
pub fn check_memory(estimate: &MemoryEstimate, what: &str, hint: &str) -> Result<()> {
    let available = if skip_memory_check() {
        None
    } else {
        available_memory()
    };
    check_memory_against(estimate, available, what, hint)
}

/// Creates `dir` (with its parents) and writes and removes a probe file in it; `what` names the
/// directory and `keys` the settings that give it, in the error.
fn check_writable_dir(dir: &Path, what: &str, keys: &str) -> Result<()> {
    let shown = dir.display();
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the {what} directory {shown} ({keys})"))?;
    let probe = dir.join(format!(".meshgrad-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"meshgrad")
        .with_context(|| format!("the {what} directory {shown} ({keys}) is not writable"))?;
    std::fs::remove_file(&probe)
        .with_context(|| format!("cannot remove {} after writing it", probe.display()))?;
    Ok(())
}

/// Checks that the run's outputs can be written, before any work: the `out` directory is
/// created and a probe file written and removed in it; the metrics file's directory likewise,
/// and an existing metrics file must be a file that can be opened for writing (it is not
/// modified here). Errors are one line naming the path.
pub fn check_output(cfg: &TrainConfig) -> Result<()> {
    check_writable_dir(Path::new(&cfg.out), "output", "out, --out")?;
    if let Some(m) = &cfg.metrics {
        let path = Path::new(m);
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        check_writable_dir(dir, "metrics file's", "metrics, --metrics")?;
        if path.is_dir() {
            anyhow::bail!("the metrics file {m} (metrics, --metrics) is a directory");
        }
        if path.exists() {
            std::fs::OpenOptions::new()
                .append(true)
                .open(path)
                .with_context(|| format!("cannot write the metrics file {m}"))?;
        }
    }
    Ok(())
}

/// Checks, before any work, that the file `path` (`what`, given by `flag`) can be written when
/// the run ends: its directory is created and a probe file written and removed in it, and the
/// path is not a directory. The file itself is not touched.
pub fn check_file_writable(path: &Path, what: &str, flag: &str) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    check_writable_dir(dir, &format!("{what}'s"), flag)?;
    if path.is_dir() {
        anyhow::bail!("the {what} {} ({flag}) is a directory", path.display());
    }
    Ok(())
}

/// Every check before a training run's work: [`check_output`], the `--trace` file
/// ([`check_file_writable`]), then the memory the run needs
/// ([`estimate_training`]) against the machine's ([`check_memory`]). `cfg` is the resolved
/// config (validated, its vocabulary the tokenizer's).
pub fn check_train(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
) -> Result<()> {
    check_output(cfg)?;
    if let Some(trace) = &opts.pipeline.trace {
        check_file_writable(trace, "trace file", "--trace")?;
    }
    check_memory(
        &estimate_training(cfg, layout, opts),
        "this run",
        "use a smaller model or batch, more --microbatches, --activation-checkpointing all or a \
         sharded --layout, or ",
    )
}

/// Checks the model a checkpoint's `config.json` describes against memory before it is built
/// (for `eval` and `generate`): [`estimate_inference`] over [`INFERENCE_ROWS`] rows. A missing
/// or invalid config is left to the loader, which reports it.
pub fn check_checkpoint(dir: &Path) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return Ok(());
    };
    let shape = if hf_bert::is_bert_checkpoint(dir) {
        match hf_bert::bert_config_from_hf_json(&text) {
            Ok(c) => ModelShape::from_bert(&c),
            Err(_) => return Ok(()),
        }
    } else if hf_llama::is_llama_folder(dir) {
        match hf_llama::llama_config_from_hf_json(&text) {
            Ok(c) => ModelShape::from_llama(&c),
            Err(_) => return Ok(()),
        }
    } else {
        match hf_gpt2::gpt_config_from_hf_json(&text) {
            Ok((c, _)) => ModelShape::from_gpt(&c),
            Err(_) => return Ok(()),
        }
    };
    check_model_memory(&shape, &format!("checkpoint {}", dir.display()))
}

/// Checks the model `shape` describes against memory before it is built for `eval` or
/// `generate`: [`estimate_inference`] over [`INFERENCE_ROWS`] rows; `what` names it in the error
/// (`"checkpoint DIR"`).
pub fn check_model_memory(shape: &ModelShape, what: &str) -> Result<()> {
    check_memory(&estimate_inference(shape, INFERENCE_ROWS), what, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_nn::bert::BertForMaskedLM;
    use meshgrad_tensor::{DType, Device};

    fn gib(x: u64) -> Available {
        Available {
            bytes: x << 30,
            source: "test",
        }
    }

    #[test]
    fn parameter_counts_match_the_models() {
        let mut cfg = TrainConfig::default();
        for bias in [true, false] {
            cfg.model.bias = bias;
            let gpt = crate::model_configs::gpt_config(&cfg);
            let count = Some(gpt.num_parameters() as u64);
            assert_eq!(ModelShape::from_train_config(&cfg).num_parameters(), count);
            assert_eq!(ModelShape::from_gpt(&gpt).num_parameters(), count);
        }
        cfg.model.kind = crate::config::ModelKind::Bert;
        cfg.model.bias = true;
        cfg.model.n_layer = 2;
        let bert = crate::model_configs::bert_config(&cfg);
        let model = BertForMaskedLM::new(bert, 0, DType::F32, Device::Cpu).unwrap();
        let count = meshgrad_nn::Module::num_parameters(&model) as u64;
        assert_eq!(bert.num_parameters() as u64, count);
        assert_eq!(
            ModelShape::from_train_config(&cfg).num_parameters(),
            Some(count)
        );
        assert_eq!(ModelShape::from_bert(&bert).num_parameters(), Some(count));
    }

    #[test]
    fn layouts_divide_the_model_states() {
        let cfg = TrainConfig::default();
        let opts = TrainOptions::default();
        let one = estimate_training(&cfg, None, &opts);
        let p = ModelShape::from_train_config(&cfg)
            .num_parameters()
            .unwrap()
            * 4;
        assert_eq!((one.params, one.grads, one.optimizer), (p, 2 * p, 2 * p));
        assert_eq!(one.total, one.per_rank);
        assert!(!one.overflowed());
        let est = |spec: &str| estimate_training(&cfg, Some(&spec.parse().unwrap()), &opts);
        // Data parallelism: the same model states on every rank, half the rows each.
        let dp = est("dp=2");
        assert_eq!((dp.params, dp.optimizer), (one.params, one.optimizer));
        assert!(dp.activations < one.activations);
        assert_eq!(dp.total, 2 * dp.per_rank);
        // ZeRO-1 shards the moments; ZeRO-2 the gradients too; ZeRO-3 everything.
        let z1 = est("zero1=2");
        assert_eq!(z1.optimizer, one.optimizer.div_ceil(2));
        assert_eq!(z1.grads, one.grads);
        let z2 = est("zero2=2");
        assert!(z2.grads < one.grads / 2, "{z2:?}");
        assert_eq!(z2.optimizer, one.optimizer.div_ceil(2));
        let z3 = est("fsdp=4");
        assert!(z3.params < one.params / 2, "{z3:?}");
        // Tensor parallelism splits most parameters; rank 0 gathers the model at the end.
        let tp = est("tp=2");
        assert!(
            tp.params < one.params && tp.params > one.params / 2,
            "{tp:?}"
        );
        assert_eq!(tp.gather, p);
        // Pipeline stages hold fewer blocks.
        let pp = est("pp=2");
        assert!(pp.params < one.params, "{pp:?}");
        // Micro-batches and activation checkpointing lower the activations.
        let micro = estimate_training(
            &cfg,
            None,
            &TrainOptions {
                microbatches: 4,
                ..TrainOptions::default()
            },
        );
        assert!(micro.activations < one.activations / 3);
        let ckpt = estimate_training(
            &cfg,
            None,
            &TrainOptions {
                activation_checkpointing: ActivationCheckpointing::All,
                ..TrainOptions::default()
            },
        );
        assert!(ckpt.activations < one.activations);
    }

    #[test]
    fn reference_mode_counts_its_tree_and_one_row_group_of_activations() {
        let opts = TrainOptions::default();
        let mut cfg = TrainConfig::default();
        let p = ModelShape::from_train_config(&cfg)
            .num_parameters()
            .unwrap()
            * 4;
        let fast = estimate_training(&cfg, None, &opts);
        cfg.train.reference = true;
        // 16 row groups of 1 sequence on one device: 5 tree levels, one contribution.
        let one = estimate_training(&cfg, None, &opts);
        assert_eq!(one.grads, fast.grads + 5 * p + p);
        assert_eq!(one.activations * 16, fast.activations);
        // dp=4: 4 row groups per rank (3 levels), 4 contributions per reduction.
        let dp4 = estimate_training(&cfg, Some(&"dp=4".parse().unwrap()), &opts);
        assert_eq!(dp4.grads, fast.grads + 3 * p + 4 * p);
        assert_eq!(dp4.activations * 16, fast.activations);
    }

    #[test]
    fn huge_sizes_are_refused_and_overflow_is_sticky() {
        let opts = TrainOptions::default();
        let mut cfg = TrainConfig::default();
        // The default run fits in 1 GiB.
        let est = estimate_training(&cfg, None, &opts);
        check_memory_against(&est, Some(gib(1)), "this run", "").unwrap();
        // A width of a million: tens of TiB of parameters.
        cfg.model.n_embd = 1_000_000;
        let est = estimate_training(&cfg, None, &opts);
        assert!(est.params > 1 << 40, "{est:?}");
        let msg = check_memory_against(&est, Some(gib(64)), "this run", "")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not enough memory for this run"), "{msg}");
        assert!(msg.contains("TiB") && msg.contains("only 64.0 GiB is available (test)"));
        assert!(!msg.contains('\n'), "{msg}");
        // Without a reading of the machine, a run that merely looks big passes...
        check_memory_against(&est, None, "this run", "").unwrap();
        // ...but one whose sizes overflow 64 bits never does.
        cfg.model.n_layer = usize::MAX / 2;
        let est = estimate_training(&cfg, None, &opts);
        assert!(est.overflowed());
        let msg = check_memory_against(&est, None, "this run", "")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("more than 16 EiB"), "{msg}");
        let mut cfg = TrainConfig::default();
        cfg.train.batch_size = usize::MAX;
        assert!(estimate_training(&cfg, None, &opts).overflowed());
        // An overflow stays one through the divisions of sharding and tensor parallelism.
        let mut cfg = TrainConfig::default();
        cfg.model.n_embd = 1 << 33;
        for spec in ["fsdp=4", "tp=4", "pp=4", "hsdp=2x2,tp=2"] {
            let layout: ParallelLayout = spec.parse().unwrap();
            let est = estimate_training(&cfg, Some(&layout), &opts);
            assert!(est.overflowed(), "{spec}: {est:?}");
            assert_eq!(est.params, u64::MAX, "{spec}");
        }
    }

    #[test]
    fn meminfo_and_units() {
        let text = "MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   23263700 kB\n";
        assert_eq!(parse_meminfo(text), Some(23263700 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
        assert_eq!(human(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn inference_estimate_counts_the_checkpoint() {
        let cfg = TrainConfig::default();
        let shape = ModelShape::from_gpt(&crate::model_configs::gpt_config(&cfg));
        let est = estimate_inference(&shape, INFERENCE_ROWS);
        assert_eq!(est.params, shape.num_parameters().unwrap() * 4);
        assert_eq!(est.grads + est.optimizer, 0);
        assert!(est.activations > 0 && est.total == est.params + est.activations);
    }
}
