//! [`Llama`]: a Llama model or a stage of one (the whole model is the stage of every layer with
//! the embedding and the head), its tensor-parallel plan and its checks.

use std::ops::Range;
use std::sync::Arc;

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

use super::block::LlamaDecoderLayer;
use super::LlamaConfig;
use crate::generation::{self, Sampling};
use crate::gpt::GptBatch;
use crate::input_checks;
use crate::layers::{Embedding, LmHead, RmsNorm, SequenceEntry};
use crate::module::{Child, Forward, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::stage::{BlockRange, ModelStage, StageInput, StageSpec};
use crate::tp::{ParallelStyle, TensorParallel, TpPlan};

/// One microbatch as every stage of a [`Llama`] reads it: token ids (the stage with the
/// embedding), next-token targets and the ignore index (the stage with the head). The same type
/// as GPT's, so one data path feeds both.
pub type LlamaBatch = GptBatch;

/// The name of the token table, which the head reads when the embeddings are tied.
const TABLE: &str = "model.embed_tokens.weight";

/// The decoder stack (`model`): the token table, the layers under their global indices, the
/// final norm.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct LlamaBody {
    /// Token embeddings `[vocab, C]`: with the embedding, and on the stage with the head when
    /// the head is tied to them (there only read by the head).
    pub embed_tokens: Option<Embedding>,
    /// Where a sequence-parallel region begins (after the embedding; no parameters).
    pub sequence_entry: Option<SequenceEntry>,
    /// The decoder layers, named by global index (`model.layers.{i}`).
    pub layers: BlockRange<LlamaDecoderLayer>,
    /// The final norm (with the head).
    pub norm: Option<RmsNorm>,
}

/// The output head (`lm_head`): logits over the vocabulary from its own `weight` `[vocab, C]`
/// (untied), or from the token table (tied: no parameter here), and the loss.
///
/// Its tensor-parallel style is [`ParallelStyle::VocabHead`]: the weight is split by vocabulary,
/// the logits and the loss stay split.
pub struct LlamaHead {
    /// The head's own table `[vocab, C]` when the embeddings are untied.
    pub weight: Option<Var>,
    /// The projection and loss over the table (owns no parameters; not a named child).
    pub head: LmHead,
}

impl Module for LlamaHead {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        if let Some(w) = &self.weight {
            f("weight", Child::Param(w));
        }
    }
    fn module_type(&self) -> &'static str {
        "LlamaHead"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        self.head.parallelize(path, style, tp)
    }
}

/// A Llama (Hugging Face `LlamaForCausalLM`): token embeddings, pre-RMSNorm decoder layers with
/// grouped-query attention, rotary position embeddings and a SwiGLU MLP, a final RMSNorm and an
/// output head, untied or tied to the embeddings. No biases, no dropout.
///
/// **One type for the model and its stages.** A `Llama` holds the part of the model its
/// [`StageSpec`] names: layers `spec.blocks` (global indices), with the embedding when
/// `spec.embedding` and the final norm and head when `spec.head`. [`Llama::new`] builds the
/// whole model, the stage [`StageSpec::full`]; [`Llama::new_stage`] any other. Every part is
/// created under the whole model's name and initialised from `(seed, name)`, so a stage's
/// parameters are the whole model's, value for value, and a chain of stages
/// ([`crate::run_chained`]) computes the whole model's loss and gradients bit for bit.
///
/// **Names** are Hugging Face's, so a state dict maps one to one: `model.embed_tokens.weight`,
/// `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
/// `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.input_layernorm.weight`,
/// `model.layers.{i}.post_attention_layernorm.weight`, `model.norm.weight`, `lm_head.weight`
/// (absent when tied). Initialisation is Hugging Face's: every linear and the tables N(0, 0.02),
/// norms one.
///
/// **The tied head.** With `tie_embeddings` the head reads `model.embed_tokens.weight`. A stage
/// with the head but not the embedding then holds its own copy of the table (only read by the
/// head); the copies are one parameter ([`ModelStage::tied_parameters`]): their gradients are
/// summed and they take the same update.
///
/// ```
/// use meshgrad_nn::llama::{Llama, LlamaConfig};
/// use meshgrad_tensor::{DType, Device, Tensor};
///
/// let mut config = LlamaConfig::new(64, 16, 32, 2, 4);
/// config.n_kv_head = 2; // grouped-query attention: two query heads per kv head
/// config.intermediate_size = 48;
/// let model = Llama::new(config, 7, DType::F32, Device::Cpu)?;
/// let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], (1, 4), Device::Cpu)?;
/// let targets = Tensor::from_vec(vec![5u32, 9, 2, 7], (1, 4), Device::Cpu)?;
/// let loss = model.loss(&ids, &targets, None)?;
/// loss.backward()?;
/// let next = model.generate(&[1, 5], 3, 0.0, None, 0, |_| Ok(()))?;
/// assert_eq!(next.len(), 3);
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct Llama {
    /// Hyper-parameters of the whole model.
    pub config: LlamaConfig,
    /// The part of the model this holds ([`StageSpec::full`] for the whole model).
    pub spec: StageSpec,
    /// The decoder stack (`model.*`).
    pub model: LlamaBody,
    /// The output head (with the head).
    pub lm_head: Option<LlamaHead>,
    /// Recompute each layer's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
    /// The token ids the data uses when the vocabulary is padded (`config.vocab_size` rounded
    /// up for tensor parallelism): [`Llama::generate`] samples only among `0..n` and refuses
    /// prompt ids from `n` on. `None`: every id of `config.vocab_size`.
    pub vocab_in_use: Option<usize>,
}

