//! Reference mode under tensor parallelism: which tensor-parallel layouts it covers, and the
//! exact gradient norm over split parameters.
//!
//! The layers compute every sum that tensor parallelism splits as a tree over `K` chunks
//! ([`meshgrad_nn::tp::reference`]), where `K` ([`reference_chunks`]) depends only on the model:
//! a single-device reference run computes the same chunked sums with a group of one rank. A
//! tensor-parallel degree `T` must then be a power of two dividing `K`, so that each rank holds
//! an aligned block of `K / T` chunks, whose subtree the group's all-reduce (the aligned tree
//! over its ranks) completes.

use anyhow::Result;
use meshgrad_autograd::distributed::exact_sum_over_placements;
use meshgrad_autograd::Var;
use meshgrad_nn::gpt::reference_chunks;
use meshgrad_parallel::ParallelLayout;
use meshgrad_tensor::exact_sum::ExactSum;

use crate::config::TrainConfig;
use crate::train::gpt_config;

/// A one-line reason reference mode cannot run the tensor-parallel degree of `layout`, or `Ok`.
pub(crate) fn check_tp(cfg: &TrainConfig, layout: &ParallelLayout) -> Result<()> {
    let tp = layout.tp();
    if tp <= 1 {
        return Ok(());
    }
    let k = reference_chunks(&gpt_config(cfg));
    if !tp.is_power_of_two() || !k.is_multiple_of(tp) {
        let m = &cfg.model;
        anyhow::bail!(
            "reference mode: tp = {tp} (layout {layout}) must be a power of two dividing the \
             model's {k} reference chunk(s) (the largest power of two dividing n_head {}, \
             vocab_size {} and block_size {}), so that each rank holds whole chunks of every \
             split sum",
            m.n_head,
            m.vocab_size,
            m.block_size
        );
    }
    Ok(())
}

/// The squares of every gradient element of `params`, as an order-free [`ExactSum`]; parameters
/// split by tensor parallelism are combined over their group (each element counted once,
/// replicated parameters once). A collective over the tensor-parallel group when there is one.
pub(crate) fn exact_grad_squares(params: &[Var]) -> Result<ExactSum> {
    let mut items = Vec::with_capacity(params.len());
    for p in params {
        if let Some(g) = p.grad() {
            let mut s = ExactSum::new();
            s.add_squares(&g)?;
            items.push((p.placement(), s));
        }
    }
    Ok(exact_sum_over_placements(items)?)
}
