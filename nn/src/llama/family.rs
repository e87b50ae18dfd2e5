//! The Llama's [`CausalFamily`].

use std::path::Path;

use meshgrad_tensor::Result;

use super::{check_tp_sizes, Llama, LlamaConfig};
use crate::family::CausalFamily;
use crate::state::hf_llama;
use crate::tp::TpPlan;
use crate::{ModelShape, ParamBuilder, StageSpec};

impl CausalFamily for Llama {
    type Config = LlamaConfig;
    type Stage = Llama;
    type Whole = Llama;
    const NAME: &'static str = "Llama";

    fn validate(config: &LlamaConfig) -> Result<()> {
        config.validate()
    }
    fn padded(mut config: LlamaConfig, tp: usize) -> LlamaConfig {
        config.vocab_size = config.vocab_size.next_multiple_of(tp);
        config
    }
    fn vocab(config: &LlamaConfig) -> usize {
        config.vocab_size
    }
    fn check_tp(config: &LlamaConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(config, tp, sequence)
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
        format!(
            "Llama ({} kv heads of {}, MLP {}, rope_theta {}, {}), ",
            c.n_kv_head,
            c.n_head,
            c.intermediate_size,
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
        let mut stage = Llama::build_stage(config, spec, builder)?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
    }
    fn build_whole(
        config: LlamaConfig,
        builder: ParamBuilder,
        vocab_in_use: usize,
    ) -> Result<Llama> {
        let mut model = Llama::build(config, builder)?;
        model.vocab_in_use = Some(vocab_in_use);
        Ok(model)
    }
    fn save(model: &Llama, dir: &Path) -> Result<()> {
        hf_llama::save_llama(model, dir)
    }
}
