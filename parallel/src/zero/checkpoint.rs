//! Full (unsharded) state dicts: gathered from any strategy, loaded into any.
//!
//! The names are those of the model's parameters and, for the optimizer, those of
//! [`meshgrad_nn::optim::AdamW`]'s state dict (`adamw.step_count`, `adamw.m.<name>`,
//! `adamw.v.<name>`, `adamw.step.<name>`), so a full state dict saved from any layout loads into
//! a single-device model ([`meshgrad_nn::state::load_state_dict`]) and optimizer, or into any
//! other layout, whatever its shard degree.

use std::collections::{HashMap, HashSet};

use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use super::config::ZeroStage;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};

/// What [`ShardedDataParallel::full_state_dict`] returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FullStateDictOptions {
    /// Include the optimizer state (AdamW names).
    pub optimizer: bool,
    /// Only data-parallel rank 0 gets the tensors (the others get an empty list); every rank
    /// still takes part in the gathers.
    pub rank0_only: bool,
}

impl Inner {
    /// Gathers one per-unit shard tensor (`[shard_len]`, one per unit) into full per-parameter
    /// tensors (in the parameter's shape), indexed by parameter.
    fn gather_full(&self, shards: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let mut works = Vec::new();
        for (u, s) in shards.iter().enumerate() {
            if let Some(s) = s {
                works.push((u, self.topo.shard.all_gather(s)?));
            }
        }
        let mut out: Vec<Option<Tensor>> = vec![None; self.plan.params.len()];
        for (u, w) in works {
            let full = w.wait()?;
            for &pi in &self.plan.units[u].params {
                let p = &self.plan.params[pi];
                out[pi] = Some(
                    full.narrow(0, p.offset, p.numel)?
                        .reshape(p.shape.clone())?
                        .deep_clone()?,
                );
            }
        }
        Ok(out)
    }

    /// This rank's shard of unit `u`'s weights in the master dtype.
    fn weight_shard(&self, st: &State, u: usize) -> Result<Tensor> {
        match &st.master[u] {
            Some(m) => Ok(m.clone()),
            None => self.shard_from_params(u)?.to_dtype(self.master_dtype),
        }
    }

    fn full_state_dict(&self, opts: FullStateDictOptions) -> Result<Vec<(String, Tensor)>> {
        let st = lock(&self.state);
        let n_units = self.plan.units.len();
        let shards: Vec<Option<Tensor>> = (0..n_units)
            .map(|u| self.weight_shard(&st, u).map(Some))
            .collect::<Result<_>>()?;
        let weights = self.gather_full(&shards)?;
        let mut out: Vec<(String, Tensor)> = Vec::new();
        for (p, w) in self.plan.params.iter().zip(weights) {
            if let Some(w) = w {
                out.push((p.name.clone(), w));
            }
        }
        if opts.optimizer {
            let ms = self.gather_full(&st.m)?;
            let vs = self.gather_full(&st.v)?;
            out.push(("adamw.step_count".into(), counter(st.step_count)?));
            for (pi, p) in self.plan.params.iter().enumerate() {
                if let (Some(m), Some(v), true) = (&ms[pi], &vs[pi], st.steps[pi] > 0) {
                    out.push((format!("adamw.m.{}", p.name), m.clone()));
                    out.push((format!("adamw.v.{}", p.name), v.clone()));
                    out.push((format!("adamw.step.{}", p.name), counter(st.steps[pi])?));
                }
            }
        }
        if opts.rank0_only && self.topo.dp.rank() != 0 {
            out.clear();
        }
        Ok(out)
    }

