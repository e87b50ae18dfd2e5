//! [`BertForMaskedLM`]: a BERT with the MLM head, or a stage of one (the whole model is the stage
//! of every encoder layer with the embeddings and the head), its microbatch [`BertBatch`] and
//! its input checks.

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

use super::embeddings::BertEmbeddings;
use super::head::{count_labels, BertOnlyMLMHead};
use super::layer::{additive_mask, BertEncoder};
use super::tp::check_tp_sizes;
use super::BertConfig;
use crate::param_builder::ParamBuilder;
use crate::stage::{ModelStage, StageInput, StageSpec};

/// The name of the word-embedding table, which the tied decoder reads.
const TABLE: &str = "bert.embeddings.word_embeddings.weight";

/// The encoder without a head (Hugging Face's `BertModel` without the pooler), or a stage's part
/// of it (`bert.`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertModel {
    /// The embeddings (with the embeddings; with the head but not the embeddings only the
    /// word-embedding table, for the tied decoder).
    pub embeddings: Option<BertEmbeddings>,
    /// The encoder layers (a stage's range, named by global index).
    pub encoder: BertEncoder,
}

/// BERT with the masked-language-modelling head (Hugging Face's `BertForMaskedLM`), or a stage
/// of it.
///
/// **One type for the model and its stages.** A `BertForMaskedLM` holds the part of the model
/// its [`StageSpec`] names: encoder layers `spec.blocks` (global indices), with the embeddings
/// (`bert.embeddings`) when `spec.embedding` and the MLM head (`cls`) when `spec.head`.
/// [`BertForMaskedLM::new`] builds the whole model, the stage [`StageSpec::full`];
/// [`BertForMaskedLM::new_stage`] any other (see [`crate::stage`]). Every part is created under
/// the whole model's (Hugging Face's) name (`bert.encoder.layer.2.attention.self.query.weight`
/// in whatever stage holds layer 2), in the whole model's order, with the whole model's values:
/// initialisation is keyed by name (and, under tensor parallelism, by global element index),
/// and the padding row of the word embeddings starts at zero in every copy. Dropout paths are
/// the whole model's too, so a stage run in the
/// [`ForwardCtx`](meshgrad_autograd::ForwardCtx) of the whole model's forward draws its masks,
/// and a chain of stages ([`crate::run_chained`]) computes the whole model's loss and gradients
/// bit for bit. Every stage reads the attention mask of the microbatch ([`BertBatch`]).
///
/// **The tied decoder.** The MLM decoder's weight is the word-embedding table
/// `bert.embeddings.word_embeddings.weight`. A stage with the head that is not also the stage
/// with the embeddings holds its own copy under that name, initialised to the same values
/// (only the decoder reads it). The two copies are one parameter of the model: its gradient is
/// the sum of the copies' gradients, both copies must take that summed gradient and the same
/// update, and a checkpoint stores it once ([`ModelStage::tied_parameters`] names it). The whole
/// model has one table.
///
/// ```
/// use meshgrad_nn::bert::{BertBatch, BertConfig, BertForMaskedLM, IGNORE_INDEX};
/// use meshgrad_nn::{run_chained, ForwardCtx, StageSpec};
/// use meshgrad_tensor::{DType, Device, Tensor};
/// let config = BertConfig {
///     vocab_size: 50, hidden_size: 16, num_hidden_layers: 2, num_attention_heads: 2,
///     intermediate_size: 32, max_position_embeddings: 8, ..BertConfig::default()
/// };
/// let model = BertForMaskedLM::new(config, 0, DType::F32, Device::Cpu)?;
/// let ids = Tensor::from_vec(vec![1u32, 2, 3, 0], (1, 4), Device::Cpu)?;
/// let mask = Tensor::from_vec(vec![1u32, 1, 1, 0], (1, 4), Device::Cpu)?;
/// let logits = model.forward(&ids, Some(&mask), None)?;
/// assert_eq!(logits.tensor().dims(), &[1, 4, 50]);
///
/// // The same model as two stages of one layer each: the same loss (dropout included, in the
/// // same forward context).
/// let labels = vec![IGNORE_INDEX, 7, IGNORE_INDEX, IGNORE_INDEX];
/// let labels = Tensor::from_vec(labels, (1, 4), Device::Cpu)?;
/// let ctx = ForwardCtx::new(0, 0);
/// let loss = ctx.scope(|| model.loss(&ids, Some(&mask), None, &labels))?;
/// let stages = StageSpec::even(2, 2)?
///     .into_iter()
///     .map(|spec| BertForMaskedLM::new_stage(config, spec, 0, DType::F32, Device::Cpu))
///     .collect::<Result<Vec<_>, _>>()?;
/// let batch = BertBatch {
///     ids,
///     attention_mask: Some(mask),
///     token_type_ids: None,
///     labels,
///     denominator: None,
/// };
/// let chained = run_chained(&stages, &batch, ctx)?;
/// assert_eq!(chained.tensor().to_vec_f64()?, loss.tensor().to_vec_f64()?);
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertForMaskedLM {
    /// Hyper-parameters of the whole model.
    pub config: BertConfig,
    /// The part of the model this holds ([`StageSpec::full`] for the whole model).
    pub spec: StageSpec,
    /// `bert.`: the embeddings (or only the tied table) and the layers.
    pub bert: BertModel,
    /// `cls.`: the MLM head (with the head).
    pub cls: Option<BertOnlyMLMHead>,
    /// Recompute each layer's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
}

