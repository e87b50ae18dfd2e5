//! Gradient reduction: from the gradient-ready hooks to the reduced gradients the optimizer reads.
//!
//! * Each parameter's gradient-ready hook copies its gradient (cast to the reduce dtype) into its
//!   unit's flat buffer and drops the full-size `.grad` at once. When every parameter of a unit
//!   has reported, the unit's parameters are released (ZeRO-3: its backward is over) and its
//!   reduction is launched while backward goes on: an all-reduce (average) over the data-parallel
//!   group for ZeRO-1, a reduce-scatter (average) over the shard group for ZeRO-2/3, after which
//!   the flat buffer is dropped, so only the shard stays.
//! * Units are launched strictly in a fixed order (reverse unit order, root last: the order
//!   backward completes them in), so every rank issues the same collectives in the same order
//!   whatever order its hooks fire in. A unit completed early waits for the ones before it.
//!   With [`ShardConfig::sometimes_unused`](super::ShardConfig::sometimes_unused) nothing is
//!   launched during the backward (a unit may complete on one rank and not on another).
//! * [`ShardedDataParallel::finish`] launches what is left (parameters without a gradient
//!   contribute zeros), agrees on which parameters had a gradient on any rank (a small max
//!   all-reduce; the optimizer skips the others, as it would unsharded), waits, converts to the
//!   master dtype, and for hybrid sharding averages the ZeRO-2/3 shards across replicas (an
//!   all-reduce over the replicate group).
//! * With sync off ([`ShardedDataParallel::set_sync`]), the hooks only track completion (ZeRO-3
//!   still releases finished units) and gradients accumulate in `.grad` at full size; the next
//!   synchronised backward reduces the sums (and `finish` adds what a parameter accumulated
//!   with sync off and got nothing for since).
//! * With [`ShardConfig::sometimes_unused`](super::ShardConfig::sometimes_unused) a unit is
//!   not released when its gradients are complete (it may complete on one rank and not on
//!   another, and a released unit is gathered again when read: on some ranks only); the next
//!   gather of another unit, or `finish`, releases it on every rank alike.
//!
//! Order of additions: a rank's micro-batches accumulate in `.grad` in micro-batch order (sync
//! off), or each synchronised micro-batch is reduced and the reduced results are added in
//! micro-batch order; across ranks the collectives add in rank order (see [`crate::comm`]).

use meshgrad_autograd::Var;
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{Device, Error, Result, Tensor};

use super::config::ZeroStage;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};
use crate::comm::{ReduceOp, Work};

impl Inner {
    /// The gradient-ready hook of every parameter.
    pub(crate) fn grad_ready(&self, v: &Var) -> Result<()> {
        let Some(pi) = self.param_index(v) else {
            return Ok(());
        };
        let sync = self.sync.load(std::sync::atomic::Ordering::SeqCst);
        let mut st = lock(&self.state);
        let u = self.plan.params[pi].unit;
        let first = !st.ready[pi];
        if sync {
            if let Some(g) = v.grad() {
                self.add_to_flat(&mut st, pi, &g, !first)?;
                v.set_grad(None);
            }
        }
        st.had_grad[pi] = true;
        if first {
            st.ready[pi] = true;
            st.pending[u] -= 1;
            if st.pending[u] == 0 {
                // A unit that may complete on one rank and not on another is not released
                // here: its gathered state must stay the same on every rank, or a later read
                // would gather it on some ranks only (the next gather of another unit, or
                // `finish`, releases it).
                if !self.config.sometimes_unused {
                    self.release(&mut st, u);
                }
                if !sync {
                    self.reset_unit(&mut st, u);
                }
            }
        }
        // Parameters that may get no gradient on some ranks: `finish` launches every unit.
        if sync && !self.config.sometimes_unused {
            self.launch_ready(&mut st)?;
        }
        Ok(())
    }

