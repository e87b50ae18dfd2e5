//! The GPT's [`CausalFamily`].

use std::path::Path;

use meshgrad_tensor::Result;

use super::{check_tp_sizes, Gpt, GptConfig};
use crate::family::CausalFamily;
use crate::state::hf_gpt2;
use crate::tp::TpPlan;
use crate::{ModelShape, ParamBuilder, StageSpec};

impl CausalFamily for Gpt {
    type Config = GptConfig;
    type Stage = Gpt;
    type Whole = Gpt;
    const NAME: &'static str = "GPT";

    fn validate(config: &GptConfig) -> Result<()> {
        config.validate()
    }
    fn padded(mut config: GptConfig, tp: usize) -> GptConfig {
        config.vocab_size = config.vocab_size.next_multiple_of(tp);
        config
    }
    fn vocab(config: &GptConfig) -> usize {
        config.vocab_size
    }
    fn check_tp(config: &GptConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(config, tp, sequence)
    }
    fn n_layer(config: &GptConfig) -> usize {
        config.n_layer
    }
    fn num_parameters(config: &GptConfig) -> usize {
        config.num_parameters()
    }
    fn shape(config: &GptConfig) -> ModelShape {
        config.shape()
    }
    fn describe(_config: &GptConfig) -> String {
        String::new()
    }
    fn tp_plan(_config: &GptConfig, spec: &StageSpec) -> TpPlan {
        Gpt::stage_tp_plan(spec)
    }
    fn build_stage(
        config: GptConfig,
        spec: StageSpec,
        builder: ParamBuilder,
        checkpointing: bool,
    ) -> Result<Gpt> {
        let mut stage = Gpt::build_stage(config, spec, builder)?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
    }
    fn build_whole(config: GptConfig, builder: ParamBuilder, vocab_in_use: usize) -> Result<Gpt> {
        let mut model = Gpt::build(config, builder)?;
        model.vocab_in_use = Some(vocab_in_use);
        Ok(model)
    }
    fn save(model: &Gpt, dir: &Path) -> Result<()> {
        hf_gpt2::save_gpt2(model, dir)
    }
}
