//! The optimizer step over this rank's shard, and gradient-norm clipping across shards.
//!
//! ZeRO does not own an update rule: the caller's optimizer ([`OptimizerFactory`]) runs over
//! *shard variables*, one per segment this rank owns (see [`super::plan`]), each named after
//! its parameter and placed in its parameter's group. Before the optimizer's step each shard
//! variable's gradient is set to its segment of the reduced gradient (parameters that got no
//! gradient on any rank get none, so the optimizer skips them as it would unsharded); the
//! update writes this rank's weights in place. An elementwise optimizer (AdamW, SGD with
//! momentum) therefore gives every element exactly the unsharded update, with the same
//! per-parameter step counts, learning-rate scale and weight decay. ZeRO-1/2 then all-gather the
//! updated shards into every rank's full parameters; ZeRO-3 keeps them sharded until the next
//! forward gathers them.

use meshgrad_autograd::distributed::sum_over_placements;
use meshgrad_autograd::no_grad;
use meshgrad_nn::optim::{AdamW, AdamWConfig, Optimizer, ParamGroup, Sgd, SgdConfig, StateKind};
use meshgrad_tensor::{Device, Error, Result, Tensor};

use super::config::ZeroStage;
use super::plan::Segment;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};
use crate::comm::{ReduceOp, Work};

/// Builds the optimizer [`ShardedDataParallel`] steps this rank's shard with, from the
/// parameter groups of the shard variables (the caller's groups, same order and
/// hyper-parameters, each parameter replaced by this rank's part of it under the same name;
/// parameters the rank owns none of are left out, so a group may be empty).
///
/// Implemented by [`AdamWConfig`] (AdamW with that configuration), [`SgdConfig`] (SGD with
/// that configuration), and any closure `FnOnce(Vec<ParamGroup>) -> Result<Box<dyn Optimizer +
/// Send>>`:
///
/// ```no_run
/// # use meshgrad_nn::optim::{Optimizer, ParamGroup, Sgd, SgdConfig};
/// # use meshgrad_parallel::zero::OptimizerFactory;
/// # fn takes(_: impl OptimizerFactory) {}
/// takes(SgdConfig { momentum: 0.9 });
/// takes(|groups: Vec<ParamGroup>| -> meshgrad_tensor::Result<Box<dyn Optimizer + Send>> {
///     Ok(Box::new(Sgd::new(groups, SgdConfig { momentum: 0.9 })?))
/// });
/// ```
///
/// ZeRO gives each segment the update the optimizer gives those elements, so the result equals
/// the unsharded run only for an *elementwise* optimizer (each element's update depends only on
/// that element's weight, gradient and state, and on per-parameter counters), as AdamW and SGD
/// are. Its checkpoints ([`ShardedDataParallel::full_state_dict`]) rely on
/// [`Optimizer::state_kind`] to tell sharded state from per-parameter and global values.
pub trait OptimizerFactory {
    /// The optimizer over `groups`.
    fn build(self, groups: Vec<ParamGroup>) -> Result<Box<dyn Optimizer + Send>>;
}

impl OptimizerFactory for AdamWConfig {
    fn build(self, groups: Vec<ParamGroup>) -> Result<Box<dyn Optimizer + Send>> {
        Ok(Box::new(AdamW::new(groups, self)?))
    }
}

impl OptimizerFactory for SgdConfig {
    fn build(self, groups: Vec<ParamGroup>) -> Result<Box<dyn Optimizer + Send>> {
        Ok(Box::new(Sgd::new(groups, self)?))
    }
}