impl Llama {
    /// The whole model with Hugging Face's initialisation; each parameter's values depend only
    /// on `seed` and its name.
    pub fn new(config: LlamaConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        Llama::build(config, ParamBuilder::new(seed).dtype(dtype).device(device))
    }

    /// The whole model, its parameters created by `builder` (with
    /// [`ParamBuilder::tensor_parallel`] and [`Llama::tp_plan`], this rank's part).
    pub fn build(config: LlamaConfig, builder: ParamBuilder) -> Result<Self> {
        Llama::build_stage(config, StageSpec::full(config.n_layer), builder)
    }

    /// The stage `spec` of the model, every parameter equal to the same-named one of
    /// [`Llama::new`] with the same arguments.
    pub fn new_stage(
        config: LlamaConfig,
        spec: StageSpec,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        Llama::build_stage(
            config,
            spec,
            ParamBuilder::new(seed).dtype(dtype).device(device),
        )
    }

    /// The stage `spec`, its parameters created by `builder`. One-line errors for a config that
    /// does not validate, a spec that does not fit it, and (when `builder` is tensor-parallel)
    /// sizes that do not split over its ranks.
    pub fn build_stage(
        config: LlamaConfig,
        spec: StageSpec,
        builder: ParamBuilder,
    ) -> Result<Self> {
        config.validate()?;
        spec.validate(config.n_layer)
            .map_err(|e| meshgrad_tensor::Error::msg(format!("llama {e}")))?;
        if let Some(tp) = builder.tensor_parallel_group() {
            check_tp_sizes(&config, tp.degree(), None)?;
        }
        let c = config;
        builder.build(|p| {
            let (first, last) = (spec.embedding, spec.head);
            let table = first || (last && c.tie_embeddings);
            Ok(Llama {
                config,
                spec: spec.clone(),
                model: LlamaBody {
                    embed_tokens: table
                        .then(|| Embedding::new(p, c.vocab_size, c.n_embd, 0.02))
                        .transpose()?,
                    sequence_entry: first.then(SequenceEntry::new),
                    layers: BlockRange::new(spec.blocks.start, new_layers(p, &c, &spec.blocks)?),
                    norm: last
                        .then(|| RmsNorm::new(p, c.n_embd, c.norm_eps))
                        .transpose()?,
                },
                lm_head: last
                    .then(|| -> Result<LlamaHead> {
                        Ok(LlamaHead {
                            weight: (!c.tie_embeddings)
                                .then(|| p.param((c.vocab_size, c.n_embd), Init::Normal(0.02)))
                                .transpose()?,
                            head: LmHead::new(),
                        })
                    })
                    .transpose()?,
                activation_checkpointing: false,
                vocab_in_use: None,
            })
        })
    }

