//! [`SparseMoe`]: Mixtral's sparse feed-forward (`block_sparse_moe`): the router, the experts
//! and the dispatch between them (see the [module docs](super)).

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Result, Tensor};

use super::load;
use super::routing::{check_top_k, Routing, RoutingArgs};
use crate::layers::Linear;
use crate::llama::block::proj;
use crate::module::Forward;
use crate::param_builder::ParamBuilder;

/// A mixture of experts' settings (Hugging Face `MixtralConfig` keys in the comments).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeSettings {
    /// Experts per layer (`num_local_experts`).
    pub n_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// The load-balancing loss's coefficient in the training objective
    /// (`router_aux_loss_coef`; a training setting, not part of the model's shape).
    pub router_aux_loss_coef: f64,
    /// `Some(cf)`: each expert takes at most `ceil(cf * T * k / N)` token copies of a sequence
    /// of `T` tokens, the rest are dropped; `None` (the default, as Mixtral): dropless.
    #[serde(default)]
    pub capacity_factor: Option<f64>,
}

impl MoeSettings {
    /// Mixtral's routing: `n_experts` experts, `experts_per_token` per token, the coefficient
    /// 0.02 of Mixtral 8x7B's `config.json` (transformers' `MixtralConfig` defaults to 0.001),
    /// dropless.
    pub fn new(n_experts: usize, experts_per_token: usize) -> Self {
        MoeSettings {
            n_experts,
            experts_per_token,
            router_aux_loss_coef: 0.02,
            capacity_factor: None,
        }
    }

    /// One-line errors: no experts, `experts_per_token` 0 or above `n_experts`, a coefficient
    /// that is not finite and >= 0, a capacity factor that is not finite and > 0.
    pub fn validate(&self) -> Result<()> {
        check_top_k(self.experts_per_token, self.n_experts)?;
        let c = self.router_aux_loss_coef;
        if !(c.is_finite() && c >= 0.0) {
            meshgrad_tensor::bail!("moe: router_aux_loss_coef must be finite and >= 0, got {c}");
        }
        if let Some(cf) = self.capacity_factor {
            if !(cf.is_finite() && cf > 0.0) {
                meshgrad_tensor::bail!("moe: capacity_factor must be finite and > 0, got {cf}");
            }
        }
        Ok(())
    }
}

/// One expert: the SwiGLU feed-forward `w2(silu(w1 x) * w3 x)` (`experts.{e}`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct MoeExpert {
    /// Gate projection `[intermediate, n_embd]`.
    pub w1: Linear,
    /// Down projection `[n_embd, intermediate]`.
    pub w2: Linear,
    /// Up projection `[intermediate, n_embd]`.
    pub w3: Linear,
}

impl MoeExpert {
    /// An expert of width `n_embd` and hidden width `intermediate`.
    pub fn new(p: &ParamBuilder, n_embd: usize, intermediate: usize) -> Result<Self> {
        Ok(MoeExpert {
            w1: proj(p, n_embd, intermediate)?,
            w2: proj(p, intermediate, n_embd)?,
            w3: proj(p, n_embd, intermediate)?,
        })
    }
}

impl Forward for MoeExpert {
    fn forward(&self, x: &Var) -> Result<Var> {
        self.w2
            .forward(&Var::swiglu(&self.w1.forward(x)?, &self.w3.forward(x)?)?)
    }
}

/// Mixtral's sparse feed-forward (`block_sparse_moe`; see the [module docs](super)): the router
/// `gate` `[n_experts, n_embd]` and the experts `experts.{e}.{w1,w2,w3}`.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct SparseMoe {
    /// The router.
    pub gate: Linear,
    /// The experts.
    pub experts: Vec<MoeExpert>,
    /// Routing settings.
    pub settings: MoeSettings,
    /// The layer's global index (its load's key in [`super::collect_expert_load`]).
    pub layer: usize,
    /// The factor of this layer's load-balancing loss in the objective (before the forward's
    /// loss scale): `router_aux_loss_coef / n_layer` in a model of `n_layer` layers.
    pub aux_weight: f64,
}

/// What [`SparseMoe::forward_routed`] computes besides the output.
pub struct MoeOutput {
    /// The output `[B, T, C]` (carrying the load-balancing loss's gradient, when weighted).
    pub output: Var,
    /// The load-balancing loss averaged over the sequences (a scalar, differentiable).
    pub aux: Var,
    /// The routing.
    pub routing: Routing,
}

impl SparseMoe {
    /// The layer of global index `layer`, of width `n_embd`, experts `intermediate` wide, and
    /// its loss weighted by `aux_weight` (see [`SparseMoe::aux_weight`]).
    pub fn new(
        p: &ParamBuilder,
        (n_embd, intermediate): (usize, usize),
        settings: MoeSettings,
        (layer, aux_weight): (usize, f64),
    ) -> Result<Self> {
        settings.validate()?;
        Ok(SparseMoe {
            gate: proj(p, n_embd, settings.n_experts)?,
            experts: (0..settings.n_experts)
                .map(|_| MoeExpert::new(p, n_embd, intermediate))
                .collect::<Result<_>>()?,
            settings,
            layer,
            aux_weight,
        })
    }

