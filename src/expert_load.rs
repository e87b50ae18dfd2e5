//! A mixture-of-experts step's load across the ranks: what the layers of this rank recorded
//! during the step's forwards ([`meshgrad_nn::moe::collect_expert_load`]), summed over the
//! data-parallel ranks (the same layers, other sequences) and combined over the pipeline stages
//! (other layers), so every layout reports what one device does.

use std::sync::Arc;

use anyhow::Result;
use meshgrad_nn::moe::ExpertLoad;
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::metrics::ExpertMetrics;
use meshgrad_parallel::{Communicator, ReduceOp};
use meshgrad_tensor::{Device, Tensor};

/// A step's expert load as this rank recorded it, with the groups to reduce it over and the
/// load-balancing coefficient. The reduction waits until after the gradient synchronisation
/// ([`PendingExperts::reduce`]): a collective issued between the backward and DDP's `finish`
/// would meet, on another rank, a gradient bucket that rank launched during its backward (an
/// expert without tokens on one rank leaves its bucket to `finish`).
pub(crate) struct PendingExperts {
    /// What this rank's layers recorded.
    pub(crate) load: ExpertLoad,
    /// The data-parallel group (the same layers, other sequences).
    pub(crate) dp: Arc<dyn Communicator>,
    /// The pipeline group (other layers).
    pub(crate) pp: Arc<dyn Communicator>,
    /// The load-balancing loss's coefficient.
    pub(crate) coef: f64,
}

impl PendingExperts {
    /// The step's metrics over every rank, with the coefficient (collective over `dp` and `pp`:
    /// every rank calls it after every step's gradient synchronisation).
    pub(crate) fn reduce(self) -> Result<(ExpertMetrics, f64)> {
        Ok((
            reduce_expert_load(&self.load, self.dp.as_ref(), self.pp.as_ref())?,
            self.coef,
        ))
    }
}

/// The step's expert metrics from this rank's `load` (collective over `dp` and `pp`).
fn reduce_expert_load(
    load: &ExpertLoad,
    dp: &dyn Communicator,
    pp: &dyn Communicator,
) -> Result<ExpertMetrics> {
    let routed = load.routed_flat();
    let n = routed.len();
    let routed = if dp.world_size() > 1 && n > 0 {
        let t = Tensor::from_vec(routed, n, Device::Cpu)?;
        dp.all_reduce(&t, ReduceOp::Sum)?.wait()?.to_vec::<f64>()?
    } else {
        routed
    };
    let local_max = routed.iter().cloned().fold(0.0, f64::max);
    let local_sum: f64 = routed.iter().sum();
    let (aux_sum, rows, dropped) = load.aux_totals();
    let sum_dp = |v: f64| all_reduce_scalar(dp, v, ReduceOp::Sum);
    let (aux_sum, rows, dropped) = (sum_dp(aux_sum)?, sum_dp(rows)?, sum_dp(dropped)?);
    let sum_pp = |v: f64| all_reduce_scalar(pp, v, ReduceOp::Sum);
    let max = all_reduce_scalar(pp, local_max, ReduceOp::Max)?;
    let (total, slots) = (sum_pp(local_sum)?, sum_pp(n as f64)?);
    let (aux_sum, rows, dropped) = (sum_pp(aux_sum)?, sum_pp(rows)?, sum_pp(dropped)?);
    Ok(ExpertMetrics {
        aux_loss: if rows > 0.0 { aux_sum / rows } else { 0.0 },
        tokens_max: max,
        tokens_mean: if slots > 0.0 { total / slots } else { 0.0 },
        dropped,
    })
}
