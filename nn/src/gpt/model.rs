//! [`Gpt`]: a GPT or a stage of one (the whole model is the stage of every block with the
//! embedding and the head), its tensor-parallel plan and its checks.

use std::ops::Range;
use std::sync::Arc;

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

use super::GptConfig;
use crate::cp::ContextParallel;
use crate::generation::{self, Sampling};
use crate::input_checks;
use crate::layers::{Block, BlockConfig, Dropout, Embedding, LayerNorm, LmHead};
use crate::module::{Forward, Module};
use crate::param_builder::ParamBuilder;
use crate::stage::{BlockRange, ModelStage, StageInput, StageSpec};
use crate::tp::{ParallelStyle, TpPlan};

/// The name of the token table, which the tied head reads.
const TABLE: &str = "wte.weight";

/// One microbatch as every stage of a [`Gpt`] reads it: the stage with the embedding its ids,
/// the stage with the head its targets.
#[derive(Clone, Debug)]
pub struct GptBatch {
    /// Token ids `[B, T]`.
    pub ids: Tensor,
    /// Next-token targets `[B, T]`.
    pub targets: Tensor,
    /// Targets equal to this are skipped by the loss.
    pub ignore_index: Option<i64>,
}

/// A GPT (the GPT-2 architecture): token and learned position embeddings, pre-LayerNorm blocks,
/// a final LayerNorm and an output head tied to the token table.
///
/// **One type for the model and its stages.** A `Gpt` holds the part of the model its
/// [`StageSpec`] names: blocks `spec.blocks` (global indices), with the embedding (`wte`, `wpe`,
/// `drop`) when `spec.embedding` and the final norm and tied head (`ln_f`, `lm_head`) when
/// `spec.head`. [`Gpt::new`] builds the whole model, the stage [`StageSpec::full`];
/// [`Gpt::new_stage`] any other. Every part is created under the whole model's name and
/// initialised from `(seed, name)` (under tensor parallelism, also the global element index;
/// the residual projections' scale uses the whole model's `n_layer`), so a stage's parameters
/// are the whole model's, value for value. Dropout paths are the whole model's too, so a stage
/// run in the [`ForwardCtx`](meshgrad_autograd::ForwardCtx) of the whole model's forward draws
/// its masks, and a chain of stages ([`crate::run_chained`]) computes the whole model's loss
/// and gradients bit for bit.
///
/// **Names** follow Hugging Face GPT-2, so a state dict maps one to one: `wte.weight`,
/// `wpe.weight`, `h.{i}.ln_1.weight`, `h.{i}.attn.c_attn.weight`, ..., `ln_f.bias`. The head
/// owns no parameter: it reads `wte.weight`.
///
/// **The tied head.** A stage with the head but not the embedding holds its own copy of the
/// token table, named `wte.weight` and initialised to the same values (only read by the head,
/// never looked up). The two copies are one parameter of the model
/// ([`ModelStage::tied_parameters`]): its gradient is the sum of the copies' gradients, both
/// copies take that summed gradient and the same update, and a checkpoint stores it once. The
/// whole model has one `wte.weight`.
///
/// ```
/// use meshgrad_nn::gpt::{Gpt, GptConfig};
/// use meshgrad_nn::{run_chained, ForwardCtx, GptBatch, StageSpec};
/// use meshgrad_tensor::{DType, Device, Tensor};
///
/// let config = GptConfig {
///     vocab_size: 64,
///     block_size: 16,
///     n_layer: 2,
///     n_head: 2,
///     n_embd: 16,
///     dropout: 0.0,
///     bias: true,
///     layer_norm_eps: 1e-5,
/// };
/// let model = Gpt::new(config, 7, DType::F32, Device::Cpu)?;
/// let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], (1, 4), Device::Cpu)?;
/// let targets = Tensor::from_vec(vec![5u32, 9, 2, 7], (1, 4), Device::Cpu)?;
/// let loss = model.loss(&ids, &targets, None)?;
///
/// // The same model as two stages of one block each: the same loss.
/// let stages = StageSpec::even(2, 2)?
///     .into_iter()
///     .map(|spec| Gpt::new_stage(config, spec, 7, DType::F32, Device::Cpu))
///     .collect::<Result<Vec<_>, _>>()?;
/// let batch = GptBatch { ids, targets, ignore_index: None };
/// let chained = run_chained(&stages, &batch, ForwardCtx::new(0, 0))?;
/// assert_eq!(chained.tensor().to_vec_f64()?, loss.tensor().to_vec_f64()?);
///
/// let next = model.generate(&[1, 5], 3, 0.0, None, 0, |_| Ok(()))?;
/// assert_eq!(next.len(), 3);
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct Gpt {
    /// Hyper-parameters of the whole model.
    pub config: GptConfig,
    /// The part of the model this holds ([`StageSpec::full`] for the whole model).
    pub spec: StageSpec,
    /// Token embeddings `[vocab, C]` (with the embedding or the head: the tied table, also the
    /// output head).
    pub wte: Option<Embedding>,
    /// Position embeddings `[block_size, C]` (with the embedding).
    pub wpe: Option<Embedding>,
    /// Embedding dropout (with the embedding).
    pub drop: Option<Dropout>,
    /// The blocks, named by global index (`h.{i}`; `h[i]` is block `i`).
    pub h: BlockRange<Block>,
    /// Final norm (with the head).
    pub ln_f: Option<LayerNorm>,
    /// The output head over `wte` (with the head; tied, it owns no parameters).
    pub lm_head: Option<LmHead>,
    /// Recompute each block's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
    /// Context parallelism (from the builder): the positions of the ids the embedding takes are
    /// this rank's chunks of the sequence ([`ContextParallel::positions`]).
    pub cp: Option<ContextParallel>,
    /// The token ids the data uses when the vocabulary is padded (`config.vocab_size` rounded
    /// up for tensor parallelism): [`Gpt::generate`] samples only among `0..n` and refuses
    /// prompt ids from `n` on. `None`: every id of `config.vocab_size`.
    pub vocab_in_use: Option<usize>,
}

