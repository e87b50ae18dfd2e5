//! The MLM head (`cls`): [`BertOnlyMLMHead`] (the transform and the decoder over the tied
//! word-embedding table) and the masked-LM loss over the labelled tokens ([`IGNORE_INDEX`]).

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, GeluKind, Result, Tensor};

use super::BertConfig;
use crate::layers::{LayerNorm, Linear, LinearConfig, LmHead};
use crate::module::{Child, Forward, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::tp::{ParallelStyle, TensorParallel};

/// The label of tokens that take no part in the loss (PyTorch's `CrossEntropyLoss` default).
pub const IGNORE_INDEX: i64 = -100;

/// `dense`, exact GELU, `LayerNorm` (`cls.predictions.transform`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertPredictionHeadTransform {
    /// `[hidden, hidden]`.
    pub dense: Linear,
    /// Norm after the activation.
    #[module(rename = "LayerNorm")]
    pub layer_norm: LayerNorm,
}

/// The transform and the output bias of the MLM head (`cls.predictions`); the decoder weight
/// is the word-embedding table.
///
/// Its tensor-parallel style is [`ParallelStyle::VocabHead`]: `bias` is split by vocabulary like
/// the (tied) table and the logits and loss stay split (the `decoder` carries the style).
pub struct BertLMPredictionHead {
    /// `cls.predictions.transform`.
    pub transform: BertPredictionHeadTransform,
    /// `[vocab_size]`: the decoder's bias (this rank's `[vocab_size / tp]` under tensor
    /// parallelism).
    pub bias: Var,
    /// The decoder over the word-embedding table (owns no parameters; not a named child).
    pub decoder: LmHead,
}

impl Module for BertLMPredictionHead {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        f("transform", Child::Module(&self.transform));
        f("bias", Child::Param(&self.bias));
    }
    fn module_type(&self) -> &'static str {
        "BertLMPredictionHead"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        self.decoder.parallelize(path, style, tp)
    }
}

/// The MLM head (`cls`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertOnlyMLMHead {
    /// `cls.predictions`.
    pub predictions: BertLMPredictionHead,
}

impl BertOnlyMLMHead {
    pub(super) fn new(p: &ParamBuilder, c: &BertConfig) -> Result<Self> {
        Ok(BertOnlyMLMHead {
            predictions: BertLMPredictionHead {
                transform: BertPredictionHeadTransform {
                    dense: LinearConfig::new(c.hidden_size, c.hidden_size)
                        .std(c.initializer_range)
                        .build(p)?,
                    layer_norm: LayerNorm::new(p, c.hidden_size, true, c.layer_norm_eps)?,
                },
                bias: p.param(c.vocab_size, Init::Zeros)?,
                decoder: LmHead::new(),
            },
        })
    }

    /// MLM logits of the final hidden states `x`: the transform (dense, exact GELU,
    /// `LayerNorm`), then the decoder over the word-embedding table `table` with
    /// `cls.predictions.bias` (under tensor parallelism, this rank's vocabulary slice).
    pub(super) fn logits(&self, x: &Var, table: &Var) -> Result<Var> {
        let p = &self.predictions;
        let h = p.transform.dense.forward(x)?.gelu(GeluKind::Erf)?;
        let h = p.transform.layer_norm.forward(&h)?;
        p.decoder.forward_with_bias(&h, table, Some(&p.bias))
    }

    /// The summed cross-entropy of `logits` over the labelled tokens of `labels` (`n` of them,
    /// [`count_labels`]) divided by `denominator`, which the caller has checked to be positive
    /// (see [`BertForMaskedLM::loss_over`](crate::bert::BertForMaskedLM::loss_over)).
    pub(super) fn loss(
        &self,
        logits: &Var,
        labels: &Tensor,
        n: usize,
        denominator: f64,
    ) -> Result<Var> {
        let labels = labels.to_dtype(DType::I64)?;
        // Under tensor parallelism the logits are this rank's vocabulary slice and the loss is
        // loss-parallel (the full logits are never gathered).
        let mean = self
            .predictions
            .decoder
            .loss(logits, &labels, Some(IGNORE_INDEX))?;
        // The op's mean is over the n labelled rows (0 when there are none).
        mean.mul_scalar(n as f64 / denominator)
    }
}

/// Checks labels `[B, T]` against `c` (integers, each [`IGNORE_INDEX`] or a token id); returns
/// how many are not ignored.
pub(super) fn count_labels(c: &BertConfig, labels: &Tensor) -> Result<usize> {
    if !labels.dtype().is_int() || labels.rank() != 2 {
        meshgrad_tensor::bail!(
            "bert: labels must be an integer tensor [B, T], got {} of {}",
            labels.shape(),
            labels.dtype()
        );
    }
    let v = c.vocab_size as i64;
    let mut n = 0;
    for (i, &l) in labels
        .to_dtype(DType::I64)?
        .to_vec::<i64>()?
        .iter()
        .enumerate()
    {
        if l == IGNORE_INDEX {
            continue;
        }
        if !(0..v).contains(&l) {
            let t = labels.dims()[1];
            meshgrad_tensor::bail!(
                "bert: label {l} at row {}, position {} is neither {IGNORE_INDEX} nor a token id below vocab_size {v}",
                i / t,
                i % t
            );
        }
        n += 1;
    }
    Ok(n)
}
