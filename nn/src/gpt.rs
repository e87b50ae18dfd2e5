//! GPT (the GPT-2 architecture): learned positions, pre-LayerNorm blocks, tied output head.

use std::sync::Arc;

use meshgrad_autograd::{no_grad, Var};
use meshgrad_tensor::{DType, Device, Random, Result, Tensor};

use crate::layers::{Block, BlockConfig, Dropout, Embedding, LayerNorm};
use crate::module::{Forward, Module, ParamBuilder};

/// GPT hyper-parameters (GPT-2 naming in comments).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// Context length (`n_positions` / `n_ctx`).
    pub block_size: usize,
    /// Transformer blocks (`n_layer`).
    pub n_layer: usize,
    /// Attention heads (`n_head`).
    pub n_head: usize,
    /// Model width (`n_embd`).
    pub n_embd: usize,
    /// Dropout probability (embeddings, residuals).
    pub dropout: f64,
    /// Biases in linears and norms.
    pub bias: bool,
    /// Layer-norm epsilon (`layer_norm_epsilon`).
    pub layer_norm_eps: f64,
}

impl GptConfig {
    /// Checks the sizes, with one-line errors.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.vocab_size == 0
            || c.block_size == 0
            || c.n_layer == 0
            || c.n_head == 0
            || c.n_embd == 0
        {
            meshgrad_tensor::bail!("gpt config: sizes must be positive: {c:?}");
        }
        if !c.n_embd.is_multiple_of(c.n_head) {
            meshgrad_tensor::bail!(
                "gpt config: n_embd {} is not divisible by n_head {}",
                c.n_embd,
                c.n_head
            );
        }
        if !(0.0..1.0).contains(&c.dropout) {
            meshgrad_tensor::bail!("gpt config: dropout {} must be in [0, 1)", c.dropout);
        }
        Ok(())
    }

    /// Number of parameters of the model this config builds (tied head counted once).
    pub fn num_parameters(&self) -> usize {
        let (v, t, l, c) = (self.vocab_size, self.block_size, self.n_layer, self.n_embd);
        let b = if self.bias { 1 } else { 0 };
        let ln = c + b * c;
        let block = 2 * ln
            + (3 * c * c + b * 3 * c)
            + (c * c + b * c)
            + (4 * c * c + b * 4 * c)
            + (4 * c * c + b * c);
        v * c + t * c + l * block + ln
    }
}

/// The GPT model. Parameter names follow Hugging Face GPT-2 (`wte.weight`,
/// `h.0.attn.c_attn.weight`, ..., `ln_f.bias`); the output head is `wte` (tied).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct Gpt {
    /// Hyper-parameters.
    pub config: GptConfig,
    /// Token embeddings `[vocab, C]` (also the output head).
    pub wte: Embedding,
    /// Position embeddings `[block_size, C]`.
    pub wpe: Embedding,
    /// Embedding dropout.
    pub drop: Dropout,
    /// The blocks.
    pub h: Vec<Arc<Block>>,
    /// Final norm.
    pub ln_f: LayerNorm,
    /// Recompute each block's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
}

impl Gpt {
    /// A new model with GPT-2 initialisation: N(0, 0.02) weights, residual projections
    /// N(0, 0.02/sqrt(2 n_layer)), zero biases, unit norm weights. Each parameter's values depend
    /// only on `seed` and its name.
    pub fn new(config: GptConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        config.validate()?;
        let c = config;
        let proj_std = 0.02 / (2.0 * c.n_layer as f64).sqrt();
        let bc = BlockConfig {
            n_embd: c.n_embd,
            n_head: c.n_head,
            bias: c.bias,
            dropout: c.dropout,
            proj_std,
            eps: c.layer_norm_eps,
        };
        ParamBuilder::new(seed)
            .dtype(dtype)
            .device(device)
            .build(|p| {
                Ok(Gpt {
                    config,
                    wte: Embedding::new(p, c.vocab_size, c.n_embd, 0.02)?,
                    wpe: Embedding::new(p, c.block_size, c.n_embd, 0.01)?,
                    drop: Dropout::new(c.dropout)?,
                    h: (0..c.n_layer)
                        .map(|_| Block::new(p, bc).map(Arc::new))
                        .collect::<Result<_>>()?,
                    ln_f: LayerNorm::new(p, c.n_embd, c.bias, c.layer_norm_eps)?,
                    activation_checkpointing: false,
                })
            })
    }