impl Gpt {
    /// The whole model with GPT-2 initialisation: N(0, 0.02) weights, residual projections
    /// N(0, 0.02/sqrt(2 n_layer)), zero biases, unit norm weights. Each parameter's values depend
    /// only on `seed` and its name.
    pub fn new(config: GptConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        Gpt::build(config, ParamBuilder::new(seed).dtype(dtype).device(device))
    }

    /// The whole model, its parameters created by `builder` (its seed, dtype and device; with
    /// [`ParamBuilder::tensor_parallel`] and [`Gpt::tp_plan`], this rank's part of a
    /// tensor-parallel model, every value equal to the single-device one).
    pub fn build(config: GptConfig, builder: ParamBuilder) -> Result<Self> {
        Gpt::build_stage(config, StageSpec::full(config.n_layer), builder)
    }

    /// The stage `spec` of the model, every parameter equal to the same-named one of
    /// [`Gpt::new`] with the same arguments.
    pub fn new_stage(
        config: GptConfig,
        spec: StageSpec,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        Gpt::build_stage(
            config,
            spec,
            ParamBuilder::new(seed).dtype(dtype).device(device),
        )
    }

    /// The stage `spec`, its parameters created by `builder` (with
    /// [`ParamBuilder::tensor_parallel`] and [`Gpt::stage_tp_plan`], this rank's part of the
    /// stage's tensor-parallel split). One-line errors for a config that does not validate and
    /// a spec that does not fit it.
    pub fn build_stage(config: GptConfig, spec: StageSpec, builder: ParamBuilder) -> Result<Self> {
        config.validate()?;
        spec.validate(config.n_layer)
            .map_err(|e| meshgrad_tensor::Error::msg(format!("gpt {e}")))?;
        let c = config;
        builder.build(|p| {
            let (first, last) = (spec.embedding, spec.head);
            Ok(Gpt {
                config,
                spec: spec.clone(),
                wte: (first || last)
                    .then(|| Embedding::new(p, c.vocab_size, c.n_embd, 0.02))
                    .transpose()?,
                wpe: first
                    .then(|| Embedding::new(p, c.block_size, c.n_embd, 0.01))
                    .transpose()?,
                drop: first
                    .then(|| Dropout::on_sequence(c.dropout, p))
                    .transpose()?,
                h: BlockRange::new(
                    spec.blocks.start,
                    new_blocks(p, c.block_config(), spec.blocks.clone())?,
                ),
                ln_f: last
                    .then(|| LayerNorm::new(p, c.n_embd, c.bias, c.layer_norm_eps))
                    .transpose()?,
                lm_head: last.then(LmHead::new),
                activation_checkpointing: false,
                cp: p.context_parallel_group().cloned(),
                vocab_in_use: None,
            })
        })
    }