    /// Copies (or adds) gradient `g` of parameter `pi` into its unit's flat buffer.
    fn add_to_flat(&self, st: &mut State, pi: usize, g: &Tensor, accumulate: bool) -> Result<()> {
        let p = &self.plan.params[pi];
        let flat = self.flat(st, p.unit)?;
        let r = (|| -> Result<()> {
            let dst = flat
                .narrow(0, p.offset, p.numel)?
                .reshape(p.shape.clone())?;
            let g = g.to_dtype(self.reduce_dtype)?;
            if accumulate {
                dst.copy_from(&dst.add(&g)?)
            } else {
                dst.copy_from(&g)
            }
        })();
        r.map_err(|e| {
            Error::msg(format!(
                "rank {}: gradient of {} (shape {:?}): {e}",
                self.topo.dp.global_rank(),
                p.name,
                p.shape
            ))
        })
    }

    /// Unit `u`'s flat gradient buffer, created (zero, tagged as gradients) on first use.
    fn flat(&self, st: &mut State, u: usize) -> Result<Tensor> {
        if let Some(f) = &st.flats[u] {
            return Ok(f.clone());
        }
        let n = self.plan.units[u].padded(self.plan.world);
        let f = with_tag(MemoryTag::Grads, || {
            Tensor::zeros(n, self.reduce_dtype, Device::Cpu)
        })?;
        st.flats[u] = Some(f.clone());
        Ok(f)
    }

    fn reset_unit(&self, st: &mut State, u: usize) {
        for &pi in &self.plan.units[u].params {
            st.ready[pi] = false;
        }
        st.pending[u] = self.plan.units[u].params.len();
    }

    /// Launches, in the fixed order, every unit that is complete and next in line.
    fn launch_ready(&self, st: &mut State) -> Result<()> {
        while st.next_launch < self.launch_order.len() {
            let u = self.launch_order[st.next_launch];
            if st.pending[u] != 0 {
                break;
            }
            self.launch(st, u)?;
            st.launches.0 += 1;
            st.next_launch += 1;
        }
        if st.next_launch == self.launch_order.len() {
            st.next_launch = 0;
        }
        Ok(())
    }

    /// Adds gradients accumulated in `.grad` (sync off) of unit `u`'s parameters that a
    /// synchronised backward has not taken: those that have not reported in it, and (a unit
    /// that did not complete: [`ShardConfig::sometimes_unused`](super::ShardConfig::sometimes_unused))
    /// those that reported in a backward with sync off and got nothing since.
    fn fill_missing(&self, st: &mut State, u: usize) -> Result<()> {
        for &pi in &self.plan.units[u].params {
            if let Some(g) = self.vars[pi].grad() {
                // A parameter that reported with sync on had its gradient moved to the flat
                // buffer (and `.grad` cleared): add to it; otherwise its part is still zero.
                let accumulate = st.ready[pi];
                self.add_to_flat(st, pi, &g, accumulate)?;
                self.vars[pi].set_grad(None);
                st.had_grad[pi] = true;
            }
        }
        Ok(())
    }

    /// Launches unit `u`'s reduction and drops its flat buffer.
    fn launch(&self, st: &mut State, u: usize) -> Result<()> {
        let flat = self.flat(st, u)?;
        st.flats[u] = None;
        let r = match self.config.stage {
            ZeroStage::One => self.topo.dp.all_reduce(&flat, ReduceOp::Avg),
            ZeroStage::Two | ZeroStage::Three => {
                self.topo.shard.reduce_scatter(&flat, ReduceOp::Avg)
            }
        };
        let work = r.map_err(|e| {
            Error::msg(format!(
                "rank {}: reducing the gradients of unit {}: {e}",
                self.topo.dp.global_rank(),
                self.plan.units[u].name
            ))
        })?;
        st.works[u].push(work);
        self.reset_unit(st, u);
        Ok(())
    }

