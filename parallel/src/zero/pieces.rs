//! Distributed checkpoints of sharded data parallelism: this rank's segments of the parameters
//! (master weights) and of the optimizer state as checkpoint pieces, and loading a checkpoint
//! saved under any layout into this rank's segments under the current one. Nothing is
//! gathered (see [`crate::checkpoint`]).

use std::collections::{HashMap, HashSet};

use meshgrad_nn::optim::StateKind;
use meshgrad_tensor::{Error, Result, Tensor};

use super::config::ZeroStage;
use super::wrapper::{lock, ShardedDataParallel};
use crate::checkpoint::{
    list_names, split_and_global, state_role, Checkpoint, Piece, Role, StateRole, OPTIM_PREFIX,
};

impl ShardedDataParallel {
    /// This rank's pieces for a distributed checkpoint ([`crate::checkpoint::save`]): for every
    /// segment it owns (see [`super::plan`]), the parameter's elements in the master dtype,
    /// placed as the flat range of the parameter's (tensor-parallel local) tensor; and the
    /// optimizer's state over this rank's shard, named `optim/<key>`: elementwise state placed
    /// like its segment, per-parameter and global values whole (identical on the ranks sharing
    /// them, so written once). Replicas of hybrid sharding give identical pieces, written once.
    /// Local: nothing is gathered.
    pub fn local_pieces(&self) -> Result<Vec<Piece>> {
        let i = &self.inner;
        let st = lock(&i.state);
        let mut out = Vec::new();
        for sv in &i.shards {
            let p = &i.plan.params[sv.seg.param];
            let (split, shape) = split_and_global(&i.vars[sv.seg.param], &p.shape);
            out.push(Piece {
                name: p.name.clone(),
                role: Role::Parameter,
                shape,
                split,
                range: Some(sv.seg.param_range.clone()),
                data: sv.var.tensor().clone(),
            });
        }
        let index: HashMap<&str, usize> = i
            .plan
            .params
            .iter()
            .enumerate()
            .map(|(k, p)| (p.name.as_str(), k))
            .collect();
        for (key, t) in st.opt.state_dict()? {
            let role = state_role(st.opt.as_ref(), &key)?;
            let name = format!("{OPTIM_PREFIX}{key}");
            if let Role::Optimizer {
                state: StateRole::Elementwise,
                param: Some(param),
            } = &role
            {
                let seg = index
                    .get(param.as_str())
                    .and_then(|&pi| i.shard_of[pi])
                    .map(|k| &i.shards[k].seg)
                    .ok_or_else(|| {
                        Error::msg(format!(
                            "optimizer state {key}: this rank owns no segment of {param}"
                        ))
                    })?;
                let p = &i.plan.params[seg.param];
                let (split, shape) = split_and_global(&i.vars[seg.param], &p.shape);
                out.push(Piece {
                    name,
                    role,
                    shape,
                    split,
                    range: Some(seg.param_range.clone()),
                    data: t,
                });
            } else {
                out.push(Piece::whole(name, role, t));
            }
        }
        Ok(out)
    }

