//! The sharded AdamW step and gradient-norm clipping across shards.
//!
//! Each rank updates only its shard, segment by segment (see [`super::plan`]), with the fused
//! kernel [`meshgrad_tensor::Tensor::adamw_step_`] and its segment's group hyper-parameters and
//! per-parameter step count, so every element gets exactly the update unsharded AdamW gives it
//! (the kernel is elementwise). ZeRO-1/2 then all-gather the updated shards into every rank's
//! full parameters; ZeRO-3 keeps them sharded until the next forward gathers them.

use meshgrad_autograd::no_grad;
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{AdamWStep, Device, Error, Result, Tensor};

use super::config::ZeroStage;
use super::plan::Segment;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};
use crate::comm::{ReduceOp, Work};

impl Inner {
    /// The reduced gradient of segment `s` of unit `u`, if the unit has one.
    fn grad_view(&self, st: &State, u: usize, s: &Segment) -> Result<Option<Tensor>> {
        let Some(g) = &st.grads[u] else {
            return Ok(None);
        };
        let start = match self.config.stage {
            ZeroStage::One => self.plan.shard_range(u, self.shard_rank).start + s.shard_offset,
            ZeroStage::Two | ZeroStage::Three => s.shard_offset,
        };
        Ok(Some(g.narrow(0, start, s.len())?))
    }

    /// This rank's part of unit `u`'s reduced gradient (the whole shard; for ZeRO-1 the rank's
    /// range of the full gradient).
    fn grad_shard(&self, st: &State, u: usize) -> Result<Option<Tensor>> {
        let Some(g) = &st.grads[u] else {
            return Ok(None);
        };
        Ok(Some(match self.config.stage {
            ZeroStage::One => {
                let r = self.plan.shard_range(u, self.shard_rank);
                g.narrow(0, r.start, r.len())?
            }
            ZeroStage::Two | ZeroStage::Three => g.clone(),
        }))
    }

    /// The weights segment `s` of unit `u` updates: the master shard, or (ZeRO-1/2 without a
    /// separate master) the parameter's own elements.
    fn weight_view(&self, st: &State, u: usize, s: &Segment) -> Result<Tensor> {
        match &st.master[u] {
            Some(m) => m.narrow(0, s.shard_offset, s.len()),
            None => {
                let p = &self.plan.params[s.param];
                self.vars[s.param].tensor().reshape(p.numel)?.narrow(
                    0,
                    s.param_range.start,
                    s.len(),
                )
            }
        }
    }

    /// Per parameter, the sum of squares of its reduced gradient, summed over the shard group
    /// (so the same on every rank). Parameters without a gradient count 0.
    fn grad_sq_sums(&self, st: &State) -> Result<Vec<f64>> {
        let mut sums = vec![0f64; self.plan.params.len()];
        for u in 0..self.plan.units.len() {
            for s in self.plan.segments(u, self.shard_rank) {
                if let Some(g) = self.grad_view(st, u, &s)? {
                    sums[s.param] += g.sqr_sum_f64()?;
                }
            }
        }
        let shard = &self.topo.shard;
        if shard.world_size() == 1 {
            return Ok(sums);
        }
        let n = sums.len();
        shard
            .all_reduce(&Tensor::from_vec(sums, n, Device::Cpu)?, ReduceOp::Sum)?
            .wait()?
            .to_vec::<f64>()
    }

    fn grad_norm(&self, st: &State) -> Result<f64> {
        // Added in parameter order, as `meshgrad_nn::optim::grad_sq_sum` does.
        let sums = self.grad_sq_sums(st)?;
        let mut total = 0.0;
        for (s, &used) in sums.iter().zip(&st.used) {
            if used {
                total += s;
            }
        }
        Ok(total.sqrt())
    }

    /// Launches the all-gather of every unit's updated shard (ZeRO-1/2) and copies the results
    /// into the full parameters.
    fn publish_params(&self, st: &State) -> Result<()> {
        let mut works: Vec<Work> = Vec::with_capacity(self.plan.units.len());
        for u in 0..self.plan.units.len() {
            let local = match &st.master[u] {
                Some(m) => m.to_dtype(self.param_dtype)?,
                None => self.shard_from_params(u)?,
            };
            works.push(self.topo.shard.all_gather(&local)?);
        }
        for (u, w) in works.into_iter().enumerate() {
            let full = w.wait()?;
            for &pi in &self.plan.units[u].params {
                let p = &self.plan.params[pi];
                self.vars[pi].tensor().copy_from(
                    &full
                        .narrow(0, p.offset, p.numel)?
                        .reshape(p.shape.clone())?,
                )?;
            }
        }
        Ok(())
    }