    /// See [`ShardedDataParallel::finish`].
    fn finish(&self) -> Result<()> {
        let mut st = lock(&self.state);
        let rank = self.topo.dp.global_rank();
        // 1. Launch what is left of the round in progress (or a whole round if no backward
        //    launched anything since the last finish: gradients accumulated with sync off), in
        //    order; then any unit that completed again afterwards.
        let in_progress = st.next_launch > 0
            || st.flats.iter().any(Option::is_some)
            || st.ready.iter().any(|&r| r);
        let first = if in_progress || st.launches.0 == 0 {
            st.next_launch
        } else {
            self.launch_order.len()
        };
        for k in first..self.launch_order.len() {
            let u = self.launch_order[k];
            self.fill_missing(&mut st, u)?;
            self.launch(&mut st, u)?;
            st.launches.1 += 1;
        }
        st.next_launch = 0;
        for k in 0..self.launch_order.len() {
            let u = self.launch_order[k];
            if st.flats[u].is_some() {
                self.fill_missing(&mut st, u)?;
                self.launch(&mut st, u)?;
                st.launches.1 += 1;
            }
        }
        // 2. Which parameters had a gradient on any rank.
        let mask: Vec<u8> = st.had_grad.iter().map(|&h| h as u8).collect();
        let n = mask.len();
        let used = self
            .topo
            .dp
            .all_reduce(&Tensor::from_vec(mask, n, Device::Cpu)?, ReduceOp::Max)?
            .wait()
            .map_err(|e| Error::msg(format!("rank {rank}: agreeing on used parameters: {e}")))?
            .to_vec::<u8>()?;
        // 3. Wait for the reductions, in launch order, and sum each unit's results.
        let n_units = self.plan.units.len();
        let mut news: Vec<Option<Tensor>> = vec![None; n_units];
        with_tag(MemoryTag::Grads, || -> Result<()> {
            for &u in &self.launch_order {
                for w in std::mem::take(&mut st.works[u]) {
                    let r = w
                        .wait()
                        .map_err(|e| {
                            Error::msg(format!(
                                "rank {rank}: reducing the gradients of unit {}: {e}",
                                self.plan.units[u].name
                            ))
                        })?
                        .to_dtype(self.master_dtype)?;
                    news[u] = Some(match news[u].take() {
                        None => r,
                        Some(a) => a.add(&r)?,
                    });
                }
            }
            // 4. Hybrid ZeRO-2/3: average the shards across replicas.
            if let (Some(rep), false) = (&self.topo.replicate, self.config.stage == ZeroStage::One)
            {
                let mut works: Vec<(usize, Work)> = Vec::new();
                for &u in &self.launch_order {
                    if let Some(g) = &news[u] {
                        let g = g.to_dtype(self.reduce_dtype)?;
                        works.push((u, rep.all_reduce(&g, ReduceOp::Avg)?));
                    }
                }
                for (u, w) in works {
                    let r = w.wait().map_err(|e| {
                        Error::msg(format!(
                            "rank {rank}: averaging the gradient shard of unit {} across \
                             replicas: {e}",
                            self.plan.units[u].name
                        ))
                    })?;
                    news[u] = Some(r.to_dtype(self.master_dtype)?);
                }
            }
            // 5. Accumulate into the step's gradients.
            for (u, new) in news.into_iter().enumerate() {
                if let Some(new) = new {
                    st.grads[u] = Some(match st.grads[u].take() {
                        None => new,
                        Some(old) => old.add(&new)?,
                    });
                }
            }
            Ok(())
        })?;
        for (u, x) in st.used.iter_mut().zip(used) {
            *u |= x != 0;
        }
        st.had_grad.iter_mut().for_each(|h| *h = false);
        st.last_launches = std::mem::take(&mut st.launches);
        for u in 0..n_units {
            self.reset_unit(&mut st, u);
            st.flats[u] = None;
            self.release(&mut st, u);
        }
        st.order.end_phase();
        Ok(())
    }
}

impl ShardedDataParallel {
    /// Completes the gradient reduction of the backward passes since the last call: launches the
    /// units not launched yet, agrees across ranks on which parameters had a gradient, waits for
    /// every reduction and keeps the reduced gradients (ZeRO-1: whole; ZeRO-2/3: this rank's
    /// shard) for [`ShardedDataParallel::clip_grad_norm`] and [`ShardedDataParallel::step`].
    /// Call it after the final (synchronised) backward of a step, on every rank.
    pub fn finish(&self) -> Result<()> {
        if !self.is_sync() {
            meshgrad_tensor::bail!(
                "sharded data parallel: finish() called with gradient sync off; turn it on \
                 (set_sync(true)) for the final micro-batch's backward, then call finish()"
            );
        }
        self.inner.finish()
    }
}