    /// The tensor-parallel plan of the whole model (Megatron-LM's split): q/k/v and the MLP
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

    /// The part of [`Gpt::tp_plan`] that applies to the modules of the stage `spec` (for
    /// [`StageSpec::full`], the whole plan).
    pub fn stage_tp_plan(spec: &StageSpec) -> TpPlan {
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

    /// Checks that the sizes split over `tp` ranks, with one line naming them (heads, width,
    /// vocabulary); `sequence` is the training sequence length when sequence parallelism is on.
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }

    /// Whether this is the whole model (every block, the embedding and the head).
    pub fn is_full(&self) -> bool {
        self.spec == StageSpec::full(self.config.n_layer)
    }

    /// The ids generation samples among: [`Gpt::vocab_in_use`] when set (at most
    /// `config.vocab_size`), else the whole vocabulary.
    pub fn sampled_vocab(&self) -> usize {
        self.vocab_in_use
            .map_or(self.config.vocab_size, |n| n.min(self.config.vocab_size))
    }

    /// The output for `input`: token + position embeddings and dropout on the stage with the
    /// embedding, the stage's blocks (each recomputed in backward with activation
    /// checkpointing), and `ln_f` on the stage with the head. `[B, T, C]`; under sequence
    /// parallelism this rank's positions `[B, T / tp, C]`, which is also what a later stage
    /// takes.
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
                embed(wte, wpe, drop, ids, self.cp.as_ref())?
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
            x = if self.activation_checkpointing {
                block.forward_checkpointed(&x)?
            } else {
                block.forward(&x)?
            };
        }
        match &self.ln_f {
            Some(ln_f) => ln_f.forward(&x),
            None => Ok(x),
        }
    }

    /// The head and the table it reads, on the stage with the head.
    fn head(&self) -> Result<(&LmHead, &Embedding)> {
        match (&self.lm_head, &self.wte) {
            (Some(head), Some(wte)) => Ok((head, wte)),
            _ => meshgrad_tensor::bail!(
                "gpt stage ({}): has no head (only the last stage computes logits and the loss)",
                self.spec
            ),
        }
    }

    /// Logits `[B, T, vocab]` on the stage with the head (under tensor parallelism, this rank's
    /// vocabulary slice `[B, T, vocab / tp]`): the tied projection x wteᵀ as a fused linear,
    /// whose weight gradient comes out in wte's layout.
    pub fn logits(&self, input: StageInput<'_>) -> Result<Var> {
        let (head, wte) = self.head()?;
        head.forward(&self.hidden(input)?, &wte.weight)
    }

    /// Logits `[B, T, vocab]` of token ids `[B, T]` (the whole model, or any stage with the
    /// embedding and the head; under tensor parallelism, this rank's vocabulary slice). Dropout
    /// masks follow the current [`ForwardCtx`](meshgrad_autograd::ForwardCtx).
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        self.logits(StageInput::Ids(ids))
    }

    /// Mean next-token cross-entropy against `targets [B, T]` (targets equal to `ignore_index`
    /// skipped) on the stage with the head, from `input`.
    pub fn stage_loss(
        &self,
        input: StageInput<'_>,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Var> {
        let (head, _) = self.head()?;
        input_checks::check_targets("gpt", targets)?;
        let logits = self.logits(input)?;
        input_checks::check_target_rows("gpt", targets, logits.tensor().dims()[0])?;
        head.loss(&logits, targets, ignore_index)
    }

    /// Mean next-token cross-entropy of `ids [B, T]` against `targets [B, T]` (targets equal to
    /// `ignore_index` skipped): the whole model's loss.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        check_ids(&self.config, ids)?;
        input_checks::check_targets_match_ids("gpt", targets, ids)?;
        self.stage_loss(StageInput::Ids(ids), targets, ignore_index)
    }

    /// Continues `prompt` (token ids) by `max_new` tokens: greedy when `temperature == 0`, else
    /// sampling from `softmax(logits / temperature)` (optionally restricted to the `top_k` most
    /// likely tokens) with the counter-based draw `(seed, position)`. The context is cropped to
    /// the last `block_size` tokens; dropout is off while it runs.
    ///
    /// `on_token` is called with each new token as soon as it is chosen (to stream the output);
    /// an error from it stops the generation and is returned. Pass `|_| Ok(())` to only collect
    /// the tokens.
    ///
    /// Only ids below [`Gpt::sampled_vocab`] are prompted or sampled (a padded vocabulary's
    /// extra ids never are).
    ///
    /// Errors: a model that is not whole, or whose logits are split over tensor-parallel ranks;
    /// an empty prompt or a token outside the vocabulary; a `temperature` that is not a finite
    /// number >= 0; `top_k` of `Some(0)`; logits that are not finite (NaN or infinite), naming
    /// the step (1-based).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
        on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        input_checks::check_generate("gpt", (&self.spec, self.is_full()), || Ok(self.head()?.0))?;
        let sampling = Sampling {
            temperature,
            top_k,
            seed,
        };
        let was_training = self.drop.as_ref().is_some_and(Dropout::is_training);
        self.set_training(false);
        let r = generation::generate(self, prompt, max_new, sampling, on_token);
        self.set_training(was_training);
        r
    }
}

