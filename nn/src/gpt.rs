//! GPT (the GPT-2 architecture): learned positions, pre-LayerNorm blocks, tied output head.
//!
//! [`Gpt`] is the whole model; [`GptStage`] is a contiguous range of its blocks, with or without
//! the embedding and the head, under the whole model's parameter names (see [`crate::stage`]).

use std::ops::Range;
use std::sync::Arc;

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

use crate::generation::{self, Sampling};
use crate::layers::{Block, BlockConfig, Dropout, Embedding, LayerNorm, LmHead};
use crate::module::{Forward, Module};
use crate::param_builder::ParamBuilder;
use crate::stage::{BlockRange, ModelStage, StageInput, StageSpec};
use crate::tp::{ParallelStyle, TpPlan};

/// GPT hyper-parameters (GPT-2 naming in comments).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// Context length (`n_positions` / `n_ctx`).
    pub block_size: usize,
    /// Transformer blocks (`n_layer`).
    pub n_layer: usize,
    /// Attention heads (`n_head`).
    pub n_head: usize,
    /// Model width (`n_embd`).
    pub n_embd: usize,
    /// Dropout probability (embeddings, residuals).
    pub dropout: f64,
    /// Biases in linears and norms.
    pub bias: bool,
    /// Layer-norm epsilon (`layer_norm_epsilon`).
    pub layer_norm_eps: f64,
}

impl GptConfig {
    /// Checks the sizes (positive, `n_embd` divisible by `n_head`), the dropout (in [0, 1)) and
    /// the layer-norm epsilon (positive and finite), with one-line errors.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.vocab_size == 0
            || c.block_size == 0
            || c.n_layer == 0
            || c.n_head == 0
            || c.n_embd == 0
        {
            meshgrad_tensor::bail!("gpt config: sizes must be positive: {c:?}");
        }
        if !c.n_embd.is_multiple_of(c.n_head) {
            meshgrad_tensor::bail!(
                "gpt config: n_embd {} is not divisible by n_head {}",
                c.n_embd,
                c.n_head
            );
        }
        if !(0.0..1.0).contains(&c.dropout) {
            meshgrad_tensor::bail!("gpt config: dropout {} must be in [0, 1)", c.dropout);
        }
        if !(c.layer_norm_eps.is_finite() && c.layer_norm_eps > 0.0) {
            meshgrad_tensor::bail!(
                "gpt config: layer_norm_epsilon must be positive and finite, got {}",
                c.layer_norm_eps
            );
        }
        Ok(())
    }

    /// The blocks' hyper-parameters (GPT-2's residual projections start at
    /// N(0, 0.02/sqrt(2 n_layer))).
    fn block_config(&self) -> BlockConfig {
        BlockConfig {
            n_embd: self.n_embd,
            n_head: self.n_head,
            bias: self.bias,
            dropout: self.dropout,
            proj_std: 0.02 / (2.0 * self.n_layer as f64).sqrt(),
            eps: self.layer_norm_eps,
        }
    }

    /// Number of parameters of the model this config builds (tied head counted once).
    pub fn num_parameters(&self) -> usize {
        let (v, t, l, c) = (self.vocab_size, self.block_size, self.n_layer, self.n_embd);
        let b = if self.bias { 1 } else { 0 };
        let ln = c + b * c;
        let block = 2 * ln
            + (3 * c * c + b * 3 * c)
            + (c * c + b * c)
            + (4 * c * c + b * 4 * c)
            + (4 * c * c + b * c);
        v * c + t * c + l * block + ln
    }
}

/// The GPT model. Parameter names follow Hugging Face GPT-2 (`wte.weight`,
/// `h.0.attn.c_attn.weight`, ..., `ln_f.bias`); the output head is `wte` (tied).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct Gpt {
    /// Hyper-parameters.
    pub config: GptConfig,
    /// Token embeddings `[vocab, C]` (also the output head).
    pub wte: Embedding,
    /// Position embeddings `[block_size, C]`.
    pub wpe: Embedding,
    /// Embedding dropout.
    pub drop: Dropout,
    /// The blocks.
    pub h: Vec<Arc<Block>>,
    /// Final norm.
    pub ln_f: LayerNorm,
    /// The output head over `wte` (tied; owns no parameters).
    pub lm_head: LmHead,
    /// Recompute each block's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
    /// The token ids the data uses when the vocabulary is padded (`config.vocab_size` rounded
    /// up for tensor parallelism): [`Gpt::generate`] samples only among `0..n` and refuses
    /// prompt ids from `n` on. `None`: every id of `config.vocab_size`.
    pub vocab_in_use: Option<usize>,
}