impl BertForMaskedLM {
    /// The whole model with Hugging Face's initialisation: N(0, initializer_range) weights and
    /// embeddings (the padding token's word-embedding row zero), zero biases, unit norm weights.
    /// Each parameter's values depend only on `seed` and its name.
    pub fn new(config: BertConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        BertForMaskedLM::build(config, ParamBuilder::new(seed).dtype(dtype).device(device))
    }

    /// The whole model, its parameters created by `builder` (its seed, dtype and device; with
    /// [`ParamBuilder::tensor_parallel`] and [`BertForMaskedLM::tp_plan`], this rank's part of a
    /// tensor-parallel model, every value equal to the single-device one). Sizes that do not
    /// split over the tensor-parallel ranks are refused first ([`check_tp_sizes`]).
    pub fn build(config: BertConfig, builder: ParamBuilder) -> Result<Self> {
        BertForMaskedLM::build_stage(config, StageSpec::full(config.num_hidden_layers), builder)
    }

    /// The stage `spec` of the model, every parameter equal to the same-named one of
    /// [`BertForMaskedLM::new`] with the same arguments.
    pub fn new_stage(
        config: BertConfig,
        spec: StageSpec,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        BertForMaskedLM::build_stage(
            config,
            spec,
            ParamBuilder::new(seed).dtype(dtype).device(device),
        )
    }

    /// The stage `spec`, its parameters created by `builder` (with
    /// [`ParamBuilder::tensor_parallel`] and [`BertForMaskedLM::stage_tp_plan`], this rank's part
    /// of the stage's tensor-parallel split; with [`ParamBuilder::delayed_init`], allocated on
    /// first use). One-line errors for a config that does not validate, a spec that does not fit
    /// it and sizes that do not split over the tensor-parallel ranks.
    pub fn build_stage(config: BertConfig, spec: StageSpec, builder: ParamBuilder) -> Result<Self> {
        config.validate()?;
        spec.validate(config.num_hidden_layers)
            .map_err(|e| meshgrad_tensor::Error::msg(format!("bert {e}")))?;
        if let Some(tp) = builder.tensor_parallel_group() {
            check_tp_sizes(&config, tp.degree(), None)?;
        }
        let c = config;
        let model = builder.build(|p| {
            let (first, last) = (spec.embedding, spec.head);
            Ok(BertForMaskedLM {
                config,
                spec: spec.clone(),
                bert: BertModel {
                    embeddings: (first || last)
                        .then(|| BertEmbeddings::new(p, &c, first))
                        .transpose()?,
                    encoder: BertEncoder::new(p, &c, spec.blocks.clone())?,
                },
                cls: last.then(|| BertOnlyMLMHead::new(p, &c)).transpose()?,
                activation_checkpointing: false,
            })
        })?;
        if let Some(table) = model.word_embeddings() {
            zero_padding_row(table, &c)?;
        }
        Ok(model)
    }