impl<F> OptimizerFactory for F
where
    F: FnOnce(Vec<ParamGroup>) -> Result<Box<dyn Optimizer + Send>>,
{
    fn build(self, groups: Vec<ParamGroup>) -> Result<Box<dyn Optimizer + Send>> {
        self(groups)
    }
}

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
        Ok(self.grad_sq_sum(st, &|_| false)?.sqrt())
    }

    /// The sum of squares of the reduced gradients of the parameters `skip` does not name.
    fn grad_sq_sum(&self, st: &State, skip: &dyn Fn(&str) -> bool) -> Result<f64> {
        // Added in parameter order, as `meshgrad_nn::optim::grad_sq_sum` does.
        // Parameters split by tensor parallelism (a placement on the variable) hold part of
        // their elements on each rank of their group: their sums are added over that group, so
        // every element counts once across all mesh dimensions.
        let sums = self.grad_sq_sums(st)?;
        let used = sums
            .iter()
            .zip(&st.used)
            .enumerate()
            .filter(|(pi, (_, &used))| used && !skip(&self.plan.params[*pi].name))
            .map(|(pi, (s, _))| (self.vars[pi].placement(), *s));
        sum_over_placements(used)
    }

    /// Multiplies every reduced gradient shard by `coef`.
    fn scale_grads(&self, st: &State, coef: f64) -> Result<()> {
        no_grad(|| -> Result<()> {
            for u in 0..self.plan.units.len() {
                if let Some(g) = self.grad_shard(st, u)? {
                    g.copy_from(&g.mul_scalar(coef)?)?;
                }
            }
            Ok(())
        })
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
        let r = (|| -> Result<()> {
            for sv in &self.shards {
                let g = if st.used[sv.seg.param] {
                    self.grad_view(&st, sv.unit, &sv.seg)?
                } else {
                    None
                };
                sv.var.set_grad(g);
            }
            no_grad(|| st.opt.step(lr))
        })();
        // The gradient views must not outlive the reduced gradients (`zero_grad` frees them).
        for sv in &self.shards {
            sv.var.set_grad(None);
        }
        r.map_err(|e| {
            Error::msg(format!(
                "rank {} (the optimizer over this rank's shard): {e}",
                self.topo.dp.global_rank()
            ))
        })?;
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
    /// The sum of squares of every reduced gradient element of the parameters that had a
    /// gradient (after [`ShardedDataParallel::finish`]), as an order-free
    /// [`ExactSum`](meshgrad_tensor::exact_sum::ExactSum) over the shard group: the same bits
    /// however the shards cut the parameters, and the same as one device's exact sum over its
    /// whole gradients (reference mode's norm). Parameters split by tensor parallelism are
    /// combined across their group too (each element counted once). Collective over the shard
    /// group, then over each tensor-parallel group.
    pub fn exact_grad_sq_sum(&self) -> Result<meshgrad_tensor::exact_sum::ExactSum> {
        self.exact_grad_sq_sum_without(&|_| false)
    }

    /// [`ShardedDataParallel::exact_grad_sq_sum`] over the parameters whose names `skip`
    /// rejects (a pipeline stage leaves out its copy of a table another stage also holds).
    /// Collective over the shard group (and the tensor-parallel groups of split parameters).
    pub fn exact_grad_sq_sum_without(
        &self,
        skip: &dyn Fn(&str) -> bool,
    ) -> Result<meshgrad_tensor::exact_sum::ExactSum> {
        use meshgrad_autograd::distributed::{exact_sum_over_placements, Placement};
        use meshgrad_tensor::exact_sum::ExactSum;
        // One exact sum for the replicated parameters and one per tensor-parallel group of the
        // split ones (combined over that group after the shard group).
        // The same list on every rank of the shard group (from every parameter, not only
        // the segments this rank holds), so the words all-reduce in one shape.
        let inner = &self.inner;
        let group_of = |pi: usize| inner.vars[pi].placement().filter(|p| p.degree() > 1);
        let mut parts: Vec<(Option<Placement>, ExactSum)> = vec![(None, ExactSum::new())];
        let mut slot = Vec::with_capacity(inner.vars.len());
        for pi in 0..inner.vars.len() {
            let at = match group_of(pi) {
                None => 0,
                Some(p) => {
                    let same = |q: &Option<Placement>| {
                        q.as_ref()
                            .is_some_and(|q| std::sync::Arc::ptr_eq(&q.group, &p.group))
                    };
                    match parts.iter().position(|(q, _)| same(q)) {
                        Some(i) => i,
                        None => {
                            parts.push((Some(p), ExactSum::new()));
                            parts.len() - 1
                        }
                    }
                }
            };
            slot.push(at);
        }
        {
            let st = lock(&inner.state);
            for u in 0..inner.plan.units.len() {
                for s in inner.plan.segments(u, inner.shard_rank) {
                    if !st.used[s.param] || skip(&inner.plan.params[s.param].name) {
                        continue;
                    }
                    if let Some(g) = inner.grad_view(&st, u, &s)? {
                        parts[slot[s.param]].1.add_squares(&g)?;
                    }
                }
            }
        }
        let shard = &self.inner.topo.shard;
        if shard.world_size() > 1 {
            let words: Vec<f64> = parts.iter().flat_map(|(_, s)| s.to_words()).collect();
            let n = words.len();
            // The words are integers below 2^32: any order of summation is exact.
            let total = shard
                .all_reduce(&Tensor::from_vec(words, n, Device::Cpu)?, ReduceOp::Sum)?
                .wait()?
                .to_vec::<f64>()?;
            for (i, (_, s)) in parts.iter_mut().enumerate() {
                *s = ExactSum::from_words(&total[i * ExactSum::WORDS..(i + 1) * ExactSum::WORDS])?;
            }
        }
        exact_sum_over_placements(parts)
    }

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
        let norm = {
            let st = lock(&self.inner.state);
            self.inner.grad_norm(&st)?
        };
        self.clip_grads_with_norm(max_norm, norm)?;
        Ok(norm)
    }

    /// Multiplies this rank's reduced gradient shards by `factor`: an f16 run unscales its
    /// loss-scaled gradients by `1 / S` (exact for a power-of-two `S`) before the norm, the
    /// clipping and the step. Local.
    pub fn scale_grads(&self, factor: f64) -> Result<()> {
        let st = lock(&self.inner.state);
        self.inner.scale_grads(&st, factor)
    }

    /// Scales this rank's reduced gradient shards as clipping to `max_norm` does when the global
    /// norm is `norm` (computed elsewhere, e.g. across pipeline stages): by
    /// `max_norm / (norm + 1e-6)` when that is below 1, not at all for a non-finite norm. Local.
    pub fn clip_grads_with_norm(&self, max_norm: f64, norm: f64) -> Result<()> {
        let coef = max_norm / (norm + 1e-6);
        if !norm.is_finite() || coef >= 1.0 {
            return Ok(());
        }
        let st = lock(&self.inner.state);
        self.inner.scale_grads(&st, coef)
    }

    /// The sum of squares of the reduced gradients (after [`ShardedDataParallel::finish`]) of
    /// the parameters whose names `skip` rejects, every element counted once across the shard
    /// group and tensor-parallel splits. A pipeline stage leaves out its copy of a table another
    /// stage also holds, then sums the stages' figures. Collective over the shard group.
    pub fn grad_sq_sum_without(&self, skip: &dyn Fn(&str) -> bool) -> Result<f64> {
        let st = lock(&self.inner.state);
        self.inner.grad_sq_sum(&st, skip)
    }

    /// This rank's optimizer state: the optimizer's state dict over its shard variables, named
    /// after their parameters, whose elementwise entries hold only this rank's segment (see the
    /// [module docs](crate::zero#optimizer)). [`ShardedDataParallel::full_state_dict`] gives the
    /// unsharded state.
    pub fn local_optimizer_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        lock(&self.inner.state).opt.state_dict()
    }

    /// One step of the optimizer over this rank's shard with base learning rate `lr` (each
    /// group uses `lr * lr_scale`), then (ZeRO-1/2) the all-gather of the updated parameters.
    /// Parameters that had no gradient on any rank get no gradient, so the optimizer skips them
    /// as it would unsharded. Collective over the shard group.
    pub fn step(&self, lr: f64) -> Result<()> {
        self.inner
            .step(lr)
            .map_err(|e| Error::msg(format!("sharded data parallel step: {e}")))
    }
}