impl Gpt {
    /// A new model with GPT-2 initialisation: N(0, 0.02) weights, residual projections
    /// N(0, 0.02/sqrt(2 n_layer)), zero biases, unit norm weights. Each parameter's values depend
    /// only on `seed` and its name.
    pub fn new(config: GptConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        Gpt::build(config, ParamBuilder::new(seed).dtype(dtype).device(device))
    }

    /// A new model whose parameters `builder` creates (its seed, dtype and device; with
    /// [`ParamBuilder::tensor_parallel`] and [`Gpt::tp_plan`], this rank's part of a
    /// tensor-parallel model, every value equal to the single-device one).
    pub fn build(config: GptConfig, builder: ParamBuilder) -> Result<Self> {
        config.validate()?;
        let c = config;
        let bc = c.block_config();
        builder.build(|p| {
            Ok(Gpt {
                config,
                wte: Embedding::new(p, c.vocab_size, c.n_embd, 0.02)?,
                wpe: Embedding::new(p, c.block_size, c.n_embd, 0.01)?,
                drop: Dropout::new(c.dropout)?,
                h: new_blocks(p, bc, 0..c.n_layer)?,
                ln_f: LayerNorm::new(p, c.n_embd, c.bias, c.layer_norm_eps)?,
                lm_head: LmHead::new(),
                activation_checkpointing: false,
                vocab_in_use: None,
            })
        })
    }

    /// The ids generation samples among: [`Gpt::vocab_in_use`] when set (at most
    /// `config.vocab_size`), else the whole vocabulary.
    pub fn sampled_vocab(&self) -> usize {
        self.vocab_in_use
            .map_or(self.config.vocab_size, |n| n.min(self.config.vocab_size))
    }

    /// The tensor-parallel plan of the GPT (Megatron-LM's split): q/k/v and the MLP
    /// up-projection column-parallel (q, k and v each split by heads), the output projections
    /// row-parallel, the token table split by vocabulary (the tied head and the loss stay split),
    /// the norms and dropouts sequence-parallel (the embedding dropout starts that region).
    pub fn tp_plan() -> TpPlan {
        TpPlan::new()
            .with("wte", ParallelStyle::VocabEmbedding)
            .with("drop", ParallelStyle::SequenceSplit)
            .with("h.*.ln_1", ParallelStyle::SequenceParallel)
            .with("h.*.attn.c_attn", ParallelStyle::Colwise { chunks: 3 })
            .with("h.*.attn.c_proj", ParallelStyle::Rowwise)
            .with("h.*.attn.resid_dropout", ParallelStyle::SequenceParallel)
            .with("h.*.ln_2", ParallelStyle::SequenceParallel)
            .with("h.*.mlp.c_fc", ParallelStyle::Colwise { chunks: 1 })
            .with("h.*.mlp.c_proj", ParallelStyle::Rowwise)
            .with("h.*.mlp.dropout", ParallelStyle::SequenceParallel)
            .with("ln_f", ParallelStyle::SequenceParallel)
            .with("lm_head", ParallelStyle::VocabHead)
    }

