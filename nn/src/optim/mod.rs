//! Optimizers, learning-rate schedules and gradient clipping.
//!
//! * [`AdamW`] and [`Sgd`] update parameters in place with the fused flat-buffer kernels
//!   ([`Tensor::adamw_step_`], [`Tensor::sgd_step_`]); their semantics are PyTorch's
//!   `torch.optim.AdamW` and `torch.optim.SGD` (dampening 0, no Nesterov).
//! * Parameters are organised in [`ParamGroup`]s, each with its own weight decay and learning-rate
//!   scale; [`param_groups_for_decay`] applies the nanoGPT rule (decay matrices and embeddings,
//!   not biases and norm weights).
//! * [`AdamW::for_module`] and [`Sgd::for_module`] build an optimizer over a module's trainable
//!   (not frozen) parameters with defaults.
//! * [`CosineSchedule`] is linear warm-up followed by cosine decay.
//! * [`clip_grad_norm`] clips the global L2 norm of the gradients (PyTorch's
//!   `clip_grad_norm_`), with the sum of squares ([`grad_sq_sum`]) and the scaling
//!   ([`clip_grads_with_norm`]) exposed separately so a sharded version can all-reduce in between.
//!
//! * Mixed precision: [`AdamW`] keeps an f32 master copy and f32 moments for bf16 / f16
//!   parameters (see its docs), and [`AdamW::step_scaled`] applies a gradient multiplier in f32
//!   (unscaling and clipping); [`LossScaler`] is the dynamic loss scale of f16 training.
//! * [`Optimizer::state_kind`] says what each state-dict entry holds ([`StateKind`]: elementwise
//!   per-parameter state, a per-parameter value, or optimizer-wide), so code that shards the
//!   parameters (ZeRO's `ShardedDataParallel`, which runs any `Box<dyn Optimizer + Send>` over
//!   its shards; [`AdamW`] and [`Sgd`] are `Send`) can split and merge the state of any optimizer.
//!
//! Optimizer state (moments, momentum buffers) is allocated lazily at the first step and charged
//! to [`MemoryTag::OptimizerState`](meshgrad_tensor::alloc::MemoryTag::OptimizerState).

mod adamw;
mod builder;
mod clip;
mod scaler;
mod schedule;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use builder::{AdamWBuilder, SgdBuilder};
pub use clip::{clip_coef, clip_grad_norm, clip_grads_with_norm, grad_norm, grad_sq_sum};
pub use scaler::LossScaler;
pub use schedule::CosineSchedule;
pub use sgd::{Sgd, SgdConfig};

use std::collections::HashSet;

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

/// A set of parameters sharing optimizer hyper-parameters.
#[derive(Clone, Debug)]
pub struct ParamGroup {
    /// The parameters with their (unique) names; the names key the optimizer state in checkpoints.
    pub params: Vec<(String, Var)>,
    /// Weight decay of this group (decoupled for AdamW, L2 added to the gradient for SGD).
    pub weight_decay: f64,
    /// Multiplier applied to the learning rate passed to [`Optimizer::step`] for this group.
    pub lr_scale: f64,
}

impl ParamGroup {
    /// A group with the given weight decay and `lr_scale` 1.
    pub fn new(params: Vec<(String, Var)>, weight_decay: f64) -> Self {
        ParamGroup {
            params,
            weight_decay,
            lr_scale: 1.0,
        }
    }
}

/// Splits named parameters into two groups by the nanoGPT rule:
///
/// 1. parameters of rank >= 2 (matmul weights and embedding tables) get `weight_decay`;
/// 2. parameters of rank < 2 (biases, layer-norm weights and biases) get no decay.
///
/// The result always has exactly these two groups, in this order (either may be empty), both with
/// `lr_scale` 1; parameter order within a group follows `named_params`.
pub fn param_groups_for_decay(
    named_params: Vec<(String, Var)>,
    weight_decay: f64,
) -> Vec<ParamGroup> {
    let (decay, no_decay): (Vec<_>, Vec<_>) = named_params
        .into_iter()
        .partition(|(_, p)| p.tensor().rank() >= 2);
    vec![
        ParamGroup::new(decay, weight_decay),
        ParamGroup::new(no_decay, 0.0),
    ]
}

