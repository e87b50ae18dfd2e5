//! Reference mode under tensor parallelism: the chunk count its layers use and which
//! tensor-parallel layouts it covers (split parameters join the exact gradient norm through
//! `meshgrad_autograd::distributed::exact_grad_squares`).
//!
//! The layers compute every sum that tensor parallelism splits as a tree over `K` chunks
//! ([`meshgrad_nn::tp::reference`]), where `K` ([`reference_chunks`]) depends only on the model:
//! a single-device reference run computes the same chunked sums with a group of one rank. A
//! tensor-parallel degree `T` must then be a power of two dividing `K`, so that each rank holds
//! an aligned block of `K / T` chunks, whose subtree the group's all-reduce (the aligned tree
//! over its ranks) completes.

use anyhow::Result;
use meshgrad_nn::gpt::reference_chunks;
use meshgrad_parallel::ParallelLayout;

use crate::config::TrainConfig;
use crate::train::gpt_config;

/// The chunk count reference mode's layers use for `cfg` (a GPT): `train.reference_chunks`, or
/// when that is 0 the model's own ([`reference_chunks`]). `None` outside reference mode or when
/// the count is 1 (no chunked sums: the plain layers, and no tensor parallelism).
pub(crate) fn chunk_count(cfg: &TrainConfig) -> Option<usize> {
    if !cfg.train.reference {
        return None;
    }
    let k = match cfg.train.reference_chunks {
        0 => reference_chunks(&gpt_config(cfg)),
        k => k,
    };
    (k > 1).then_some(k)
}

/// A one-line reason reference mode cannot run the chunk count or the tensor-parallel degree of
/// `layout`, or `Ok`.
pub(crate) fn check_tp(cfg: &TrainConfig, layout: Option<&ParallelLayout>) -> Result<()> {
    let model_k = reference_chunks(&gpt_config(cfg));
    let set = cfg.train.reference_chunks;
    if set != 0 && (!set.is_power_of_two() || !model_k.is_multiple_of(set)) {
        anyhow::bail!(
            "reference mode: train.reference_chunks {set} must be 0 (the model's {model_k}) or a \
             power of two dividing {model_k}, the largest power of two dividing n_head, \
             vocab_size and block_size"
        );
    }
    let tp = layout.map_or(1, |l| l.tp());
    if tp <= 1 {
        return Ok(());
    }
    let layout = layout.expect("tp > 1 comes from a layout");
    let k = chunk_count(cfg).unwrap_or(1);
    if !tp.is_power_of_two() || !k.is_multiple_of(tp) {
        let m = &cfg.model;
        anyhow::bail!(
            "reference mode: tp = {tp} (layout {layout}) must be a power of two dividing the \
             {k} reference chunk(s) (train.reference_chunks {}; the model allows up to {model_k}, \
             the largest power of two dividing n_head {}, vocab_size {} and block_size {}), so \
             that each rank holds whole chunks of every split sum",
            cfg.train.reference_chunks,
            m.n_head,
            m.vocab_size,
            m.block_size
        );
    }
    Ok(())
}