    /// Checks that the sizes split over `tp` ranks, with one line naming them (heads, width,
    /// vocabulary); `sequence` is the training sequence length when sequence parallelism is on.
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }

    /// The final hidden states `[B, T, C]` (after `ln_f`) for token ids `[B, T]` (under sequence
    /// parallelism, this rank's positions `[B, T / tp, C]`).
    pub fn hidden(&self, ids: &Tensor) -> Result<Var> {
        self.run(ids, false)
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]` (under tensor parallelism, this rank's
    /// vocabulary slice `[B, T, vocab / tp]`). Dropout masks follow the current
    /// [`ForwardCtx`](meshgrad_autograd::ForwardCtx).
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        self.run(ids, true)
    }

    /// The forward: token + position embeddings and dropout, the blocks (each recomputed in
    /// backward with activation checkpointing), `ln_f`, then with `logits` the tied projection
    /// x wteᵀ as a fused linear, whose weight gradient comes out in wte's layout.
    fn run(&self, ids: &Tensor, logits: bool) -> Result<Var> {
        check_ids(&self.config, ids)?;
        let mut x = embed(&self.wte, &self.wpe, &self.drop, ids)?;
        for block in &self.h {
            x = run_block(block, &x, self.activation_checkpointing)?;
        }
        let x = self.ln_f.forward(&x)?;
        if logits {
            self.lm_head.forward(&x, &self.wte.weight)
        } else {
            Ok(x)
        }
    }

    /// Mean next-token cross-entropy of `ids [B, T]` against `targets [B, T]` (targets equal to
    /// `ignore_index` are skipped).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        let (b, t) = check_ids(&self.config, ids)?;
        if targets.dims() != [b, t] {
            meshgrad_tensor::bail!(
                "gpt: targets {} must match ids {}",
                targets.shape(),
                ids.shape()
            );
        }
        let logits = self.forward(ids)?;
        self.lm_head.loss(&logits, targets, ignore_index)
    }

    /// Continues `prompt` (token ids) by `max_new` tokens: greedy when `temperature == 0`, else
    /// sampling from `softmax(logits / temperature)` (optionally restricted to the `top_k` most
    /// likely tokens) with the counter-based draw `(seed, position)`. The context is cropped to
    /// the last `block_size` tokens.
    ///
    /// `on_token` is called with each new token as soon as it is chosen (to stream the output);
    /// an error from it stops the generation and is returned. Pass `|_| Ok(())` to only collect
    /// the tokens.
    ///
    /// Only ids below [`Gpt::sampled_vocab`] are prompted or sampled (a padded vocabulary's
    /// extra ids never are).
    ///
    /// Errors: an empty prompt or a token outside the vocabulary; a `temperature` that is not a
    /// finite number >= 0; `top_k` of `Some(0)`; logits that are not finite (NaN or infinite),
    /// naming the step (1-based); a model whose logits are split over tensor-parallel ranks.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
        on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        if self.lm_head.vocab_parallel().is_some() {
            meshgrad_tensor::bail!(
                "generate: this model's logits are split over tensor-parallel ranks; generate \
                 from a single-device model (load the gathered checkpoint)"
            );
        }
        let sampling = Sampling {
            temperature,
            top_k,
            seed,
        };
        let was_training = self.drop.is_training();
        self.set_training(false);
        let r = generation::generate(self, prompt, max_new, sampling, on_token);
        self.set_training(was_training);
        r
    }
}

/// One microbatch as every [`GptStage`] reads it: the first stage its ids, the stage with the
/// head its targets.
#[derive(Clone, Debug)]
pub struct GptBatch {
    /// Token ids `[B, T]`.
    pub ids: Tensor,
    /// Next-token targets `[B, T]`.
    pub targets: Tensor,
    /// Targets equal to this are skipped by the loss.
    pub ignore_index: Option<i64>,
}

/// A stage of a [`Gpt`]: blocks `spec.blocks` (global indices), with the embedding (`wte`,
/// `wpe`, `drop`) when `spec.embedding` and the final norm and tied head (`ln_f`, `lm_head`)
/// when `spec.head`. See [`crate::stage`].
///
/// It creates only its own parameters, under the full model's names (`h.2.attn.c_attn.weight`
/// in whatever stage holds block 2), with the full model's values: initialisation is keyed by
/// name (and, under tensor parallelism, by global element index), and the residual projections'
/// scale uses the full model's `n_layer`. Dropout paths are the full model's too, so a stage
/// run in the [`ForwardCtx`](meshgrad_autograd::ForwardCtx) of the full model's forward draws
/// its masks.
///
/// **The tied head.** The stage with the head reads the token table `wte.weight`. When it is not
/// also the stage with the embedding it holds its own copy, named `wte.weight` and initialised
/// to the same values (its `wte` is only read by the head, never looked up). The two copies are
/// one parameter of the model: its gradient is the sum of the two copies' gradients (the
/// embedding's and the head's contributions), both copies must take that summed gradient and
/// the same update, and a checkpoint stores it once. [`ModelStage::tied_parameters`] names it.
/// A single stage holding the whole model has one `wte.weight`, as [`Gpt`].
///
/// Why a separate type rather than a [`Gpt`] with optional parts: `Gpt`'s fields (`wte`,
/// `h: Vec<_>`, `ln_f`) are read directly by checkpoint conversion, evaluation and generation,
/// which all need the whole model; a stage's parts are `Option`s and its blocks a
/// [`BlockRange`] that names them by global index. Both build their parts and run their forward
/// through the same functions, so they compute the same values.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct GptStage {
    /// Hyper-parameters of the full model.
    pub config: GptConfig,
    /// The part of the model this stage holds.
    pub spec: StageSpec,
    /// Token embeddings `[vocab, C]` (with the embedding or the head: the tied table).
    pub wte: Option<Embedding>,
    /// Position embeddings (with the embedding).
    pub wpe: Option<Embedding>,
    /// Embedding dropout (with the embedding).
    pub drop: Option<Dropout>,
    /// The blocks, named by global index.
    pub h: BlockRange<Block>,
    /// Final norm (with the head).
    pub ln_f: Option<LayerNorm>,
    /// The output head over `wte` (with the head).
    pub lm_head: Option<LmHead>,
    /// Recompute each block's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
}

impl GptStage {
    /// A new stage with GPT-2 initialisation: every parameter equal to the same-named parameter
    /// of [`Gpt::new`] with the same arguments.
    pub fn new(
        config: GptConfig,
        spec: StageSpec,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        GptStage::build(
            config,
            spec,
            ParamBuilder::new(seed).dtype(dtype).device(device),
        )
    }

    /// A new stage whose parameters `builder` creates (with
    /// [`ParamBuilder::tensor_parallel`] and [`GptStage::tp_plan`], this rank's part of the
    /// stage's tensor-parallel split). A one-line error for a spec that does not fit the config.
    pub fn build(config: GptConfig, spec: StageSpec, builder: ParamBuilder) -> Result<Self> {
        config.validate()?;
        spec.validate(config.n_layer)
            .map_err(|e| meshgrad_tensor::Error::msg(format!("gpt {e}")))?;
        let c = config;
        let bc = c.block_config();
        builder.build(|p| {
            let (first, last) = (spec.embedding, spec.head);
            Ok(GptStage {
                config,
                spec: spec.clone(),
                wte: if first || last {
                    Some(Embedding::new(p, c.vocab_size, c.n_embd, 0.02)?)
                } else {
                    None
                },
                wpe: if first {
                    Some(Embedding::new(p, c.block_size, c.n_embd, 0.01)?)
                } else {
                    None
                },
                drop: if first {
                    Some(Dropout::new(c.dropout)?)
                } else {
                    None
                },
                h: BlockRange::new(spec.blocks.start, new_blocks(p, bc, spec.blocks.clone())?),
                ln_f: if last {
                    Some(LayerNorm::new(p, c.n_embd, c.bias, c.layer_norm_eps)?)
                } else {
                    None
                },
                lm_head: if last { Some(LmHead::new()) } else { None },
                activation_checkpointing: false,
            })
        })
    }

    /// The part of [`Gpt::tp_plan`] that applies to the modules of a stage `spec`.
    pub fn tp_plan(spec: &StageSpec) -> TpPlan {
        let holds = |pattern: &str| match pattern.split('.').next().unwrap_or("") {
            "wte" => spec.embedding || spec.head,
            "wpe" | "drop" => spec.embedding,
            "ln_f" | "lm_head" => spec.head,
            _ => true,
        };
        Gpt::tp_plan()
            .entries()
            .iter()
            .filter(|(p, _)| holds(p))
            .fold(TpPlan::new(), |plan, (p, s)| plan.with(p.clone(), *s))
    }

    /// As [`Gpt::check_tensor_parallel`].
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }

    /// The stage's output for `input`: the hidden states after its last block, and after `ln_f`
    /// on the stage with the head (`[B, T, C]`; under sequence parallelism this rank's positions
    /// `[B, T / tp, C]`, which is also what a later stage takes).
    pub fn hidden(&self, input: StageInput<'_>) -> Result<Var> {
        let mut x = match input {
            StageInput::Ids(ids) => {
                let (Some(wte), Some(wpe), Some(drop)) = (&self.wte, &self.wpe, &self.drop) else {
                    meshgrad_tensor::bail!(
                        "gpt stage ({}): takes the previous stage's hidden states [B, T, C], not token ids (it has no embedding)",
                        self.spec
                    );
                };
                check_ids(&self.config, ids)?;
                embed(wte, wpe, drop, ids)?
            }
            StageInput::Hidden(h) => {
                if self.spec.embedding {
                    meshgrad_tensor::bail!(
                        "gpt stage ({}): holds the embedding and takes token ids [B, T], not hidden states",
                        self.spec
                    );
                }
                let d = h.tensor().dims();
                if d.len() != 3 || d[2] != self.config.n_embd || d[1] == 0 {
                    meshgrad_tensor::bail!(
                        "gpt stage ({}): hidden states must be [B, T, {}], got {}",
                        self.spec,
                        self.config.n_embd,
                        h.tensor().shape()
                    );
                }
                h.clone()
            }
        };
        for block in self.h.blocks() {
            x = run_block(block, &x, self.activation_checkpointing)?;
        }
        match &self.ln_f {
            Some(ln_f) => ln_f.forward(&x),
            None => Ok(x),
        }
    }

    fn head(&self) -> Result<(&LmHead, &Embedding)> {
        match (&self.lm_head, &self.wte) {
            (Some(head), Some(wte)) => Ok((head, wte)),
            _ => meshgrad_tensor::bail!(
                "gpt stage ({}): has no head (only the last stage computes logits and the loss)",
                self.spec
            ),
        }
    }

    /// Logits `[B, T, vocab]` (as [`Gpt::forward`]) on the stage with the head.
    pub fn logits(&self, input: StageInput<'_>) -> Result<Var> {
        let (head, wte) = self.head()?;
        head.forward(&self.hidden(input)?, &wte.weight)
    }

    /// Mean next-token cross-entropy against `targets [B, T]` (as [`Gpt::loss`]) on the stage
    /// with the head.
    pub fn loss(
        &self,
        input: StageInput<'_>,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Var> {
        let (head, _) = self.head()?;
        if targets.rank() != 2 || !targets.dtype().is_int() {
            meshgrad_tensor::bail!(
                "gpt stage: targets must be an integer tensor [B, T], got {} of {}",
                targets.shape(),
                targets.dtype()
            );
        }
        let logits = self.logits(input)?;
        if logits.tensor().dims()[0] != targets.dims()[0] {
            meshgrad_tensor::bail!(
                "gpt stage: targets {} do not match the batch of the input ({} rows)",
                targets.shape(),
                logits.tensor().dims()[0]
            );
        }
        head.loss(&logits, targets, ignore_index)
    }
}

impl ModelStage for GptStage {
    type Batch = GptBatch;

    fn spec(&self) -> &StageSpec {
        &self.spec
    }

    fn tied_table(&self) -> Option<&'static str> {
        Some("wte.weight")
    }

    /// Hidden states, or the loss of `batch.targets` on the stage with the head.
    fn forward_stage(&self, batch: &GptBatch, hidden: Option<&Var>) -> Result<Var> {
        let input = match hidden {
            Some(h) => StageInput::Hidden(h),
            None => StageInput::Ids(&batch.ids),
        };
        if self.spec.head {
            self.loss(input, &batch.targets, batch.ignore_index)
        } else {
            self.hidden(input)
        }
    }
}

/// Checks token ids `[B, T]` against the config, returning `(B, T)`.
fn check_ids(config: &GptConfig, ids: &Tensor) -> Result<(usize, usize)> {
    if ids.rank() != 2 || !ids.dtype().is_int() {
        meshgrad_tensor::bail!(
            "gpt: token ids must be an integer tensor [B, T], got {} of {}",
            ids.shape(),
            ids.dtype()
        );
    }
    let (b, t) = (ids.dims()[0], ids.dims()[1]);
    if t > config.block_size || t == 0 {
        meshgrad_tensor::bail!(
            "gpt: sequence length {t} must be in 1..={} (block_size)",
            config.block_size
        );
    }
    Ok((b, t))
}

/// Blocks `range` (global indices; only their names, given by the model tree, depend on them).
fn new_blocks(p: &ParamBuilder, bc: BlockConfig, range: Range<usize>) -> Result<Vec<Arc<Block>>> {
    range.map(|_| Block::new(p, bc).map(Arc::new)).collect()
}

/// Token + position embeddings of ids `[B, T]`, then the embedding dropout.
fn embed(wte: &Embedding, wpe: &Embedding, drop: &Dropout, ids: &Tensor) -> Result<Var> {
    let t = ids.dims()[1];
    let pos = Tensor::arange(0, t as i64, DType::I64, ids.device())?;
    let x = wte.forward(ids)?.add(&wpe.forward(&pos)?)?;
    drop.forward(&x)
}

/// One block, recomputed in backward with activation checkpointing.
fn run_block(block: &Arc<Block>, x: &Var, checkpointed: bool) -> Result<Var> {
    if checkpointed {
        block.forward_checkpointed(x)
    } else {
        block.forward(x)
    }
}

/// The tensor-parallel size checks of [`Gpt::check_tensor_parallel`].
pub fn check_tp_sizes(c: &GptConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
    crate::tp::check_split_sizes(
        "gpt",
        tp,
        &[
            ("n_head", c.n_head),
            ("MLP width 4 x n_embd", 4 * c.n_embd),
            ("vocab_size", c.vocab_size),
        ],
        sequence,
    )
}

/// Reference mode's chunk count `K` for a GPT of config `c` (see [`crate::tp::reference`]): the
/// largest power of two dividing the heads, the vocabulary and the context length (so also the
/// width and the MLP width). It depends only on the model, never on the layout; reference mode
/// runs tensor parallelism of a degree dividing it.
pub fn reference_chunks(c: &GptConfig) -> usize {
    crate::tp::largest_common_power_of_two(&[c.n_head, c.vocab_size, c.block_size])
}