    fn step(&self, lr: f64) -> Result<()> {
        if !lr.is_finite() || lr < 0.0 {
            meshgrad_tensor::bail!("learning rate {lr} must be finite and >= 0");
        }
        let mut st = lock(&self.state);
        let c = self.adamw;
        no_grad(|| -> Result<()> {
            for u in 0..self.plan.units.len() {
                if st.grads[u].is_none() {
                    continue;
                }
                if st.m[u].is_none() {
                    let n = self.plan.units[u].shard_len;
                    let (m, v) = with_tag(MemoryTag::OptimizerState, || -> Result<_> {
                        Ok((
                            Tensor::zeros(n, self.master_dtype, Device::Cpu)?,
                            Tensor::zeros(n, self.master_dtype, Device::Cpu)?,
                        ))
                    })?;
                    st.m[u] = Some(m);
                    st.v[u] = Some(v);
                }
                let (Some(m), Some(v)) = (st.m[u].clone(), st.v[u].clone()) else {
                    continue;
                };
                for s in self.plan.segments(u, self.shard_rank) {
                    if !st.used[s.param] {
                        continue;
                    }
                    let p = &self.plan.params[s.param];
                    let hp = self.groups[p.group];
                    let r = (|| -> Result<()> {
                        let Some(g) = self.grad_view(&st, u, &s)? else {
                            return Ok(());
                        };
                        let w = self.weight_view(&st, u, &s)?;
                        let step = AdamWStep {
                            lr: lr * hp.lr_scale,
                            beta1: c.beta1,
                            beta2: c.beta2,
                            eps: c.eps,
                            weight_decay: hp.weight_decay,
                            step: st.steps[s.param] + 1,
                        };
                        w.adamw_step_(
                            &g,
                            &m.narrow(0, s.shard_offset, s.len())?,
                            &v.narrow(0, s.shard_offset, s.len())?,
                            &step,
                        )
                    })();
                    r.map_err(|e| {
                        Error::msg(format!(
                            "rank {}: sharded adamw: parameter {} (elements {:?}): {e}",
                            self.topo.dp.global_rank(),
                            p.name,
                            s.param_range
                        ))
                    })?;
                }
            }
            Ok(())
        })?;
        for (pi, p) in self.plan.params.iter().enumerate() {
            if st.used[pi] && st.grads[p.unit].is_some() {
                st.steps[pi] += 1;
            }
        }
        st.step_count += 1;
        match self.config.stage {
            ZeroStage::One | ZeroStage::Two => self.publish_params(&st),
            ZeroStage::Three => {
                // Gathered copies (summoned) are stale now: refresh them.
                if st.summoned {
                    st.summoned = false;
                    for u in 0..self.plan.units.len() {
                        self.release(&mut st, u);
                    }
                    for u in 0..self.plan.units.len() {
                        self.ensure_gathered(&mut st, u)?;
                    }
                    st.summoned = true;
                } else {
                    // A unit gathered since `finish` (an evaluation forward) is stale now.
                    self.release_all(&mut st);
                    st.order.end_phase();
                }
                Ok(())
            }
        }
    }
}

impl ShardedDataParallel {
    /// The global L2 norm of the reduced gradients (after [`ShardedDataParallel::finish`]):
    /// each rank's per-parameter sums of squares over its shard, summed over the shard group
    /// (replicas hold identical shards and are not counted twice), added in parameter order.
    /// Collective over the shard group.
    pub fn grad_norm(&self) -> Result<f64> {
        let st = lock(&self.inner.state);
        self.inner.grad_norm(&st)
    }

    /// Clips the global gradient norm to `max_norm` (PyTorch's `clip_grad_norm_` rule: scale by
    /// `max_norm / (norm + 1e-6)` when that is below 1) and returns the norm before clipping;
    /// the same as [`meshgrad_nn::optim::clip_grad_norm`] on the unsharded gradients. A
    /// non-finite norm is returned and nothing is scaled. Collective over the shard group.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        if !max_norm.is_finite() || max_norm <= 0.0 {
            meshgrad_tensor::bail!("clip_grad_norm: max_norm {max_norm} must be finite and > 0");
        }
        let i = &self.inner;
        let st = lock(&i.state);
        let norm = i.grad_norm(&st)?;
        let coef = max_norm / (norm + 1e-6);
        if !norm.is_finite() || coef >= 1.0 {
            return Ok(norm);
        }
        no_grad(|| -> Result<()> {
            for u in 0..i.plan.units.len() {
                if let Some(g) = i.grad_shard(&st, u)? {
                    g.copy_from(&g.mul_scalar(coef)?)?;
                }
            }
            Ok(())
        })?;
        Ok(norm)
    }

    /// One AdamW step of this rank's shard with base learning rate `lr` (each group uses
    /// `lr * lr_scale`), then (ZeRO-1/2) the all-gather of the updated parameters. Parameters
    /// that had no gradient on any rank are skipped, as unsharded AdamW skips them. Collective
    /// over the shard group.
    pub fn step(&self, lr: f64) -> Result<()> {
        self.inner
            .step(lr)
            .map_err(|e| Error::msg(format!("sharded data parallel step: {e}")))
    }
}