    /// The tensor-parallel plan of the stage `spec` of a model of `config` (Megatron-LM's
    /// split): q, k, v and the MLP's gate and up projections column-parallel (each rank holds
    /// `n_head / tp` query heads and `n_kv_head / tp` kv heads), `o_proj` and `down_proj`
    /// row-parallel, the token table and the head split by vocabulary (logits and loss stay
    /// split), the norms sequence-parallel (the region begins after the embedding).
    pub fn tp_plan(config: &LlamaConfig, spec: &StageSpec) -> TpPlan {
        let table = spec.embedding || (spec.head && config.tie_embeddings);
        let mut plan = TpPlan::new();
        if table {
            plan = plan.with("model.embed_tokens", ParallelStyle::VocabEmbedding);
        }
        if spec.embedding {
            plan = plan.with("model.sequence_entry", ParallelStyle::SequenceSplit);
        }
        let col = ParallelStyle::Colwise { chunks: 1 };
        plan = plan
            .with(
                "model.layers.*.input_layernorm",
                ParallelStyle::SequenceParallel,
            )
            .with("model.layers.*.self_attn.q_proj", col)
            .with("model.layers.*.self_attn.k_proj", col)
            .with("model.layers.*.self_attn.v_proj", col)
            .with("model.layers.*.self_attn.o_proj", ParallelStyle::Rowwise)
            .with(
                "model.layers.*.post_attention_layernorm",
                ParallelStyle::SequenceParallel,
            );
        // A mixture of experts (Mixtral) stays whole on every tensor-parallel rank: each runs
        // the router and the experts on the same (replicated) tokens.
        if config.moe.is_none() {
            plan = plan
                .with("model.layers.*.mlp.gate_proj", col)
                .with("model.layers.*.mlp.up_proj", col)
                .with("model.layers.*.mlp.down_proj", ParallelStyle::Rowwise);
        }
        if spec.head {
            plan = plan
                .with("model.norm", ParallelStyle::SequenceParallel)
                .with("lm_head", ParallelStyle::VocabHead);
        }
        plan
    }

    /// Checks that the sizes split over `tp` ranks, with one line naming them (heads, kv heads,
    /// MLP width, vocabulary); `sequence` is the training sequence length under sequence
    /// parallelism.
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }

    /// Whether this is the whole model (every layer, the embedding and the head).
    pub fn is_full(&self) -> bool {
        self.spec == StageSpec::full(self.config.n_layer)
    }

    /// The ids generation samples among: [`Llama::vocab_in_use`] when set (at most
    /// `config.vocab_size`), else the whole vocabulary.
    pub fn sampled_vocab(&self) -> usize {
        self.vocab_in_use
            .map_or(self.config.vocab_size, |n| n.min(self.config.vocab_size))
    }

    /// The output for `input`: the hidden states after the stage's last layer, and after the
    /// final norm on the stage with the head (`[B, T, C]`; under sequence parallelism this
    /// rank's positions `[B, T / tp, C]`, which is also what a later stage takes).
    pub fn hidden(&self, input: StageInput<'_>) -> Result<Var> {
        let m = &self.model;
        let mut x = match input {
            StageInput::Ids(ids) => {
                let (Some(table), Some(entry), true) =
                    (&m.embed_tokens, &m.sequence_entry, self.spec.embedding)
                else {
                    meshgrad_tensor::bail!(
                        "llama stage ({}): takes the previous stage's hidden states [B, T, C], \
                         not token ids (it has no embedding)",
                        self.spec
                    );
                };
                check_ids(&self.config, ids)?;
                entry.forward(&table.forward(ids)?)?
            }
            StageInput::Hidden(h) => {
                if self.spec.embedding {
                    meshgrad_tensor::bail!(
                        "llama stage ({}): holds the embedding and takes token ids [B, T], not \
                         hidden states",
                        self.spec
                    );
                }
                let d = h.tensor().dims();
                if d.len() != 3 || d[2] != self.config.n_embd || d[1] == 0 {
                    meshgrad_tensor::bail!(
                        "llama stage ({}): hidden states must be [B, T, {}], got {}",
                        self.spec,
                        self.config.n_embd,
                        h.tensor().shape()
                    );
                }
                h.clone()
            }
        };
        for layer in m.layers.blocks() {
            x = if self.activation_checkpointing {
                layer.forward_checkpointed(&x)?
            } else {
                layer.forward(&x)?
            };
        }
        match &m.norm {
            Some(norm) => norm.forward(&x),
            None => Ok(x),
        }
    }

    /// The head and the table it reads, on the stage with the head.
    fn head(&self) -> Result<(&LmHead, &Var)> {
        let table = self.lm_head.as_ref().and_then(|h| match &h.weight {
            Some(w) => Some(w),
            None => self.model.embed_tokens.as_ref().map(|e| &e.weight),
        });
        match (&self.lm_head, table) {
            (Some(h), Some(t)) => Ok((&h.head, t)),
            _ => meshgrad_tensor::bail!(
                "llama stage ({}): has no head (only the last stage computes logits and the loss)",
                self.spec
            ),
        }
    }

    /// Logits `[B, T, vocab]` (under tensor parallelism this rank's vocabulary slice) on the
    /// stage with the head.
    pub fn logits(&self, input: StageInput<'_>) -> Result<Var> {
        let (head, table) = self.head()?;
        head.forward(&self.hidden(input)?, table)
    }

    /// Logits `[B, T, vocab]` of token ids `[B, T]` (the whole model, or any stage with the
    /// embedding and the head).
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
        input_checks::check_targets("llama", targets)?;
        let logits = self.logits(input)?;
        input_checks::check_target_rows("llama", targets, logits.tensor().dims()[0])?;
        head.loss(&logits, targets, ignore_index)
    }

    /// Mean next-token cross-entropy of `ids [B, T]` against `targets [B, T]` (targets equal to
    /// `ignore_index` skipped): the whole model's loss.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        check_ids(&self.config, ids)?;
        input_checks::check_targets_match_ids("llama", targets, ids)?;
        self.stage_loss(StageInput::Ids(ids), targets, ignore_index)
    }

    /// Continues `prompt` by `max_new` tokens: greedy when `temperature == 0`, else sampling
    /// from `softmax(logits / temperature)` (optionally among the `top_k` most likely) with the
    /// counter-based draw `(seed, position of the new token)`. The context is cropped to the last
    /// `n_positions` tokens; no dropout is involved (Llama has none). `on_token` sees each new
    /// token as it is chosen (to stream); its error stops the generation.
    ///
    /// Errors: a model that is not whole, or whose logits are split over tensor-parallel ranks;
    /// an empty prompt or a token outside [`Llama::sampled_vocab`]; a `temperature` that is not
    /// a finite number >= 0; `top_k` of `Some(0)`; logits that are not finite.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
        on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        input_checks::check_generate("llama", (&self.spec, self.is_full()), || Ok(self.head()?.0))?;
        let sampling = Sampling {
            temperature,
            top_k,
            seed,
        };
        generation::generate(self, prompt, max_new, sampling, on_token)
    }
}

