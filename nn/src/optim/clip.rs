//! Gradient-norm clipping (PyTorch's `clip_grad_norm_` rule).

use meshgrad_autograd::distributed::sum_over_placements;
use meshgrad_autograd::{no_grad, Var};
use meshgrad_tensor::Result;

/// Sum of the squares of every element of every gradient, in f64: each gradient's sum of squares
/// ([`meshgrad_tensor::Tensor::sqr_sum_f64`]) added in parameter order. Parameters without a
/// gradient contribute nothing. A sharded optimizer all-reduces this value across shards before
/// taking the square root.
///
/// Parameters split across ranks (a [`Placement`](meshgrad_autograd::distributed::Placement),
/// as tensor parallelism records) count every element exactly once: their sums are added over
/// their group (one all-reduce per group, a collective every member calls), while replicated
/// parameters count once.
pub fn grad_sq_sum(params: &[Var]) -> Result<f64> {
    let mut sums = Vec::with_capacity(params.len());
    for p in params {
        if let Some(g) = p.grad() {
            sums.push((p.placement(), g.sqr_sum_f64()?));
        }
    }
    sum_over_placements(sums)
}

/// The global L2 norm of the gradients: `sqrt(grad_sq_sum(params))`.
pub fn grad_norm(params: &[Var]) -> Result<f64> {
    Ok(grad_sq_sum(params)?.sqrt())
}

/// The factor clipping to `max_norm` multiplies the gradients by when their global norm is
/// `total_norm`: `max_norm / (total_norm + 1e-6)` when that is below 1, else 1; also 1 for a
/// `max_norm` of 0 (no clipping). Mixed-precision steps fold it into the optimizer's gradient
/// multiplier instead of scaling the gradients.
pub fn clip_coef(max_norm: f64, total_norm: f64) -> f64 {
    if max_norm > 0.0 {
        (max_norm / (total_norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

/// Scales every gradient (in place, so gradient storage shared with communication buckets stays
/// shared) by `max_norm / (total_norm + 1e-6)` when that factor is below 1, PyTorch's rule
/// (its `clamp(max=1)` of the coefficient). `total_norm` is the pre-clip global norm, computed by
/// the caller (possibly all-reduced across shards). A non-finite `total_norm` scales nothing.
pub fn clip_grads_with_norm(params: &[Var], max_norm: f64, total_norm: f64) -> Result<()> {
    check_max_norm(max_norm)?;
    let coef = max_norm / (total_norm + 1e-6);
    if !total_norm.is_finite() || coef >= 1.0 {
        return Ok(());
    }
    no_grad(|| {
        for p in params {
            if let Some(g) = p.grad() {
                g.copy_from(&g.mul_scalar(coef)?)?;
            }
        }
        Ok(())
    })
}

/// Clips the global L2 norm of the gradients to `max_norm` and returns the norm before
/// clipping: computes [`grad_norm`] (in f64, parameter order), then [`clip_grads_with_norm`].
/// A NaN or infinite norm is returned as is and nothing is scaled; the caller decides what to do
/// (typically skip the step).
pub fn clip_grad_norm(params: &[Var], max_norm: f64) -> Result<f64> {
    check_max_norm(max_norm)?;
    let norm = grad_norm(params)?;
    if norm.is_finite() {
        clip_grads_with_norm(params, max_norm, norm)?;
    }
    Ok(norm)
}

fn check_max_norm(max_norm: f64) -> Result<()> {
    if !max_norm.is_finite() || max_norm <= 0.0 {
        meshgrad_tensor::bail!("clip_grad_norm: max_norm {max_norm} must be finite and > 0");
    }
    Ok(())
}