    fn load_full_state_dict(&self, tensors: &[(String, Tensor)], strict: bool) -> Result<()> {
        let mut map: HashMap<&str, &Tensor> = HashMap::with_capacity(tensors.len());
        for (n, t) in tensors {
            if map.insert(n.as_str(), t).is_some() {
                meshgrad_tensor::bail!("tensor {n} appears twice in the state dict");
            }
        }
        let master = self.master_dtype;
        // Check and convert everything before changing anything.
        let mut used: HashSet<&str> = HashSet::new();
        let mut weights: Vec<Option<Tensor>> = Vec::with_capacity(self.plan.params.len());
        let mut missing = Vec::new();
        for p in &self.plan.params {
            match map.get(p.name.as_str()) {
                Some(t) => {
                    used.insert(p.name.as_str());
                    weights.push(Some(convert(&p.name, t, &p.shape, master)?));
                }
                None => {
                    missing.push(p.name.as_str());
                    weights.push(None);
                }
            }
        }
        let optim = match map.get("adamw.step_count") {
            None => None,
            Some(t) => {
                used.insert("adamw.step_count");
                let count = read_counter("adamw.step_count", t)?;
                let mut per = Vec::with_capacity(self.plan.params.len());
                for p in &self.plan.params {
                    let keys = [
                        format!("adamw.m.{}", p.name),
                        format!("adamw.v.{}", p.name),
                        format!("adamw.step.{}", p.name),
                    ];
                    let found: Vec<Option<&&Tensor>> =
                        keys.iter().map(|k| map.get(k.as_str())).collect();
                    match (found[0], found[1], found[2]) {
                        (None, None, None) => per.push(None),
                        (Some(m), Some(v), Some(s)) => {
                            per.push(Some((
                                convert(&keys[0], m, &p.shape, master)?,
                                convert(&keys[1], v, &p.shape, master)?,
                                read_counter(&keys[2], s)?,
                            )));
                            for k in &keys {
                                if let Some((k, _)) = map.get_key_value(k.as_str()) {
                                    used.insert(k);
                                }
                            }
                        }
                        _ => meshgrad_tensor::bail!(
                            "parameter {} needs all of {}, {} and {}; the state dict has only some",
                            p.name,
                            keys[0],
                            keys[1],
                            keys[2]
                        ),
                    }
                }
                Some((count, per))
            }
        };
        if strict {
            if !missing.is_empty() {
                meshgrad_tensor::bail!("the state dict is missing {}", list(&missing));
            }
            let mut unexpected: Vec<&str> =
                map.keys().copied().filter(|k| !used.contains(k)).collect();
            if !unexpected.is_empty() {
                unexpected.sort_unstable();
                meshgrad_tensor::bail!(
                    "the state dict has tensors the model does not: {}",
                    list(&unexpected)
                );
            }
        }
        let mut st = lock(&self.state);
        let summoned = st.summoned;
        // Weights: ZeRO-1/2 hold them whole; the master shards take this rank's slices.
        if self.config.stage != ZeroStage::Three {
            for (pi, w) in weights.iter().enumerate() {
                if let Some(w) = w {
                    self.vars[pi]
                        .tensor()
                        .copy_from(&w.to_dtype(self.param_dtype)?)?;
                }
            }
        }
        let mut shards = std::mem::take(&mut st.master);
        let r = self.scatter_into(&mut shards, &weights);
        st.master = shards;
        r?;
        if let Some((count, per)) = optim {
            for u in 0..self.plan.units.len() {
                let n = self.plan.units[u].shard_len;
                with_tag(MemoryTag::OptimizerState, || -> Result<()> {
                    st.m[u] = Some(Tensor::zeros(n, master, Device::Cpu)?);
                    st.v[u] = Some(Tensor::zeros(n, master, Device::Cpu)?);
                    Ok(())
                })?;
            }
            let ms: Vec<Option<Tensor>> = per
                .iter()
                .map(|x| x.as_ref().map(|s| s.0.clone()))
                .collect();
            let vs: Vec<Option<Tensor>> = per
                .iter()
                .map(|x| x.as_ref().map(|s| s.1.clone()))
                .collect();
            let mut m = std::mem::take(&mut st.m);
            let mut v = std::mem::take(&mut st.v);
            let r = self
                .scatter_into(&mut m, &ms)
                .and_then(|_| self.scatter_into(&mut v, &vs));
            st.m = m;
            st.v = v;
            r?;
            st.steps = per.iter().map(|x| x.as_ref().map_or(0, |s| s.2)).collect();
            st.step_count = count;
        }
        if self.config.stage == ZeroStage::Three {
            st.summoned = false;
            for u in 0..self.plan.units.len() {
                self.release(&mut st, u);
            }
            if summoned {
                for u in 0..self.plan.units.len() {
                    self.ensure_gathered(&mut st, u)?;
                }
                st.summoned = true;
            }
        }
        Ok(())
    }