    /// Whether this is the whole model (every layer, the embeddings and the head).
    pub fn is_full(&self) -> bool {
        self.spec == StageSpec::full(self.config.num_hidden_layers)
    }

    /// The word-embedding table `[vocab_size, hidden]`, the decoder's weight: on the whole model
    /// and the stages with the embeddings or the head (on a later stage with the head, its copy
    /// of the tied table); `None` on a stage with neither.
    pub fn word_embeddings(&self) -> Option<&Var> {
        self.bert
            .embeddings
            .as_ref()
            .map(|e| &e.word_embeddings.weight)
    }

    /// Whether the model is in training mode (its dropouts drop; see
    /// [`Module::set_training`](crate::Module::set_training)).
    pub fn is_training(&self) -> bool {
        self.first_layer().attention.output.dropout.is_training()
    }

    /// The first of the layers (every stage holds at least one).
    fn first_layer(&self) -> &super::BertLayer {
        &self.bert.encoder.layer.blocks()[0]
    }

    /// The hidden states after the last layer for `input`, with the padding mask
    /// `attention_mask [B, T]` (1 = attend, 0 = padding; any dtype) and `token_type_ids [B, T]`
    /// (type 0 when `None`; read with the embeddings): `[B, T, hidden]` (the MLM head's
    /// transform is not applied). Under sequence parallelism this rank's positions
    /// `[B, T / tp, hidden]`, which is also what a later stage takes. The input is token ids
    /// `[B, T]` (integers) for the whole model or a stage with the embeddings, the previous
    /// stage's hidden states otherwise.
    pub fn hidden_states(
        &self,
        input: StageInput<'_>,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        let x = match input {
            StageInput::Ids(ids) => {
                let embeddings = self.bert.embeddings.as_ref();
                let Some(embeddings) = embeddings.filter(|_| self.spec.embedding) else {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): takes the previous stage's hidden states [B, T, {}], not token ids (it has no embeddings)",
                        self.spec,
                        self.config.hidden_size
                    );
                };
                check_inputs(&self.config, ids, attention_mask, token_type_ids)?;
                embeddings.forward(ids, token_type_ids)?
            }
            StageInput::Hidden(h) => {
                if self.spec.embedding {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): holds the embeddings and takes token ids [B, T], not hidden states",
                        self.spec
                    );
                }
                let d = h.tensor().dims();
                if d.len() != 3 || d[2] != self.config.hidden_size || d[1] == 0 {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): hidden states must be [B, T, {}], got {}",
                        self.spec,
                        self.config.hidden_size,
                        h.tensor().shape()
                    );
                }
                if let Some(m) = attention_mask {
                    if m.rank() != 2 || m.dims()[0] != d[0] {
                        meshgrad_tensor::bail!(
                            "bert stage ({}): attention_mask {} does not match the hidden states {} (need [B, T] with B = {})",
                            self.spec,
                            m.shape(),
                            h.tensor().shape(),
                            d[0]
                        );
                    }
                }
                h.clone()
            }
        };
        let like = self
            .first_layer()
            .attention
            .self_attention
            .query
            .weight
            .tensor();
        let mask = attention_mask.map(|m| additive_mask(m, like)).transpose()?;
        self.bert
            .encoder
            .forward(x, mask.as_ref(), self.activation_checkpointing)
    }

    /// The MLM head and the table its decoder reads, on the whole model or the stage with the
    /// head.
    fn head(&self) -> Result<(&BertOnlyMLMHead, &Var)> {
        match (&self.cls, self.word_embeddings()) {
            (Some(cls), Some(table)) => Ok((cls, table)),
            _ => meshgrad_tensor::bail!(
                "bert stage ({}): has no MLM head (only the last stage computes logits and the loss)",
                self.spec
            ),
        }
    }

    /// MLM logits `[B, T, vocab_size]` for `input` (see [`BertForMaskedLM::hidden_states`]) on
    /// the whole model or the stage with the head: the transform (dense, exact GELU,
    /// `LayerNorm`), then the decoder over the word-embedding table with `cls.predictions.bias`.
    /// Under tensor parallelism this rank's vocabulary slice `[B, T, vocab_size / tp]`.
    pub fn logits(
        &self,
        input: StageInput<'_>,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        let (cls, table) = self.head()?;
        cls.logits(
            &self.hidden_states(input, attention_mask, token_type_ids)?,
            table,
        )
    }

    /// MLM logits `[B, T, vocab_size]` for `input_ids [B, T]` (integers), with an optional
    /// `attention_mask [B, T]` (1 = attend, 0 = padding; any dtype) and `token_type_ids [B, T]`
    /// (type 0 when `None`): the whole model, or any stage with the embeddings and the head.
    /// Dropout masks follow the current [`ForwardCtx`](meshgrad_autograd::ForwardCtx). Under
    /// tensor parallelism the logits are this rank's vocabulary slice `[B, T, vocab_size / tp]`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        self.logits(StageInput::Ids(input_ids), attention_mask, token_type_ids)
    }

    /// Checks labels `[B, T]`: integers, each [`IGNORE_INDEX`](super::IGNORE_INDEX) or a token id. Returns how many
    /// are not ignored.
    pub fn count_labels(&self, labels: &Tensor) -> Result<usize> {
        count_labels(&self.config, labels)
    }

    /// The MLM loss of `labels [B, T]` for `input` (see [`BertForMaskedLM::hidden_states`]) on
    /// the whole model or the stage with the head: the summed cross-entropy over the labelled
    /// tokens divided by `denominator`, or by their count when `None` (as
    /// [`BertForMaskedLM::loss_over`] and [`BertForMaskedLM::loss`]).
    pub fn stage_loss(
        &self,
        input: StageInput<'_>,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        labels: &Tensor,
        denominator: Option<f64>,
    ) -> Result<Var> {
        let (cls, _) = self.head()?;
        let n = count_labels(&self.config, labels)?;
        let denominator = denominator.unwrap_or(n.max(1) as f64);
        if !(denominator.is_finite() && denominator > 0.0) {
            meshgrad_tensor::bail!(
                "bert: the loss denominator must be positive, got {denominator}"
            );
        }
        let logits = self.logits(input, attention_mask, token_type_ids)?;
        let d = logits.tensor().dims();
        if labels.dims() != &d[..2] {
            meshgrad_tensor::bail!(
                "bert stage ({}): labels {} do not match the input's [B, T] = [{}, {}]",
                self.spec,
                labels.shape(),
                d[0],
                d[1]
            );
        }
        cls.loss(&logits, labels, n, denominator)
    }

    /// The MLM loss as Hugging Face's `BertForMaskedLM` computes it: the mean cross-entropy of
    /// the logits over the tokens whose label is not -100 ([`IGNORE_INDEX`](super::IGNORE_INDEX)). `labels [B, T]`
    /// must be integers. When every label is -100 the loss is 0 (Hugging Face returns NaN).
    pub fn loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Var> {
        check_labels(input_ids, labels)?;
        self.stage_loss(
            StageInput::Ids(input_ids),
            attention_mask,
            token_type_ids,
            labels,
            None,
        )
    }

    /// The summed cross-entropy over the labelled tokens divided by `denominator`: the share of
    /// these rows in the mean over a larger batch that has `denominator` labelled tokens in all
    /// (split across micro-batches or ranks). With `denominator` equal to this batch's count it
    /// is [`BertForMaskedLM::loss`].
    pub fn loss_over(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        labels: &Tensor,
        denominator: f64,
    ) -> Result<Var> {
        check_labels(input_ids, labels)?;
        self.stage_loss(
            StageInput::Ids(input_ids),
            attention_mask,
            token_type_ids,
            labels,
            Some(denominator),
        )
    }
}

