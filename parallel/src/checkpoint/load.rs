//! Loading into a model and a (not sharded) optimizer of the current layout: each parameter
//! and each elementwise optimizer state takes the part its tensor-parallel placement says.

use std::collections::{HashMap, HashSet};

use meshgrad_autograd::{no_grad, Var};
use meshgrad_nn::optim::{Optimizer, StateKind};
use meshgrad_nn::Module;
use meshgrad_tensor::{DType, Result, Tensor};

use super::format::{Role, Split};
use super::open::Checkpoint;
use super::piece::OPTIM_PREFIX;
pub(crate) use meshgrad_nn::state::name_list as list;

/// The split of `var`'s local tensor and its global shape.
pub(crate) fn split_and_global(var: &Var, local: &[usize]) -> (Option<Split>, Vec<usize>) {
    let placement = var.placement();
    let split = placement.as_ref().and_then(Split::of);
    let global = match (&placement, &split) {
        (Some(p), Some(_)) => p.global_dims(local),
        _ => local.to_vec(),
    };
    (split, global)
}

impl Checkpoint {
    /// Checks that parameter `name` of global shape `global` is in the checkpoint as a
    /// parameter of that shape.
    pub(crate) fn check_parameter(&self, name: &str, global: &[usize]) -> Result<()> {
        let Some(t) = self.tensor(name) else {
            return Err(self.err(format!("has no parameter {name} (the model has one)")));
        };
        if t.role != Role::Parameter {
            return Err(self.err(format!("tensor {name} is not a parameter ({:?})", t.role)));
        }
        if t.shape != global {
            return Err(self.err(format!(
                "parameter {name} has shape {:?} in the checkpoint but {global:?} in the model",
                t.shape
            )));
        }
        Ok(())
    }