    /// The output of `x [B, T, C]` with the loss and the routing (see the [module
    /// docs](super)); records the layer's load in the current collection.
    pub fn forward_routed(&self, x: &Var) -> Result<MoeOutput> {
        let d = x.tensor().dims().to_vec();
        if d.len() != 3 {
            meshgrad_tensor::bail!(
                "moe layer {}: expected input [B, T, C], got {}",
                self.layer,
                x.tensor().shape()
            );
        }
        let (b, t, c) = (d[0], d[1], d[2]);
        let (n, k) = (self.settings.n_experts, self.settings.experts_per_token);
        let flat = x.reshape((b * t, c))?;
        // Routing in f32 (f64 for an f64 model), as transformers' softmax(dtype=float).
        let route_dtype = if x.tensor().dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let probs = self
            .gate
            .forward(&flat)?
            .to_dtype(route_dtype)?
            .softmax(-1)?;
        let routing = Routing::new(RoutingArgs {
            probs: &probs.tensor().to_vec_f64()?,
            rows: b,
            tokens: t,
            n_experts: n,
            top_k: k,
            capacity_factor: self.settings.capacity_factor,
        })?;
        let device = x.tensor().device();
        let choices = Tensor::from_vec(routing.choices.clone(), (b * t, k), device)?;
        let top = probs.gather(1, &choices)?;
        let weights = top
            .div(&top.sum(&[-1], true)?)?
            .to_dtype(x.tensor().dtype())?;
        let permuted = permute(&flat, &routing)?;
        let expert_out = self.run_experts(&permuted, &routing)?;
        let y = unpermute(&expert_out, &routing, &weights)?.reshape((b, t, c))?;
        let aux = load_balancing_loss(&probs, &routing, (b, t, n))?;
        let output = if self.aux_weight != 0.0 {
            y.attach_aux_loss(&aux, self.aux_weight * meshgrad_autograd::loss_scale())?
        } else {
            y
        };
        load::record(
            self.layer,
            &routing.routed,
            routing.dropped,
            aux.tensor().item()? * b as f64,
            b,
        );
        Ok(MoeOutput {
            output,
            aux,
            routing,
        })
    }

    /// Each expert on its contiguous slice of the permuted tokens `[S, C]` (experts without
    /// tokens skipped); the outputs in the same order.
    pub fn run_experts(&self, permuted: &Var, routing: &Routing) -> Result<Var> {
        let mut outs = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (expert, &size) in self.experts.iter().zip(&routing.expert_sizes) {
            if size > 0 {
                outs.push(expert.forward(&permuted.narrow(0, start, size)?)?);
            }
            start += size;
        }
        let refs: Vec<&Var> = outs.iter().collect();
        Var::cat(&refs, 0)
    }
}

impl Forward for SparseMoe {
    /// `x [B, T, C]` -> `[B, T, C]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        Ok(self.forward_routed(x)?.output)
    }
}

/// The permutation: the kept token copies of `flat [tokens, C]`, grouped by expert
/// (`[S, C]`, a gather).
pub fn permute(flat: &Var, routing: &Routing) -> Result<Var> {
    let ids = Tensor::from_vec(
        routing.permuted_tokens.clone(),
        routing.permuted_tokens.len(),
        flat.tensor().device(),
    )?;
    flat.index_select(0, &ids)
}

/// The weighted un-permutation: each token's `k` expert outputs gathered back from `expert_out
/// [S, C]` (a dropped copy reads a zero row) and added with their `weights [tokens, k]`, in
/// choice order. `[tokens, C]`.
pub fn unpermute(expert_out: &Var, routing: &Routing, weights: &Var) -> Result<Var> {
    let (s, c) = (expert_out.tensor().dims()[0], expert_out.tensor().dims()[1]);
    let k = routing.top_k;
    let tokens = routing.slot_position.len() / k;
    let t = expert_out.tensor();
    let source = if routing.dropped > 0 {
        let zero = Var::constant(Tensor::zeros((1, c), t.dtype(), t.device())?);
        Var::cat(&[expert_out, &zero], 0)?
    } else {
        expert_out.clone()
    };
    debug_assert!(routing.slot_position.iter().all(|&p| p as usize <= s));
    let ids = Tensor::from_vec(
        routing.slot_position.clone(),
        routing.slot_position.len(),
        t.device(),
    )?;
    source
        .index_select(0, &ids)?
        .reshape((tokens, k, c))?
        .mul(&weights.unsqueeze(-1)?)?
        .sum(&[1], false)
}

/// The load-balancing loss averaged over the `b` sequences: per sequence
/// `N * sum_e f_e * P_e` (see the [module docs](super)), from `probs [b * t, N]`.
fn load_balancing_loss(
    probs: &Var,
    routing: &Routing,
    (b, t, n): (usize, usize, usize),
) -> Result<Var> {
    let p = probs.tensor();
    let f: Vec<f64> = routing
        .row_routed
        .iter()
        .map(|&c| c as f64 / t as f64)
        .collect();
    let f = Tensor::from_vec(f, (b, n), p.device())?.to_dtype(p.dtype())?;
    probs
        .reshape((b, t, n))?
        .mean(&[1], false)?
        .mul(&Var::constant(f))?
        .sum(&[-1], false)?
        .mean_all()?
        .mul_scalar(n as f64)
}
