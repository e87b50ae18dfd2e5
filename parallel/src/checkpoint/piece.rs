//! [`Piece`]: the part of one tensor a rank holds, with where it sits in the global tensor; and
//! the pieces of a module's parameters and of a (not sharded) optimizer's state.

use std::collections::HashMap;
use std::ops::Range;

use meshgrad_autograd::Var;
use meshgrad_nn::optim::{Optimizer, StateKind};
use meshgrad_nn::Module;
use meshgrad_tensor::{Error, Result, Tensor};

use super::format::{Role, Split, StateRole};

/// The prefix of optimizer-state tensor names: `optim/<the optimizer's state-dict key>`, e.g.
/// `optim/adamw.m.h.0.mlp.c_fc.weight` (AdamW's first moment, PyTorch's `exp_avg`).
pub const OPTIM_PREFIX: &str = "optim/";

/// The part of one tensor this rank holds, as [`super::save`] writes it.
///
/// The *local tensor* is the tensor-parallel part described by `split` (the whole tensor when
/// `split` is `None`); `range`, when set, is a flat element range of the flattened local tensor
/// (a ZeRO segment) and `data` then holds exactly those elements (any shape with `range.len()`
/// elements); otherwise `data` is the whole local tensor.
#[derive(Clone, Debug)]
pub struct Piece {
    /// The tensor's name (a parameter's model name, `optim/<key>` for optimizer state).
    pub name: String,
    /// What the tensor is.
    pub role: Role,
    /// The tensor's global shape.
    pub shape: Vec<usize>,
    /// The tensor-parallel part the local tensor is (`None`: the whole tensor).
    pub split: Option<Split>,
    /// The flat range of the local tensor `data` holds (`None`: all of it).
    pub range: Option<Range<usize>>,
    /// The elements.
    pub data: Tensor,
}

impl Piece {
    /// A whole, replicated tensor (no split, no range).
    pub fn whole(name: impl Into<String>, role: Role, data: Tensor) -> Piece {
        Piece {
            name: name.into(),
            role,
            shape: data.dims().to_vec(),
            split: None,
            range: None,
            data,
        }
    }

    /// The local tensor `data` of a tensor placed like `var` (its tensor-parallel placement,
    /// if any): the global shape follows from the placement.
    pub fn placed_like(name: impl Into<String>, role: Role, var: &Var, data: Tensor) -> Piece {
        let placement = var.placement();
        let split = placement.as_ref().and_then(Split::of);
        let shape = match &placement {
            Some(p) if split.is_some() => p.global_dims(data.dims()),
            _ => data.dims().to_vec(),
        };
        Piece {
            name: name.into(),
            role,
            shape,
            split,
            range: None,
            data,
        }
    }

    /// The elements of the local tensor, `range.len()` of them when a range is set.
    pub fn local_numel(&self) -> usize {
        match &self.split {
            Some(s) => s.local_dims(&self.shape).iter().product(),
            None => self.shape.iter().product(),
        }
    }

    /// Checks the description against the data: a valid split, a range within the local
    /// tensor, and as many elements as described. One-line message naming the tensor.
    pub fn check(&self) -> Result<()> {
        let bad = |why: String| Error::msg(format!("checkpoint piece {}: {why}", self.name));
        if let Some(s) = &self.split {
            s.check(&self.shape).map_err(bad)?;
        }
        let local = self.local_numel();
        let want = match &self.range {
            Some(r) if r.start >= r.end || r.end > local => {
                return Err(bad(format!(
                    "element range {}..{} is not within its local tensor of {local} elements",
                    r.start, r.end
                )))
            }
            Some(r) => r.len(),
            None => local,
        };
        if self.data.elem_count() != want {
            return Err(bad(format!(
                "holds {} elements (shape {}) but its description needs {want}",
                self.data.elem_count(),
                self.data.shape()
            )));
        }
        if self.range.is_none() {
            let dims = match &self.split {
                Some(s) => s.local_dims(&self.shape),
                None => self.shape.clone(),
            };
            if self.data.dims() != dims.as_slice() {
                return Err(bad(format!(
                    "has shape {} but its local shape is {dims:?}",
                    self.data.shape()
                )));
            }
        }
        Ok(())
    }
}

/// The pieces of `model`'s parameters on this rank: each parameter's local tensor under its
/// model name, placed by its tensor-parallel [`Placement`](meshgrad_autograd::distributed::Placement)
/// (whole when it has none). Replicas (data-parallel ranks, the tied table's copies on two
/// pipeline stages) give identical pieces, which [`super::save`] writes once.
///
/// Under ZeRO take the pieces from the wrapper instead
/// ([`ShardedDataParallel::local_pieces`](crate::ShardedDataParallel::local_pieces)): it holds
/// the master weights, and a ZeRO-3 model's parameters are released between uses (reading them
/// here would gather them).
pub fn pieces_of_module(model: &dyn Module) -> Result<Vec<Piece>> {
    Ok(pieces_of_parameters(&model.named_parameters()))
}

/// The pieces of the named parameters `params` on this rank, as [`pieces_of_module`] gives a
/// module's (for some of a module's parameters: the experts a sharded wrapper leaves alone).
pub fn pieces_of_parameters(params: &[(String, Var)]) -> Vec<Piece> {
    params
        .iter()
        .map(|(name, v)| Piece::placed_like(name.clone(), Role::Parameter, v, v.tensor().clone()))
        .collect()
}

/// The role of the optimizer state entry `key` by the optimizer's [`Optimizer::state_kind`].
pub(crate) fn state_role(opt: &dyn Optimizer, key: &str) -> Result<Role> {
    Ok(match opt.state_kind(key) {
        Some(StateKind::Elementwise { param }) => Role::Optimizer {
            state: StateRole::Elementwise,
            param: Some(param),
        },
        Some(StateKind::PerParam { param }) => Role::Optimizer {
            state: StateRole::PerParam,
            param: Some(param),
        },
        Some(StateKind::Global) => Role::Optimizer {
            state: StateRole::Global,
            param: None,
        },
        None => meshgrad_tensor::bail!(
            "optimizer state {key}: the optimizer does not say what it holds (state_kind)"
        ),
    })
}

/// The pieces of a (not sharded) optimizer's state on this rank, named `optim/<key>` after its
/// state dict ([`Optimizer::state_dict`]): elementwise state (moments, momentum buffers) is
/// placed like its parameter (the same tensor-parallel split), per-parameter and global values
/// are whole. For data-parallel, tensor-parallel and pipeline ranks without ZeRO; under ZeRO the
/// wrapper's [`local_pieces`](crate::ShardedDataParallel::local_pieces) include the optimizer.
pub fn pieces_of_optimizer(opt: &dyn Optimizer) -> Result<Vec<Piece>> {
    let vars: HashMap<&str, &Var> = opt
        .param_groups()
        .iter()
        .flat_map(|g| g.params.iter().map(|(n, v)| (n.as_str(), v)))
        .collect();
    let mut out = Vec::new();
    for (key, t) in opt.state_dict()? {
        let role = state_role(opt, &key)?;
        let name = format!("{OPTIM_PREFIX}{key}");
        let piece = match &role {
            Role::Optimizer {
                state: StateRole::Elementwise,
                param: Some(param),
            } => {
                let var = vars.get(param.as_str()).ok_or_else(|| {
                    Error::msg(format!(
                        "optimizer state {key}: its parameter {param} is not in the optimizer"
                    ))
                })?;
                Piece::placed_like(name, role.clone(), var, t)
            }
            _ => Piece::whole(name, role, t),
        };
        out.push(piece);
    }
    Ok(out)
}