/// One microbatch as every stage of a [`BertForMaskedLM`] reads it: the stage with the
/// embeddings its ids and token types, every stage the attention mask, the stage with the MLM
/// head the labels.
#[derive(Clone, Debug)]
pub struct BertBatch {
    /// Token ids `[B, T]` (integers; read by the stage with the embeddings, and checked against
    /// the other tensors by every stage).
    pub ids: Tensor,
    /// `[B, T]`, 1 = attend, 0 = padding (any dtype); `None` attends everywhere.
    pub attention_mask: Option<Tensor>,
    /// `[B, T]` integer token types; `None` is type 0 everywhere.
    pub token_type_ids: Option<Tensor>,
    /// MLM labels `[B, T]`: a token id, or [`IGNORE_INDEX`](super::IGNORE_INDEX) for tokens outside the loss.
    pub labels: Tensor,
    /// What the summed cross-entropy is divided by: `None` for this microbatch's own count of
    /// labelled tokens (its mean, [`BertForMaskedLM::loss`]); `Some(n)` for the labelled-token
    /// count of the larger batch it is part of ([`BertForMaskedLM::loss_over`]), so that the
    /// microbatches' losses and gradients sum to the larger batch's mean.
    pub denominator: Option<f64>,
}

impl ModelStage for BertForMaskedLM {
    type Batch = BertBatch;

    fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// `bert.embeddings.word_embeddings.weight`, which the decoder reads.
    fn tied_table(&self) -> Option<&'static str> {
        Some(TABLE)
    }

    /// Hidden states, or the MLM loss of `batch.labels` on the stage with the head. Every stage
    /// checks `batch`'s ids, mask and token types against each other (and a later stage its
    /// hidden states' batch against them).
    fn forward_stage(&self, batch: &BertBatch, hidden: Option<&Var>) -> Result<Var> {
        let (mask, types) = (batch.attention_mask.as_ref(), batch.token_type_ids.as_ref());
        let (b, _) = check_inputs(&self.config, &batch.ids, mask, types)?;
        let input = match hidden {
            Some(h) => {
                if h.tensor().rank() == 3 && h.tensor().dims()[0] != b {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): hidden states {} do not match the batch's input_ids {}",
                        self.spec,
                        h.tensor().shape(),
                        batch.ids.shape()
                    );
                }
                StageInput::Hidden(h)
            }
            None => StageInput::Ids(&batch.ids),
        };
        if self.spec.head {
            check_labels(&batch.ids, &batch.labels)?;
            self.stage_loss(input, mask, types, &batch.labels, batch.denominator)
        } else {
            self.hidden_states(input, mask, types)
        }
    }
}

/// Checks that `labels` has the shape of `input_ids`.
fn check_labels(input_ids: &Tensor, labels: &Tensor) -> Result<()> {
    if labels.dims() != input_ids.dims() {
        meshgrad_tensor::bail!(
            "bert: labels {} must match input_ids {}",
            labels.shape(),
            input_ids.shape()
        );
    }
    Ok(())
}

/// Checks the shapes and dtypes of the inputs against `c`; returns `(B, T)`.
fn check_inputs(
    c: &BertConfig,
    ids: &Tensor,
    attention_mask: Option<&Tensor>,
    token_type_ids: Option<&Tensor>,
) -> Result<(usize, usize)> {
    let (b, t) = crate::input_checks::check_ids(
        "bert",
        ids,
        (c.max_position_embeddings, "max_position_embeddings"),
    )?;
    for (name, x) in [
        ("attention_mask", attention_mask),
        ("token_type_ids", token_type_ids),
    ] {
        if let Some(x) = x {
            if x.dims() != ids.dims() {
                meshgrad_tensor::bail!(
                    "bert: {name} has shape {} but input_ids has {}",
                    x.shape(),
                    ids.shape()
                );
            }
        }
    }
    if let Some(tt) = token_type_ids {
        if !tt.dtype().is_int() {
            meshgrad_tensor::bail!("bert: token_type_ids must be integers, got {}", tt.dtype());
        }
    }
    Ok((b, t))
}

/// Zeroes the padding token's row of the word-embedding table `table` (on the rank whose
/// vocabulary slice holds it), as Hugging Face initialises it.
fn zero_padding_row(table: &Var, c: &BertConfig) -> Result<()> {
    let w = table.tensor();
    let rows = match table.placement() {
        Some(p) => p.ranges(c.vocab_size, p.index())[0].clone(),
        None => 0..c.vocab_size,
    };
    if rows.contains(&c.pad_token_id) {
        let zeros = Tensor::zeros((1, c.hidden_size), w.dtype(), w.device())?;
        w.narrow(0, c.pad_token_id - rows.start, 1)?
            .copy_from(&zeros)?;
    }
    Ok(())
}
