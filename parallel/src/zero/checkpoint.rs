//! Full (unsharded) state dicts: gathered from any strategy, loaded into any.
//!
//! The names are those of the model's parameters and, for the optimizer, those of the
//! optimizer's own state dict over the full parameters (AdamW: `adamw.step_count`,
//! `adamw.m.<name>`, `adamw.v.<name>`, `adamw.step.<name>`; SGD: `sgd.step_count`,
//! `sgd.momentum_buffer.<name>`), so a full state dict saved from any layout loads into a
//! single-device model ([`meshgrad_nn::state::load_state_dict`]) and optimizer, or into any
//! other layout, whatever its shard degree.
//!
//! Each rank's optimizer holds the state of its shard variables, named after their parameters
//! ([`super::optim`]). [`Optimizer::state_kind`](meshgrad_nn::optim::Optimizer::state_kind)
//! says which entries are elementwise (gathered and split like the weights), per-parameter
//! (one value, the same on every rank owning part of the parameter) or global.

use std::collections::{HashMap, HashSet};

use meshgrad_autograd::distributed::Placement;
use meshgrad_nn::optim::StateKind;
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use super::config::ZeroStage;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};
use meshgrad_nn::state::name_list as list;

/// What [`ShardedDataParallel::full_state_dict`] returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FullStateDictOptions {
    /// Include the optimizer state (the optimizer's names).
    pub optimizer: bool,
    /// Only data-parallel rank 0 gets the tensors (the others get an empty list); every rank
    /// still takes part in the gathers.
    pub rank0_only: bool,
}

/// A kind of per-parameter optimizer state: the keys `<prefix><parameter name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Slot {
    prefix: String,
    elementwise: bool,
    dtype: DType,
}

