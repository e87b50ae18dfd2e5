//! Reference mode under tensor parallelism (GPT and BERT): the chunk count its layers use and
//! which tensor-parallel layouts it covers (split parameters join the exact gradient norm through
//! `meshgrad_autograd::distributed::exact_grad_squares`).
//!
//! The layers compute every sum that tensor parallelism splits as a tree over `K` chunks
//! ([`meshgrad_nn::tp::reference`]), where `K` ([`reference_chunks`]) depends only on the model:
//! a single-device reference run computes the same chunked sums with a group of one rank. A
//! tensor-parallel degree `T` must then be a power of two dividing `K`, so that each rank holds
//! an aligned block of `K / T` chunks, whose subtree the group's all-reduce (the aligned tree
//! over its ranks) completes.

use anyhow::Result;
use meshgrad_nn::tp::{TensorParallel, TpPlan};
use meshgrad_nn::{Module, ParamBuilder};
use meshgrad_parallel::ParallelLayout;

use crate::config::TrainConfig;

/// The model's own reference chunk count ([`meshgrad_nn::gpt::reference_chunks`],
/// [`meshgrad_nn::bert::reference_chunks`]) and the sizes it is taken over, for messages.
fn model_chunks(cfg: &TrainConfig) -> (usize, String) {
    let m = &cfg.model;
    if m.kind == crate::config::ModelKind::Llama {
        let c = crate::model_configs::llama_config(cfg);
        return (
            meshgrad_nn::llama::reference_chunks(&c),
            format!(
                "n_head {}, n_kv_head {}, intermediate_size {}, the vocabulary {} and \
                 block_size {}",
                c.n_head, c.n_kv_head, c.intermediate_size, c.vocab_size, c.n_positions
            ),
        );
    }
    if m.kind == crate::config::ModelKind::Bert {
        let c = crate::model_configs::bert_config(cfg);
        (
            meshgrad_nn::bert::reference_chunks(&c, m.block_size),
            format!(
                "num_attention_heads {}, intermediate_size {}, the vocabulary {} and block_size {}",
                c.num_attention_heads, c.intermediate_size, c.vocab_size, m.block_size
            ),
        )
    } else {
        let c = crate::model_configs::gpt_config(cfg);
        (
            meshgrad_nn::gpt::reference_chunks(&c),
            format!(
                "n_head {}, the vocabulary {} and block_size {}",
                c.n_head, c.vocab_size, c.block_size
            ),
        )
    }
}

/// The chunk count reference mode's layers use for `cfg`: `train.reference_chunks`, or when
/// that is 0 the model's own (the largest power of two dividing the sizes its chunked sums
/// split: see [`meshgrad_nn::gpt::reference_chunks`], [`meshgrad_nn::bert::reference_chunks`]).
/// `None` outside reference mode or when the count is 1 (no chunked sums: the plain layers, and
/// no tensor parallelism).
pub(crate) fn chunk_count(cfg: &TrainConfig) -> Option<usize> {
    if !cfg.train.reference {
        return None;
    }
    let k = match cfg.train.reference_chunks {
        0 => model_chunks(cfg).0,
        k => k,
    };
    (k > 1).then_some(k)
}

/// A one-line reason reference mode cannot run the chunk count or the tensor-parallel degree of
/// `layout`, or `Ok`.
pub(crate) fn check_tp(cfg: &TrainConfig, layout: Option<&ParallelLayout>) -> Result<()> {
    let (model_k, sizes) = model_chunks(cfg);
    let set = cfg.train.reference_chunks;
    if set != 0 && (!set.is_power_of_two() || !model_k.is_multiple_of(set)) {
        anyhow::bail!(
            "reference mode: train.reference_chunks {set} must be 0 (the model's {model_k}) or a \
             power of two dividing {model_k}, the largest power of two dividing {sizes}"
        );
    }
    let tp = layout.map_or(1, |l| l.tp());
    if tp <= 1 {
        return Ok(());
    }
    let layout = layout.expect("tp > 1 comes from a layout");
    let k = chunk_count(cfg).unwrap_or(1);
    if !tp.is_power_of_two() || !k.is_multiple_of(tp) {
        let pad = if model_k < tp {
            format!(
                "; pad the vocabulary with --set model.vocab_multiple={} if it is what limits it",
                tp.next_power_of_two()
            )
        } else {
            String::new()
        };
        anyhow::bail!(
            "reference mode: tp = {tp} (layout {layout}) must be a power of two dividing the \
             {k} reference chunk(s) (train.reference_chunks {}; the model allows up to {model_k}, \
             the largest power of two dividing {sizes}), so that each rank holds whole chunks of \
             every split sum{pad}",
            cfg.train.reference_chunks,
        );
    }
    Ok(())
}

/// Builds a model or a pipeline stage through `builder` with its tensor-parallel `plan`: over
/// `tp` when given (in reference mode with [`chunk_count`]'s chunked sums), and in reference
/// mode on one device with the same chunked sums over a group of one rank
/// ([`TensorParallel::single_device`]); in reference mode's folded position order, with the
/// builder's context-parallel group's [`FoldedPositions`](meshgrad_autograd::distributed::FoldedPositions).
pub(crate) fn build_with_plan<M: Module>(
    cfg: &TrainConfig,
    builder: ParamBuilder,
    tp: Option<TensorParallel>,
    plan: TpPlan,
    build: impl FnOnce(ParamBuilder) -> meshgrad_tensor::Result<M>,
) -> Result<M> {
    let reference = chunk_count(cfg);
    // Reference mode's folded position order comes with the context-parallel group.
    let folded = builder
        .context_parallel_group()
        .and_then(|cp| cp.folded().cloned());
    match tp {
        Some(tp) => Ok(build(
            builder.tensor_parallel(tp.reference(reference).folded(folded), plan),
        )?),
        None => {
            let model = build(builder)?;
            if let Some(k) = reference {
                plan.apply(&model, &TensorParallel::single_device(k).folded(folded))?;
            }
            Ok(model)
        }
    }
}
