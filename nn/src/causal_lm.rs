//! [`CausalLm`]: what evaluation and generation need of a next-token model, whatever its family
//! (GPT, Llama), so that the commands that run a model hold it as one trait object.

use meshgrad_autograd::Var;
use meshgrad_tensor::{Device, Result, Tensor};

use crate::gpt::Gpt;
use crate::llama::Llama;

/// A whole next-token model on one device.
pub trait CausalLm {
    /// The logits `[B, T, V]` of token ids `[B, T]` (`V` the model's possibly padded
    /// vocabulary).
    fn logits(&self, ids: &Tensor) -> Result<Var>;
    /// The longest context it takes.
    fn context_len(&self) -> usize;
    /// The token ids the data uses (`0..n`): generation prompts and samples only these.
    fn sampled_vocab(&self) -> usize;
    /// The device its parameters live on.
    fn device(&self) -> Device;
    /// Continues `prompt` by `max_new` tokens as the model's own `generate` does (greedy at
    /// `temperature` 0, else sampled with the counter-based draw of `seed`), calling `on_token`
    /// with each token as it is chosen.
    fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>>;
}

impl CausalLm for Gpt {
    fn logits(&self, ids: &Tensor) -> Result<Var> {
        self.forward(ids)
    }
    fn context_len(&self) -> usize {
        self.config.block_size
    }
    fn sampled_vocab(&self) -> usize {
        Gpt::sampled_vocab(self)
    }
    fn device(&self) -> Device {
        // Every stage holds at least one block.
        self.h.blocks()[0].ln_1.weight.tensor().device()
    }
    fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        Gpt::generate(self, prompt, max_new, temperature, top_k, seed, on_token)
    }
}

impl CausalLm for Llama {
    fn logits(&self, ids: &Tensor) -> Result<Var> {
        self.forward(ids)
    }
    fn context_len(&self) -> usize {
        self.config.n_positions
    }
    fn sampled_vocab(&self) -> usize {
        Llama::sampled_vocab(self)
    }
    fn device(&self) -> Device {
        // Every stage holds at least one layer.
        self.model.layers.blocks()[0]
            .input_layernorm
            .weight
            .tensor()
            .device()
    }
    fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        Llama::generate(self, prompt, max_new, temperature, top_k, seed, on_token)
    }
}