    /// Parameters of the checkpoint that are not in `have`, as a one-line error (`strict`).
    pub(crate) fn check_no_extra_parameters(&self, have: &HashSet<&str>) -> Result<()> {
        let extra: Vec<&str> = self
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter && !have.contains(t.name.as_str()))
            .map(|t| t.name.as_str())
            .collect();
        if !extra.is_empty() {
            return Err(self.err(format!(
                "has parameters the model does not: {}",
                list(&extra)
            )));
        }
        Ok(())
    }

    /// Gives every parameter of `model` its part of the saved value for the model's *current*
    /// placements (any tensor-parallel degree, or none), converted to the parameter's dtype.
    /// With `strict`, every parameter of the checkpoint must be in the model (a pipeline stage,
    /// holding some of them, passes `false`). Everything is read and checked before any
    /// parameter changes. Local (no communication).
    ///
    /// Under ZeRO, load through the wrapper
    /// ([`ShardedDataParallel::load_pieces`](crate::ShardedDataParallel::load_pieces)).
    pub fn load_into_module(&self, model: &dyn Module, strict: bool) -> Result<()> {
        self.load_parameters(&model.named_parameters(), strict)
    }

    /// [`Checkpoint::load_into_module`] for the named parameters `params` (some of a module's:
    /// the experts a sharded wrapper leaves alone). With `strict`, every parameter of the
    /// checkpoint must be among them.
    pub fn load_parameters(&self, params: &[(String, Var)], strict: bool) -> Result<()> {
        let mut values: Vec<(&Var, Tensor)> = Vec::with_capacity(params.len());
        for (name, var) in params {
            let local = var.tensor().dims().to_vec();
            let (split, global) = split_and_global(var, &local);
            self.check_parameter(name, &global)?;
            let t = self
                .read_local(name, split.as_ref(), None)?
                .to_dtype(var.tensor().dtype())?
                .to_device(var.tensor().device())?;
            values.push((var, t));
        }
        if strict {
            let have: HashSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
            self.check_no_extra_parameters(&have)?;
        }
        no_grad(|| {
            values
                .iter()
                .try_for_each(|(var, t)| var.tensor().copy_from(t))
        })
    }

    /// Every parameter of the checkpoint, whole, by name, in index order (for evaluation,
    /// generation and export on one device; one tensor is assembled at a time).
    pub fn full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter)
            .map(|t| Ok((t.name.clone(), self.read_full(&t.name)?)))
            .collect()
    }

    /// The exact weights ([`Optimizer::exact_weights_key`]) of the half-precision parameters
    /// among `vars` that `dict` has none for but whose checkpoint tensor is stored in a finer
    /// dtype than the parameter's: a ZeRO run's parameters are its f32 master shards, which a
    /// replicated half-precision run keeps as optimizer state. Each is this rank's part.
    fn exact_weights_from_parameters(
        &self,
        opt: &dyn Optimizer,
        vars: &HashMap<String, Var>,
        dict: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>> {
        let have: HashSet<&str> = dict.iter().map(|(k, _)| k.as_str()).collect();
        // Parameters with saved state (a master only joins state that exists).
        let stepped: HashSet<String> = dict
            .iter()
            .filter_map(|(k, _)| match opt.state_kind(k) {
                Some(StateKind::Elementwise { param } | StateKind::PerParam { param }) => {
                    Some(param)
                }
                _ => None,
            })
            .collect();
        let mut out = Vec::new();
        for (name, v) in vars {
            let Some(key) = opt.exact_weights_key(name) else {
                continue;
            };
            if !stepped.contains(name) {
                continue;
            }
            let dtype = v.tensor().dtype();
            let Some(entry) = self.tensor(name) else {
                continue;
            };
            let finer = entry.dtype()?.size_in_bytes() > dtype.size_in_bytes();
            let half = matches!(dtype, DType::BF16 | DType::F16);
            if have.contains(key.as_str()) || !half || !finer {
                continue;
            }
            let local = v.tensor().dims().to_vec();
            let (split, _) = split_and_global(v, &local);
            out.push((key, self.read_local(name, split.as_ref(), None)?));
        }
        Ok(out)
    }

    /// Restores a (not sharded) optimizer's state, each elementwise state taking the part its
    /// parameter's current placement says; per-parameter and global values are taken whole.
    /// Then [`Optimizer::load_state_dict`] checks and replaces the whole state (state of a
    /// parameter the checkpoint has none for is cleared, as for one that never stepped). With
    /// `strict`, optimizer state of parameters the optimizer does not have, or of another
    /// optimizer, is an error; without it (pipeline stages) it is skipped. Local.
    pub fn load_optimizer(&self, opt: &mut dyn Optimizer, strict: bool) -> Result<()> {
        let vars: HashMap<String, Var> = opt
            .param_groups()
            .iter()
            .flat_map(|g| g.params.iter().cloned())
            .collect();
        let mut dict = Vec::new();
        let mut unexpected = Vec::new();
        for t in self.tensors() {
            if !matches!(t.role, Role::Optimizer { .. }) {
                continue;
            }
            let key = t.name.strip_prefix(OPTIM_PREFIX).unwrap_or(&t.name);
            let value = match opt.state_kind(key) {
                None => None,
                Some(StateKind::Global) => Some(self.read_full(&t.name)?),
                Some(StateKind::PerParam { param }) => match vars.contains_key(&param) {
                    true => Some(self.read_full(&t.name)?),
                    false => None,
                },
                Some(StateKind::Elementwise { param }) => match vars.get(&param) {
                    Some(v) => {
                        let local = v.tensor().dims().to_vec();
                        let (split, global) = split_and_global(v, &local);
                        if t.shape != global {
                            return Err(self.err(format!(
                                "optimizer state {} has shape {:?} but parameter {param} has \
                                 global shape {global:?}",
                                t.name, t.shape
                            )));
                        }
                        Some(self.read_local(&t.name, split.as_ref(), None)?)
                    }
                    None => None,
                },
            };
            match value {
                Some(v) => dict.push((key.to_string(), v)),
                None => unexpected.push(t.name.as_str()),
            }
        }
        if strict && !unexpected.is_empty() {
            return Err(self.err(format!(
                "has optimizer state this optimizer has no parameter for (or of another \
                 optimizer): {}",
                list(&unexpected)
            )));
        }
        dict.extend(self.exact_weights_from_parameters(opt, &vars, &dict)?);
        opt.load_state_dict(&dict)
            .map_err(|e| self.err(format!("optimizer state: {e}")))
    }
}