impl ModelStage for Llama {
    type Batch = LlamaBatch;

    fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// `model.embed_tokens.weight` when the embeddings are tied, else `None`.
    fn tied_table(&self) -> Option<&'static str> {
        self.config.tie_embeddings.then_some(TABLE)
    }

    /// Hidden states, or the loss of `batch.targets` on the stage with the head.
    fn forward_stage(&self, batch: &LlamaBatch, hidden: Option<&Var>) -> Result<Var> {
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

/// Layers `range` (global indices; only their names, given by the model tree, depend on them).
fn new_layers(
    p: &ParamBuilder,
    c: &LlamaConfig,
    range: &Range<usize>,
) -> Result<Vec<Arc<LlamaDecoderLayer>>> {
    range
        .clone()
        .map(|i| LlamaDecoderLayer::new(p, c, i).map(Arc::new))
        .collect()
}

/// Checks token ids `[B, T]` against the config, returning `(B, T)`.
fn check_ids(config: &LlamaConfig, ids: &Tensor) -> Result<(usize, usize)> {
    input_checks::check_ids("llama", ids, (config.n_positions, "n_positions"))
}

/// The tensor-parallel size checks of [`Llama::check_tensor_parallel`]: query heads, kv heads,
/// MLP width and vocabulary divisible by `tp` (and the sequence, under sequence parallelism).
pub fn check_tp_sizes(c: &LlamaConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
    crate::tp::check_split_sizes(
        "llama",
        tp,
        &[
            ("n_head", c.n_head),
            ("n_kv_head", c.n_kv_head),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
        ],
        sequence,
    )
}

/// Reference mode's chunk count `K` for a Llama of config `c` (see [`crate::tp::reference`]):
/// the largest power of two dividing the query heads, the kv heads, the MLP width, the
/// vocabulary and the context length. It depends only on the model, never on the layout.
pub fn reference_chunks(c: &LlamaConfig) -> usize {
    crate::tp::largest_common_power_of_two(&[
        c.n_head,
        c.n_kv_head,
        c.intermediate_size,
        c.vocab_size,
        c.n_positions,
    ])
}