/// An optimizer over [`ParamGroup`]s.
pub trait Optimizer {
    /// Applies one update to every parameter that has a gradient, with base learning rate `lr`
    /// (each group uses `lr * lr_scale`). Parameters without a gradient are skipped (their state
    /// and step counts are left unchanged, as in PyTorch).
    fn step(&mut self, lr: f64) -> Result<()>;

    /// Clears the gradient of every parameter in every group.
    fn zero_grad(&self) {
        for g in self.param_groups() {
            for (_, p) in &g.params {
                p.zero_grad();
            }
        }
    }

    /// The parameter groups.
    fn param_groups(&self) -> &[ParamGroup];

    /// Number of calls to [`Optimizer::step`] that completed.
    fn step_count(&self) -> u64;

    /// The optimizer state as named tensors, for checkpoints (see each optimizer for the names).
    /// Moment tensors share storage with the live state: serialise them before the next step, or
    /// `deep_clone` them to keep a snapshot.
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;

    /// Restores state saved by [`Optimizer::state_dict`] for parameters with the same names and
    /// shapes. Validates everything before changing anything: on error the state is unchanged.
    fn load_state_dict(&mut self, tensors: &[(String, Tensor)]) -> Result<()>;

    /// What the state-dict entry named `key` holds, from the form of the name alone (the
    /// parameter need not be one of this optimizer's), or `None` when this optimizer never
    /// writes such a name. Code that shards parameters across ranks (ZeRO's
    /// `ShardedDataParallel`) uses it to split a full state dict into per-shard ones and to
    /// assemble them again, for any optimizer.
    fn state_kind(&self, key: &str) -> Option<StateKind>;

    /// The state-dict key whose values, when a checkpoint holds it, are parameter `param`'s
    /// exact weights (AdamW's f32 master of a half-precision parameter), or `None` when this
    /// optimizer keeps none. Loaders use it to carry exact weights across layouts that store
    /// them differently: ZeRO keeps f32 master shards as its parameters, a replicated
    /// half-precision run keeps them as optimizer state.
    fn exact_weights_key(&self, _param: &str) -> Option<String> {
        None
    }
}

/// What an entry of an optimizer's state dict holds ([`Optimizer::state_kind`]). The key of a
/// per-parameter entry ends with the parameter's name (`<prefix><name>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateKind {
    /// Elementwise state of parameter `param`: a tensor of the parameter's shape whose element
    /// `i` belongs to element `i` of the parameter (AdamW's moments, SGD's momentum buffer), so
    /// a slice of the parameter has the same slice of this state.
    Elementwise {
        /// The parameter's name.
        param: String,
    },
    /// One value for parameter `param` as a whole, a one-element tensor (AdamW's
    /// per-parameter step count).
    PerParam {
        /// The parameter's name.
        param: String,
    },
    /// Optimizer-wide (the completed-step count).
    Global,
}

impl StateKind {
    /// `Elementwise` or `PerParam` of the name after `prefix` in `key` (a non-empty name).
    pub(crate) fn parse(key: &str, prefix: &str, elementwise: bool) -> Option<StateKind> {
        let param = key
            .strip_prefix(prefix)
            .filter(|p| !p.is_empty())?
            .to_string();
        Some(if elementwise {
            StateKind::Elementwise { param }
        } else {
            StateKind::PerParam { param }
        })
    }
}

// The wrappers that own an optimizer on a rank's thread need these.
const _: () = {
    const fn send<T: Send>() {}
    send::<AdamW>();
    send::<Sgd>();
};

/// Checks that group hyper-parameters are finite and parameter names are unique.
pub(crate) fn validate_groups(opt: &str, groups: &[ParamGroup]) -> Result<()> {
    let mut seen = HashSet::new();
    for (i, g) in groups.iter().enumerate() {
        if !g.weight_decay.is_finite() || g.weight_decay < 0.0 {
            meshgrad_tensor::bail!(
                "{opt}: group {i} has weight_decay {}; it must be finite and >= 0",
                g.weight_decay
            );
        }
        if !g.lr_scale.is_finite() || g.lr_scale < 0.0 {
            meshgrad_tensor::bail!(
                "{opt}: group {i} has lr_scale {}; it must be finite and >= 0",
                g.lr_scale
            );
        }
        for (name, p) in &g.params {
            if !seen.insert(name.as_str()) {
                meshgrad_tensor::bail!(
                    "{opt}: parameter name {name} appears more than once in the groups"
                );
            }
            if !p.tensor().dtype().is_float() {
                meshgrad_tensor::bail!(
                    "{opt}: parameter {name} has dtype {}; only float parameters can be optimized",
                    p.tensor().dtype()
                );
            }
        }
    }
    Ok(())
}