const DTYPES: [DType; 7] = [
    DType::F64,
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::U8,
    DType::U32,
    DType::I64,
];

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

    /// The optimizer's state over the full parameters: every rank's entries (see the module
    /// docs) assembled over the shard group. Collective over the shard group.
    fn full_optimizer_state(&self, st: &State) -> Result<Vec<(String, Tensor)>> {
        let n = self.plan.params.len();
        let index: HashMap<&str, usize> = self
            .plan
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        let mut globals = Vec::new();
        // The per-parameter entries this rank has, by slot (the key without the parameter name).
        let mut slots: Vec<Slot> = Vec::new();
        let mut local: HashMap<(usize, usize), Tensor> = HashMap::new();
        for (key, t) in st.opt.state_dict()? {
            let (param, elementwise) = match st.opt.state_kind(&key) {
                Some(StateKind::Global) => {
                    globals.push((key, t));
                    continue;
                }
                Some(StateKind::Elementwise { param }) => (param, true),
                Some(StateKind::PerParam { param }) => (param, false),
                None => meshgrad_tensor::bail!(
                    "the optimizer's state dict has {key}, which its state_kind does not describe"
                ),
            };
            let (Some(&pi), Some(prefix)) = (index.get(param.as_str()), key.strip_suffix(&param))
            else {
                meshgrad_tensor::bail!(
                    "optimizer state {key}: no parameter {param} (or the key does not end with it)"
                );
            };
            if !elementwise && t.elem_count() != 1 {
                meshgrad_tensor::bail!(
                    "optimizer state {key}: a per-parameter value must have one element, got {}",
                    t.shape()
                );
            }
            let slot = Slot {
                prefix: prefix.to_string(),
                elementwise,
                dtype: t.dtype(),
            };
            let si = match slots.iter().position(|s| *s == slot) {
                Some(i) => i,
                None => {
                    slots.push(slot);
                    slots.len() - 1
                }
            };
            local.insert((si, pi), t);
        }
        // Every rank of the shard group must run the same gathers: agree on the slots first.
        let all = self.union_slots(&slots)?;
        let mut per_param: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); n];
        for slot in &all {
            let si = slots.iter().position(|s| s == slot);
            let mine = |pi: usize| si.and_then(|si| local.get(&(si, pi)));
            // Per parameter: whether this rank has the entry, and its value (per-parameter).
            let mut info = vec![0f64; 2 * n];
            for pi in 0..n {
                if let Some(t) = mine(pi) {
                    info[pi] = 1.0;
                    if !slot.elementwise {
                        info[n + pi] = t.to_dtype(DType::F64)?.to_vec::<f64>()?[0];
                    }
                }
            }
            let info = self
                .topo
                .shard
                .all_gather(&Tensor::from_vec(info, 2 * n, Device::Cpu)?)?
                .wait()?
                .to_vec::<f64>()?;
            let found = |pi: usize| info.chunks(2 * n).find(|r| r[pi] == 1.0).map(|r| r[n + pi]);
            if slot.elementwise {
                let mut shards = Vec::with_capacity(self.plan.units.len());
                for u in 0..self.plan.units.len() {
                    let shard =
                        Tensor::zeros(self.plan.units[u].shard_len, slot.dtype, Device::Cpu)?;
                    for s in self.plan.segments(u, self.shard_rank) {
                        if let Some(t) = mine(s.param) {
                            shard.narrow(0, s.shard_offset, s.len())?.copy_from(t)?;
                        }
                    }
                    shards.push(Some(shard));
                }
                for (pi, full) in self.gather_full(&shards)?.into_iter().enumerate() {
                    if let (Some(full), Some(_)) = (full, found(pi)) {
                        let name = format!("{}{}", slot.prefix, self.plan.params[pi].name);
                        per_param[pi].push((name, full));
                    }
                }
            } else {
                for (pi, out) in per_param.iter_mut().enumerate() {
                    if let Some(v) = found(pi) {
                        let name = format!("{}{}", slot.prefix, self.plan.params[pi].name);
                        let t = Tensor::from_vec(vec![v], 1, Device::Cpu)?.to_dtype(slot.dtype)?;
                        out.push((name, t));
                    }
                }
            }
        }
        globals.extend(per_param.into_iter().flatten());
        Ok(globals)
    }

    /// The slots of every rank of the shard group, in order of first appearance (rank order).
    fn union_slots(&self, mine: &[Slot]) -> Result<Vec<Slot>> {
        let shard = &self.topo.shard;
        if shard.world_size() == 1 {
            return Ok(mine.to_vec());
        }
        let text: String = mine
            .iter()
            .map(|s| format!("{}\t{}\t{}\n", s.elementwise as u8, s.dtype, s.prefix))
            .collect();
        let bytes: Vec<f64> = text.bytes().map(f64::from).collect();
        let lens = shard
            .all_gather(&Tensor::from_vec(vec![bytes.len() as f64], 1, Device::Cpu)?)?
            .wait()?
            .to_vec::<f64>()?;
        let max = lens.iter().fold(0f64, |a, &b| a.max(b)) as usize;
        let mut padded = bytes;
        padded.resize(max.max(1), 0.0);
        let all = shard
            .all_gather(&Tensor::from_vec(padded, max.max(1), Device::Cpu)?)?
            .wait()?
            .to_vec::<f64>()?;
        let mut out: Vec<Slot> = Vec::new();
        for (r, &len) in lens.iter().enumerate() {
            let start = r * max.max(1);
            let bytes: Vec<u8> = all[start..start + len as usize]
                .iter()
                .map(|&b| b as u8)
                .collect();
            let text = String::from_utf8(bytes)
                .map_err(|e| Error::msg(format!("optimizer state names: {e}")))?;
            for line in text.lines() {
                let mut f = line.splitn(3, '\t');
                let (Some(e), Some(d), Some(prefix)) = (f.next(), f.next(), f.next()) else {
                    meshgrad_tensor::bail!("internal error: bad optimizer slot {line:?}");
                };
                let dtype = DTYPES
                    .into_iter()
                    .find(|t| t.to_string() == d)
                    .ok_or_else(|| Error::msg(format!("internal error: dtype {d}")))?;
                let slot = Slot {
                    prefix: prefix.to_string(),
                    elementwise: e == "1",
                    dtype,
                };
                match out.iter().find(|s| s.prefix == slot.prefix) {
                    None => out.push(slot),
                    Some(s) if *s == slot => {}
                    Some(s) => meshgrad_tensor::bail!(
                        "optimizer state {}*: ranks disagree on its kind or dtype ({:?} vs {:?})",
                        slot.prefix,
                        s,
                        slot
                    ),
                }
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
            out.extend(self.full_optimizer_state(&st)?);
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
        // The optimizer's entries: this rank's part of each, under the same names.
        let mut optim: Vec<(String, Tensor)> = Vec::new();
        let mut has_optim = false;
        {
            let st = lock(&self.state);
            let index: HashMap<&str, usize> = self
                .plan
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| (p.name.as_str(), i))
                .collect();
            for (key, t) in tensors {
                if index.contains_key(key.as_str()) {
                    continue;
                }
                let (param, elementwise) = match st.opt.state_kind(key) {
                    None => continue,
                    Some(StateKind::Global) => {
                        used.insert(key.as_str());
                        has_optim = true;
                        optim.push((key.clone(), t.clone()));
                        continue;
                    }
                    Some(StateKind::Elementwise { param }) => (param, true),
                    Some(StateKind::PerParam { param }) => (param, false),
                };
                // State of a parameter the model does not have is an unexpected tensor.
                let Some(&pi) = index.get(param.as_str()) else {
                    continue;
                };
                used.insert(key.as_str());
                has_optim = true;
                let p = &self.plan.params[pi];
                if elementwise && t.dims() != p.shape.as_slice() {
                    meshgrad_tensor::bail!(
                        "{key}: the state dict has shape {:?} but parameter {} has shape {:?}",
                        t.dims(),
                        p.name,
                        p.shape
                    );
                }
                let Some(k) = self.shard_of[pi] else { continue };
                let t = if elementwise {
                    let r = &self.shards[k].seg.param_range;
                    t.to_device(Device::Cpu)?
                        .reshape(p.numel)?
                        .narrow(0, r.start, r.len())?
                } else {
                    t.clone()
                };
                optim.push((key.clone(), t));
            }
        }
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
        // The optimizer checks its part before changing anything; then nothing can fail.
        if has_optim {
            st.opt
                .load_state_dict(&optim)
                .map_err(|e| Error::msg(format!("optimizer state: {e}")))?;
        }
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

impl ShardedDataParallel {
    /// The full (unsharded) state: every parameter's values (in the master dtype, so mixed
    /// precision loses nothing) and, with `opts.optimizer`, the optimizer's state as the same
    /// optimizer over the whole model would name it, gathered from the shards. Works for every
    /// strategy; collective over the shard group.
    ///
    /// Parameters split by tensor parallelism (a [`Placement`] on the variable) and their
    /// elementwise optimizer state are also gathered over their group (a collective of the
    /// tensor-parallel ranks, which every one of them calls), so the result is the
    /// single-device state whatever the layout.
    pub fn full_state_dict(&self, opts: FullStateDictOptions) -> Result<Vec<(String, Tensor)>> {
        let ctx = |e: Error| Error::msg(format!("sharded data parallel full_state_dict: {e}"));
        let out = self.inner.full_state_dict(opts).map_err(ctx)?;
        out.into_iter()
            .map(|(key, t)| match self.inner.placement_of_key(&key) {
                Some(p) => Ok((key, p.gather(&t).map_err(ctx)?)),
                None => Ok((key, t)),
            })
            .collect()
    }

    /// Loads a full state dict (as [`ShardedDataParallel::full_state_dict`] or
    /// [`meshgrad_nn::state::state_dict`] / the single-device optimizer's `state_dict` write it)
    /// into any strategy: each rank takes its shard (ZeRO-1/2 also copy the whole parameters).
    /// Optimizer state is loaded when the dict has entries of this wrapper's optimizer (by
    /// [`Optimizer::state_kind`](meshgrad_nn::optim::Optimizer::state_kind)); it then replaces
    /// the whole optimizer state, as the optimizer's `load_state_dict` does. With `strict`,
    /// every parameter must be present and every tensor known. Everything is checked before
    /// anything changes. Local: no communication (every rank must load the same dict).
    ///
    /// Under tensor parallelism each rank first takes its part of every split parameter (and of
    /// its elementwise optimizer state) from the full tensors.
    pub fn load_full_state_dict(&self, tensors: &[(String, Tensor)], strict: bool) -> Result<()> {
        let ctx = |e: Error| Error::msg(format!("sharded data parallel load_full_state_dict: {e}"));
        let local: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(key, t)| match self.inner.placement_of_key(key) {
                Some(p) => Ok((
                    key.clone(),
                    p.shard_of(t)
                        .map_err(|e| ctx(Error::msg(format!("{key}: {e}"))))?,
                )),
                None => Ok((key.clone(), t.clone())),
            })
            .collect::<Result<_>>()?;
        self.inner.load_full_state_dict(&local, strict).map_err(ctx)
    }
}

impl Inner {
    /// The tensor-parallel placement of a full-state-dict entry: a split parameter's weights or
    /// its elementwise optimizer state.
    fn placement_of_key(&self, key: &str) -> Option<Placement> {
        let param = match self.plan.params.iter().position(|p| p.name == key) {
            Some(i) => i,
            None => {
                let kind = lock(&self.state).opt.state_kind(key);
                let Some(StateKind::Elementwise { param }) = kind else {
                    return None;
                };
                self.plan.params.iter().position(|p| p.name == param)?
            }
        };
        self.vars[param].placement().filter(|p| p.degree() > 1)
    }
}
