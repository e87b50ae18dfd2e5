//! Mixtral (Hugging Face `MixtralForCausalLM`): a [`Llama`] whose feed-forwards are mixtures of
//! experts ([`crate::moe::SparseMoe`]; `LlamaConfig::moe` set). One model type serves both
//! families; [`Mixtral`] is the family for the trainer ([`CausalFamily`]): a Llama family whose
//! configs have experts and whose checkpoints are `MixtralForCausalLM` folders
//! ([`crate::state::hf_mixtral`]).
//!
//! Data parallelism (dp, fsdp, hsdp), pipelining, expert parallelism (ep) and tensor
//! parallelism without sequence parallelism (the attention split, the mixtures of experts whole
//! on every tensor-parallel rank) train it as one device does.

use std::path::Path;

use meshgrad_tensor::Result;

use crate::family::CausalFamily;
use crate::llama::{Llama, LlamaConfig};
use crate::state::hf_mixtral;
use crate::tp::TpPlan;
use crate::{ModelShape, ParamBuilder, StageSpec};

/// The Mixtral family (see the [module docs](self)).
pub struct Mixtral;

impl CausalFamily for Mixtral {
    type Config = LlamaConfig;
    type Stage = Llama;
    type Whole = Llama;
    const NAME: &'static str = "Mixtral";

    fn validate(config: &LlamaConfig) -> Result<()> {
        if config.moe.is_none() {
            meshgrad_tensor::bail!("mixtral config: no experts (LlamaConfig::moe is None)");
        }
        config.validate()
    }
    fn padded(config: LlamaConfig, tp: usize) -> LlamaConfig {
        <Llama as CausalFamily>::padded(config, tp)
    }
    fn vocab(config: &LlamaConfig) -> usize {
        config.vocab_size
    }
    /// Tensor parallelism splits the attention and the vocabulary as for a Llama; the router
    /// and the experts stay whole on every tensor-parallel rank (each routes the same tokens;
    /// under sequence parallelism the layer gathers the sequence first and returns each rank's
    /// part, see [`crate::moe::SparseMoe::sp`]).
    fn check_tp(config: &LlamaConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
        crate::llama::check_tp_sizes(config, tp, sequence)
    }
    fn n_layer(config: &LlamaConfig) -> usize {
        config.n_layer
    }
    fn num_parameters(config: &LlamaConfig) -> usize {
        config.num_parameters()
    }
    fn shape(config: &LlamaConfig) -> ModelShape {
        config.shape()
    }
    fn describe(c: &LlamaConfig) -> String {
        let (n, k, coef) = c.moe.map_or((0, 0, 0.0), |m| {
            (m.n_experts, m.experts_per_token, m.router_aux_loss_coef)
        });
        format!(
            "Mixtral ({n} experts of width {}, top {k}, aux coef {coef}, {} kv heads of {}, \
             rope_theta {}, {}), ",
            c.intermediate_size,
            c.n_kv_head,
            c.n_head,
            c.rope_theta,
            if c.tie_embeddings { "tied" } else { "untied" }
        )
    }
    fn tp_plan(config: &LlamaConfig, spec: &StageSpec) -> TpPlan {
        Llama::tp_plan(config, spec)
    }
    fn build_stage(
        config: LlamaConfig,
        spec: StageSpec,
        builder: ParamBuilder,
        checkpointing: bool,
    ) -> Result<Llama> {
        <Llama as CausalFamily>::build_stage(config, spec, builder, checkpointing)
    }
    fn build_whole(
        config: LlamaConfig,
        builder: ParamBuilder,
        vocab_in_use: usize,
    ) -> Result<Llama> {
        <Llama as CausalFamily>::build_whole(config, builder, vocab_in_use)
    }
    fn save(model: &Llama, dir: &Path) -> Result<()> {
        hf_mixtral::save_mixtral(model, dir)
    }
    fn moe(config: &LlamaConfig) -> Option<crate::moe::MoeSettings> {
        config.moe
    }
}