/// Checks a learning rate passed to `step`.
pub(crate) fn validate_lr(opt: &str, lr: f64) -> Result<()> {
    if !lr.is_finite() || lr < 0.0 {
        meshgrad_tensor::bail!("{opt}: learning rate {lr} must be finite and >= 0");
    }
    Ok(())
}

/// The gradient of `p` ready for a fused kernel: the parameter's dtype, contiguous.
pub(crate) fn kernel_grad(p: &Var, g: &Tensor) -> Result<Tensor> {
    let t = p.tensor();
    if g.shape() != t.shape() {
        return Err(Error::ShapeMismatch {
            op: "optimizer step (gradient vs parameter)",
            lhs: g.shape().clone(),
            rhs: t.shape().clone(),
        });
    }
    g.to_dtype(t.dtype())?.contiguous()
}

/// A one-element i64 tensor holding a counter (step counts in state dicts).
pub(crate) fn counter_tensor(v: u64) -> Result<Tensor> {
    Tensor::from_vec(vec![v as i64], 1, Device::Cpu)
}

/// Reads a counter written by [`counter_tensor`] (any one-element integer or float tensor).
pub(crate) fn read_counter(name: &str, t: &Tensor) -> Result<u64> {
    if t.elem_count() != 1 {
        meshgrad_tensor::bail!(
            "optimizer state {name}: expected one element, got shape {}",
            t.shape()
        );
    }
    let v = if t.dtype() == DType::I64 {
        t.to_vec::<i64>()?[0]
    } else {
        t.item()? as i64
    };
    if v < 0 {
        meshgrad_tensor::bail!("optimizer state {name}: negative step count {v}");
    }
    Ok(v as u64)
}

/// A copy of `src` with the dtype and shape of parameter `p`, charged as optimizer state.
pub(crate) fn state_copy(what: &str, name: &str, p: &Var, src: &Tensor) -> Result<Tensor> {
    state_copy_as(what, name, p, src, p.tensor().dtype())
}

/// A copy of `src` in `dtype` with the shape and device of parameter `p`, charged as optimizer
/// state.
pub(crate) fn state_copy_as(
    what: &str,
    name: &str,
    p: &Var,
    src: &Tensor,
    dtype: DType,
) -> Result<Tensor> {
    let t = p.tensor();
    if src.shape() != t.shape() {
        meshgrad_tensor::bail!(
            "{what}.{name}: checkpoint has shape {} but the parameter has shape {}",
            src.shape(),
            t.shape()
        );
    }
    meshgrad_tensor::alloc::with_tag(meshgrad_tensor::alloc::MemoryTag::OptimizerState, || {
        let s = src.to_device(t.device())?;
        if s.dtype() == dtype {
            s.deep_clone()
        } else {
            s.to_dtype(dtype)?.contiguous()
        }
    })
}

/// Zeros shaped like parameter `p`, charged as optimizer state.
pub(crate) fn state_zeros(p: &Var) -> Result<Tensor> {
    state_zeros_as(p, p.tensor().dtype())
}

/// Zeros in `dtype` shaped like parameter `p` (on its device), charged as optimizer state.
pub(crate) fn state_zeros_as(p: &Var, dtype: DType) -> Result<Tensor> {
    let t = p.tensor();
    meshgrad_tensor::alloc::with_tag(meshgrad_tensor::alloc::MemoryTag::OptimizerState, || {
        Tensor::zeros(t.shape(), dtype, t.device())
    })
}

/// Prefixes an error with the optimizer and parameter it occurred for.
pub(crate) fn ctx_err(opt: &str, name: &str, e: Error) -> Error {
    Error::Msg(format!("{opt}: parameter {name}: {e}"))
}
