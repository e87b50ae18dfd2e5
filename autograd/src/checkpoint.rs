//! Activation checkpointing: keep only a block's inputs, recompute its forward during backward.

use std::sync::Arc;

use meshgrad_tensor::Result;

use crate::{engine, forward_ctx, grad_mode, Var};

/// A block whose forward can be re-run.
pub type BlockFn = Arc<dyn Fn(&[Var]) -> Result<Var> + Send + Sync>;

/// Runs `f(inputs)` without storing its intermediate activations; during backward the forward
/// is recomputed with recording on and differentiated. Gradients reach the inputs and every
/// gradient-requiring leaf (parameter) that `f` uses, as without checkpointing. `f` must be
/// deterministic given its inputs and the [`ForwardCtx`](crate::ForwardCtx): the context and its
/// use counters are saved when the block first runs and replayed when it is recomputed, so
/// counter-based dropout draws the same masks both times.
pub fn checkpoint(f: BlockFn, inputs: &[Var]) -> Result<Var> {
    let detached: Vec<Var> = inputs.iter().map(|v| v.detach()).collect();
    let ctx_state = forward_ctx::snapshot();
    let (out, params) = grad_mode::collect_leaves(|| f(&detached));
    let out = out?;
    if !grad_mode::is_enabled() {
        return Ok(out);
    }
    let mut all_inputs: Vec<&Var> = inputs.iter().collect();
    all_inputs.extend(params.iter());
    let n_in = inputs.len();
    let needs: Vec<bool> = inputs.iter().map(|v| v.requires_grad()).collect();
    let saved_inputs: Vec<_> = inputs.iter().map(|v| v.tensor().clone()).collect();
    let params_c = params.clone();
    Ok(Var::from_op(
        "checkpoint",
        out.tensor().clone(),
        &all_inputs,
        Box::new(move |g, _| {
            // Fresh leaves stand in for the inputs; parameters are used as themselves.
            let leaves: Vec<Var> = saved_inputs
                .iter()
                .zip(&needs)
                .map(|(t, &n)| {
                    if n {
                        Var::leaf(t.clone())
                    } else {
                        Var::constant(t.clone())
                    }
                })
                .collect();
            let out =
                forward_ctx::replay(ctx_state.clone(), || grad_mode::enable_grad(|| f(&leaves)))?;
            if !out.requires_grad() {
                return Ok(vec![None; n_in + params_c.len()]);
            }
            let mut wrt: Vec<Var> = leaves;
            wrt.extend(params_c.iter().cloned());
            engine::grad(&[(out, g.clone())], &wrt)
        }),
    ))
}
