//! Optimizer builders with defaults: `AdamW::for_module(&model).weight_decay(0.1).build()?`.

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use super::{param_groups_for_decay, AdamW, AdamWConfig, ParamGroup, Sgd, SgdConfig};
use crate::module::Module;

/// Builds an [`AdamW`] over a module's trainable (not frozen) parameters, split into a decayed
/// group (rank >= 2: matrices, embeddings) and an undecayed one (biases, norm weights) by the
/// nanoGPT rule ([`param_groups_for_decay`]). Defaults: weight decay 0.01 (PyTorch's), betas
/// (0.9, 0.999), eps 1e-8.
///
/// ```
/// use meshgrad_nn::optim::{AdamW, Optimizer};
/// use meshgrad_nn::{Linear, ParamBuilder};
/// let model = ParamBuilder::new(0).build(|p| Linear::new(p, 4, 4))?;
/// let mut opt = AdamW::for_module(&model).weight_decay(0.1).betas(0.9, 0.95).build()?;
/// opt.step(1e-3)?; // no gradients yet: nothing changes
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct AdamWBuilder {
    params: Vec<(String, Var)>,
    weight_decay: f64,
    config: AdamWConfig,
}

impl AdamW {
    /// A builder over `module`'s trainable parameters.
    pub fn for_module<M: Module + ?Sized>(module: &M) -> AdamWBuilder {
        AdamWBuilder {
            params: module.trainable_parameters(),
            weight_decay: 0.01,
            config: AdamWConfig::default(),
        }
    }
}

impl AdamWBuilder {
    /// Decoupled weight decay of the decayed group.
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    /// Moment decays.
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.config.beta1 = beta1;
        self.config.beta2 = beta2;
        self
    }

    /// Denominator epsilon.
    pub fn eps(mut self, eps: f64) -> Self {
        self.config.eps = eps;
        self
    }

    /// The parameter groups the optimizer will get.
    pub fn groups(&self) -> Vec<ParamGroup> {
        param_groups_for_decay(self.params.clone(), self.weight_decay)
    }

    /// Builds the optimizer (validating every setting).
    pub fn build(self) -> Result<AdamW> {
        AdamW::new(self.groups(), self.config)
    }
}

/// Builds an [`Sgd`] over a module's trainable parameters, one group. Defaults: no momentum, no
/// weight decay.
#[derive(Clone, Debug)]
pub struct SgdBuilder {
    params: Vec<(String, Var)>,
    weight_decay: f64,
    config: SgdConfig,
}

impl Sgd {
    /// A builder over `module`'s trainable parameters.
    pub fn for_module<M: Module + ?Sized>(module: &M) -> SgdBuilder {
        SgdBuilder {
            params: module.trainable_parameters(),
            weight_decay: 0.0,
            config: SgdConfig::default(),
        }
    }
}

impl SgdBuilder {
    /// Momentum factor.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.config.momentum = momentum;
        self
    }

    /// L2 weight decay.
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    /// Builds the optimizer (validating every setting).
    pub fn build(self) -> Result<Sgd> {
        Sgd::new(
            vec![ParamGroup::new(self.params, self.weight_decay)],
            self.config,
        )
    }
}