/// ZeRO's step as an [`Optimizer`]: a loop that holds any optimizer can hold the wrapper
/// instead. Its [`Optimizer::step`] is [`ShardedDataParallel::step`] (the shard's update, then
/// ZeRO-1/2's gather of the parameters: collective over the shard group), its groups and state
/// are the shard's ([`ShardedDataParallel::local_optimizer_state_dict`]); the gradients it steps
/// are the reduced shards of [`ShardedDataParallel::finish`].
impl Optimizer for ShardedDataParallel {
    fn step(&mut self, lr: f64) -> Result<()> {
        ShardedDataParallel::step(self, lr)
    }

    fn zero_grad(&self) {
        ShardedDataParallel::zero_grad(self)
    }

    fn param_groups(&self) -> &[ParamGroup] {
        &self.inner.groups
    }

    fn step_count(&self) -> u64 {
        ShardedDataParallel::step_count(self)
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        self.local_optimizer_state_dict()
    }

    fn load_state_dict(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        lock(&self.inner.state).opt.load_state_dict(tensors)
    }

    fn state_kind(&self, key: &str) -> Option<StateKind> {
        lock(&self.inner.state).opt.state_kind(key)
    }

    fn exact_weights_key(&self, param: &str) -> Option<String> {
        lock(&self.inner.state).opt.exact_weights_key(param)
    }
}