impl ModelStage for Gpt {
    type Batch = GptBatch;

    fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// `wte.weight`, which the head reads.
    fn tied_table(&self) -> Option<&'static str> {
        Some(TABLE)
    }

    /// Hidden states, or the loss of `batch.targets` on the stage with the head.
    fn forward_stage(&self, batch: &GptBatch, hidden: Option<&Var>) -> Result<Var> {
        let input = match hidden {
            Some(h) => StageInput::Hidden(h),
            None => StageInput::Ids(&batch.ids),
        };
        if self.spec.head {
            self.stage_loss(input, &batch.targets, batch.ignore_index)
        } else {
            self.hidden(input)
        }
    }
}

/// Checks token ids `[B, T]` against the config, returning `(B, T)`.
fn check_ids(config: &GptConfig, ids: &Tensor) -> Result<(usize, usize)> {
    input_checks::check_ids("gpt", ids, (config.block_size, "block_size"))
}

/// Blocks `range` (global indices; only their names, given by the model tree, depend on them).
fn new_blocks(p: &ParamBuilder, bc: BlockConfig, range: Range<usize>) -> Result<Vec<Arc<Block>>> {
    range.map(|_| Block::new(p, bc).map(Arc::new)).collect()
}

/// Token + position embeddings of ids `[B, T]` (under context parallelism this rank's chunks,
/// at their global positions), then the embedding dropout.
fn embed(
    wte: &Embedding,
    wpe: &Embedding,
    drop: &Dropout,
    ids: &Tensor,
    cp: Option<&ContextParallel>,
) -> Result<Var> {
    let t = ids.dims()[1];
    let pos = match cp {
        Some(cp) => cp.positions(t, ids.device())?,
        None => Tensor::arange(0, t as i64, DType::I64, ids.device())?,
    };
    let x = wte.forward(ids)?.add(&wpe.forward(&pos)?)?;
    drop.forward(&x)
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
