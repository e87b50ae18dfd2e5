//! Tensor parallelism for BERT (see the [`crate::bert`] docs): the plan of the whole model and
//! of a stage, and the size checks.

use meshgrad_tensor::Result;

use super::{BertConfig, BertForMaskedLM};
use crate::stage::StageSpec;
use crate::tp::{ParallelStyle, TpPlan};

impl BertForMaskedLM {
    /// The tensor-parallel plan of the whole model (see the [module docs](crate::bert)):
    /// query/key/value and the feed-forward up-projection column-parallel (split by heads / by
    /// features), both output projections row-parallel, the word embeddings and the tied MLM
    /// decoder with its bias split by vocabulary (loss-parallel cross-entropy), and the
    /// post-residual norms and dropouts sequence-parallel, the region starting at
    /// `embeddings.LayerNorm` and running through the MLM-head transform.
    pub fn tp_plan() -> TpPlan {
        let layer = |s: &str| format!("bert.encoder.layer.*.{s}");
        TpPlan::new()
            .with(
                "bert.embeddings.word_embeddings",
                ParallelStyle::VocabEmbedding,
            )
            .with("bert.embeddings.LayerNorm", ParallelStyle::SequenceSplit)
            .with("bert.embeddings.dropout", ParallelStyle::SequenceParallel)
            .with(
                layer("attention.self.query"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(
                layer("attention.self.key"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(
                layer("attention.self.value"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(layer("attention.output.dense"), ParallelStyle::Rowwise)
            .with(
                layer("attention.output.dropout"),
                ParallelStyle::SequenceParallel,
            )
            .with(
                layer("attention.output.LayerNorm"),
                ParallelStyle::SequenceParallel,
            )
            .with(
                layer("intermediate.dense"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(layer("output.dense"), ParallelStyle::Rowwise)
            .with(layer("output.dropout"), ParallelStyle::SequenceParallel)
            .with(layer("output.LayerNorm"), ParallelStyle::SequenceParallel)
            .with(
                "cls.predictions.transform.dense",
                ParallelStyle::SequenceParallel,
            )
            .with(
                "cls.predictions.transform.LayerNorm",
                ParallelStyle::SequenceParallel,
            )
            .with("cls.predictions", ParallelStyle::VocabHead)
    }

    /// The part of [`BertForMaskedLM::tp_plan`] that applies to the modules of the stage `spec`
    /// (for [`StageSpec::full`], the whole plan): the word embeddings on the stages with the
    /// embeddings or the head, the rest of `bert.embeddings` on the stage with the embeddings,
    /// `cls` on the stage with the head, the layer entries everywhere.
    pub fn stage_tp_plan(spec: &StageSpec) -> TpPlan {
        let holds = |pattern: &str| {
            if pattern == "bert.embeddings.word_embeddings" {
                spec.embedding || spec.head
            } else if pattern.starts_with("bert.embeddings") {
                spec.embedding
            } else if pattern.starts_with("cls") {
                spec.head
            } else {
                true
            }
        };
        BertForMaskedLM::tp_plan()
            .entries()
            .iter()
            .filter(|(p, _)| holds(p))
            .fold(TpPlan::new(), |plan, (p, s)| plan.with(p.clone(), *s))
    }

    /// Checks that the sizes split over `tp` ranks, with one line naming them; `sequence` is the
    /// training sequence length when sequence parallelism is on.
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }
}

/// The tensor-parallel size checks of [`BertForMaskedLM::check_tensor_parallel`]: the heads,
/// the hidden and intermediate widths and the vocabulary must split over `tp` ranks (and the
/// sequence length, with sequence parallelism); the error is one line naming the size.
pub fn check_tp_sizes(c: &BertConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
    crate::tp::check_split_sizes(
        "bert",
        tp,
        &[
            ("num_attention_heads", c.num_attention_heads),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
        ],
        sequence,
    )
}

/// Reference mode's chunk count `K` for a BERT of config `c` trained on sequences of
/// `sequence` positions (see [`crate::tp::reference`]): the largest power of two dividing the
/// heads, the intermediate width, the vocabulary and the sequence length (so also the hidden
/// width). It depends only on the model and the sequence length, never on the layout.
pub fn reference_chunks(c: &BertConfig, sequence: usize) -> usize {
    crate::tp::largest_common_power_of_two(&[
        c.num_attention_heads,
        c.intermediate_size,
        c.vocab_size,
        sequence,
    ])
}