    /// Copies this rank's slices of the full per-parameter tensors `full` (master dtype) into
    /// the per-unit shards `shards` (units whose shard is `None` are skipped).
    fn scatter_into(&self, shards: &mut [Option<Tensor>], full: &[Option<Tensor>]) -> Result<()> {
        for (u, shard) in shards.iter_mut().enumerate() {
            let Some(shard) = shard else { continue };
            for s in self.plan.segments(u, self.shard_rank) {
                if let Some(f) = &full[s.param] {
                    let p = &self.plan.params[s.param];
                    let src = f
                        .reshape(p.numel)?
                        .narrow(0, s.param_range.start, s.len())?;
                    shard.narrow(0, s.shard_offset, s.len())?.copy_from(&src)?;
                }
            }
        }
        Ok(())
    }
}

fn convert(name: &str, t: &Tensor, shape: &[usize], dtype: DType) -> Result<Tensor> {
    if t.dims() != shape {
        meshgrad_tensor::bail!(
            "{name}: the state dict has shape {:?} but the model expects {shape:?}",
            t.dims()
        );
    }
    t.to_device(Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(|e| Error::msg(format!("{name}: {e}")))
}

fn counter(v: u64) -> Result<Tensor> {
    Tensor::from_vec(vec![v as i64], 1, Device::Cpu)
}

fn read_counter(name: &str, t: &Tensor) -> Result<u64> {
    if t.elem_count() != 1 {
        meshgrad_tensor::bail!("{name}: expected one element, got shape {}", t.shape());
    }
    let v = t.to_dtype(DType::F64)?.to_vec::<f64>()?[0];
    if !(v >= 0.0 && v.fract() == 0.0) {
        meshgrad_tensor::bail!("{name}: {v} is not a step count");
    }
    Ok(v as u64)
}

fn list(names: &[&str]) -> String {
    const SHOWN: usize = 10;
    let mut s = names
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        s.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    s
}

impl ShardedDataParallel {
    /// The full (unsharded) state: every parameter's values (in the master dtype, so mixed
    /// precision loses nothing) and, with `opts.optimizer`, the AdamW state, gathered from the
    /// shards. Works for every strategy; collective over the shard group.
    pub fn full_state_dict(&self, opts: FullStateDictOptions) -> Result<Vec<(String, Tensor)>> {
        self.inner
            .full_state_dict(opts)
            .map_err(|e| Error::msg(format!("sharded data parallel full_state_dict: {e}")))
    }

    /// Loads a full state dict (as [`ShardedDataParallel::full_state_dict`] or
    /// [`meshgrad_nn::state::state_dict`] / `AdamW::state_dict` write it) into any strategy:
    /// each rank takes its shard (ZeRO-1/2 also copy the whole parameters). Optimizer state is
    /// loaded when the dict has `adamw.step_count`. With `strict`, every parameter must be
    /// present and every tensor known. Everything is checked before anything changes. Local: no
    /// communication (every rank must load the same dict).
    pub fn load_full_state_dict(&self, tensors: &[(String, Tensor)], strict: bool) -> Result<()> {
        self.inner
            .load_full_state_dict(tensors, strict)
            .map_err(|e| Error::msg(format!("sharded data parallel load_full_state_dict: {e}")))
    }
}