    /// Loads a distributed checkpoint saved under any layout into this rank's part of the
    /// current one: the weights of the segments it owns (ZeRO-1/2: also the whole parameters,
    /// which every rank holds), and the optimizer state of its segments, each read for the
    /// parameter's current tensor-parallel placement. With `strict`, parameters and optimizer
    /// state the wrapper does not have are errors (a pipeline stage passes `false`). Everything
    /// is read and checked before anything changes. Local, except that a ZeRO-3 model under
    /// [`ShardedDataParallel::summon_full_params`] gathers its refreshed parameters (collective
    /// over the shard group).
    pub fn load_pieces(&self, ckpt: &Checkpoint, strict: bool) -> Result<()> {
        let i = &self.inner;
        let whole_params = i.config.stage != ZeroStage::Three;
        // 1. Read and check this rank's share.
        let mut params: Vec<(usize, Tensor)> = Vec::new();
        let mut segments: Vec<(usize, Tensor)> = Vec::new();
        for (pi, p) in i.plan.params.iter().enumerate() {
            let (split, global) = split_and_global(&i.vars[pi], &p.shape);
            ckpt.check_parameter(&p.name, &global)?;
            if whole_params {
                let t = ckpt.read_local(&p.name, split.as_ref(), None)?;
                if let Some(k) = i.shard_of[pi] {
                    let r = &i.shards[k].seg.param_range;
                    segments.push((k, t.reshape(p.numel)?.narrow(0, r.start, r.len())?));
                }
                params.push((pi, t));
            } else if let Some(k) = i.shard_of[pi] {
                let r = i.shards[k].seg.param_range.clone();
                segments.push((k, ckpt.read_local(&p.name, split.as_ref(), Some(r))?));
            }
        }
        let index: HashMap<&str, usize> = i
            .plan
            .params
            .iter()
            .enumerate()
            .map(|(k, p)| (p.name.as_str(), k))
            .collect();
        if strict {
            ckpt.check_no_extra_parameters(&index.keys().copied().collect::<HashSet<_>>())?;
        }
        let mut st = lock(&i.state);
        let mut dict = Vec::new();
        let mut unexpected = Vec::new();
        for t in ckpt.tensors() {
            if !matches!(t.role, Role::Optimizer { .. }) {
                continue;
            }
            let key = t.name.strip_prefix(OPTIM_PREFIX).unwrap_or(&t.name);
            let (param, elementwise) = match st.opt.state_kind(key) {
                None => {
                    unexpected.push(t.name.as_str());
                    continue;
                }
                Some(StateKind::Global) => {
                    dict.push((key.to_string(), ckpt.read_full(&t.name)?));
                    continue;
                }
                Some(StateKind::PerParam { param }) => (param, false),
                Some(StateKind::Elementwise { param }) => (param, true),
            };
            let Some(&pi) = index.get(param.as_str()) else {
                unexpected.push(t.name.as_str());
                continue;
            };
            let Some(k) = i.shard_of[pi] else { continue };
            let value = if elementwise {
                let (split, global) = split_and_global(&i.vars[pi], &i.plan.params[pi].shape);
                if t.shape != global {
                    return Err(ckpt.err(format!(
                        "optimizer state {} has shape {:?} but parameter {param} has global \
                         shape {global:?}",
                        t.name, t.shape
                    )));
                }
                let r = i.shards[k].seg.param_range.clone();
                ckpt.read_local(&t.name, split.as_ref(), Some(r))?
            } else {
                ckpt.read_full(&t.name)?
            };
            dict.push((key.to_string(), value));
        }
        if strict && !unexpected.is_empty() {
            return Err(ckpt.err(format!(
                "has optimizer state this wrapper's optimizer has no parameter for (or of \
                 another optimizer): {}",
                list_names(&unexpected)
            )));
        }
        let converted = |t: &Tensor, like: &Tensor| t.to_dtype(like.dtype());
        // A segment whose exact weights the checkpoint holds as optimizer state (a replicated
        // half-precision run's f32 masters) takes those: the optimizer's load sets them, and
        // the parameter, rounded to half precision, must not overwrite them.
        let loaded: HashSet<&str> = dict.iter().map(|(k, _)| k.as_str()).collect();
        let segments: Vec<(usize, Tensor)> = segments
            .iter()
            .filter(|(k, _)| {
                let name = &i.plan.params[i.shards[*k].seg.param].name;
                st.opt
                    .exact_weights_key(name)
                    .is_none_or(|key| !loaded.contains(key.as_str()))
            })
            .map(|(k, t)| Ok((*k, converted(t, i.shards[*k].var.tensor())?)))
            .collect::<Result<_>>()?;
        let params: Vec<(usize, Tensor)> = params
            .iter()
            .map(|(pi, t)| Ok((*pi, converted(t, i.vars[*pi].tensor())?)))
            .collect::<Result<_>>()?;
        // 2. The optimizer checks its part before changing anything; then nothing can fail
        // but the copies.
        st.opt
            .load_state_dict(&dict)
            .map_err(|e| ckpt.err(format!("optimizer state: {e}")))?;
        for (pi, t) in &params {
            i.vars[*pi].tensor().copy_from(t)?;
        }
        for (k, t) in &segments {
            i.shards[*k].var.tensor().copy_from(t)?;
        }
        if i.config.stage == ZeroStage::Three {
            // Gathered copies are stale now.
            let summoned = st.summoned;
            st.summoned = false;
            for u in 0..i.plan.units.len() {
                i.release(&mut st, u);
            }
            if summoned {
                for u in 0..i.plan.units.len() {
                    i.ensure_gathered(&mut st, u)?;
                }
                st.summoned = true;
            }
        }
        Ok(())
    }
}