    fn check_ids(&self, ids: &Tensor) -> Result<(usize, usize)> {
        if ids.rank() != 2 || !ids.dtype().is_int() {
            meshgrad_tensor::bail!(
                "gpt: token ids must be an integer tensor [B, T], got {} of {}",
                ids.shape(),
                ids.dtype()
            );
        }
        let (b, t) = (ids.dims()[0], ids.dims()[1]);
        if t > self.config.block_size || t == 0 {
            meshgrad_tensor::bail!(
                "gpt: sequence length {t} must be in 1..={} (block_size)",
                self.config.block_size
            );
        }
        Ok((b, t))
    }

    /// The final hidden states `[B, T, C]` (after `ln_f`) for token ids `[B, T]`.
    pub fn hidden(&self, ids: &Tensor) -> Result<Var> {
        self.run(ids, false)
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]`. Dropout masks follow the current
    /// [`ForwardCtx`](meshgrad_autograd::ForwardCtx).
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        self.run(ids, true)
    }

    /// The forward: token + position embeddings and dropout, the blocks (each recomputed in
    /// backward with activation checkpointing), `ln_f`, then with `logits` the tied projection
    /// x wteᵀ as a fused linear, whose weight gradient comes out in wte's layout.
    fn run(&self, ids: &Tensor, logits: bool) -> Result<Var> {
        let (_, t) = self.check_ids(ids)?;
        let pos = Tensor::arange(0, t as i64, DType::I64, ids.device())?;
        let x = self.wte.forward(ids)?.add(&self.wpe.forward(&pos)?)?;
        let mut x = self.drop.forward(&x)?;
        for block in &self.h {
            x = if self.activation_checkpointing {
                block.forward_checkpointed(&x)?
            } else {
                block.forward(&x)?
            };
        }
        let x = self.ln_f.forward(&x)?;
        if logits {
            Var::linear(&x, &self.wte.weight, None)
        } else {
            Ok(x)
        }
    }

    /// Mean next-token cross-entropy of `ids [B, T]` against `targets [B, T]` (targets equal to
    /// `ignore_index` are skipped).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        let (b, t) = self.check_ids(ids)?;
        if targets.dims() != [b, t] {
            meshgrad_tensor::bail!(
                "gpt: targets {} must match ids {}",
                targets.shape(),
                ids.shape()
            );
        }
        let logits = self.forward(ids)?;
        let v = self.config.vocab_size;
        logits
            .reshape((b * t, v))?
            .cross_entropy(&targets.reshape(b * t)?, ignore_index)
    }

    /// Continues `prompt` (token ids) by `max_new` tokens: greedy when `temperature == 0`, else
    /// sampling from `softmax(logits / temperature)` (optionally restricted to the `top_k` most
    /// likely tokens) with the counter-based draw `(seed, position)`. The context is cropped to
    /// the last `block_size` tokens.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        top_k: Option<usize>,
        seed: u64,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            meshgrad_tensor::bail!("generate: the prompt is empty (give at least one token)");
        }
        if let Some(&bad) = prompt
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            meshgrad_tensor::bail!(
                "generate: prompt token {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            );
        }
        let was_training = self.drop.is_training();
        self.set_training(false);
        let r = no_grad(|| {
            let mut tokens = prompt.to_vec();
            let device = self.wte.weight.tensor().device();
            for i in 0..max_new {
                let start = tokens.len().saturating_sub(self.config.block_size);
                let ctx_tokens = &tokens[start..];
                let ids = Tensor::from_slice(ctx_tokens, (1, ctx_tokens.len()), device)?;
                let logits = self.forward(&ids)?;
                let last = logits
                    .tensor()
                    .narrow(1, ctx_tokens.len() - 1, 1)?
                    .to_vec_f64()?;
                let next = if temperature <= 0.0 {
                    argmax(&last)
                } else {
                    sample(
                        &last,
                        temperature,
                        top_k,
                        uniform_draw(seed, (tokens.len() + i) as u64),
                    )
                };
                tokens.push(next as u32);
            }
            Ok(tokens[prompt.len()..].to_vec())
        });
        self.set_training(was_training);
        r
    }
}

/// A uniform draw in [0, 1) keyed by (seed, index), through the tensor RNG.
fn uniform_draw(seed: u64, index: u64) -> f64 {
    Random::new(seed)
        .offset(index)
        .dtype(DType::F64)
        .uniform(1, 0.0, 1.0)
        .and_then(|t| t.item())
        .unwrap_or(0.5)
}

fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

fn sample(logits: &[f64], temperature: f64, top_k: Option<usize>, u: f64) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| {
        logits[b]
            .partial_cmp(&logits[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let k = top_k.unwrap_or(logits.len()).clamp(1, logits.len());
    let kept = &order[..k];
    let max = logits[kept[0]];
    let weights: Vec<f64> = kept
        .iter()
        .map(|&i| ((logits[i] - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (j, w) in weights.iter().enumerate() {
        acc += w / total;
        if u < acc {
            return kept[j];
        }
    }
    kept[k - 1]
}
