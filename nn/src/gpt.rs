//! GPT (the GPT-2 architecture): learned positions, pre-LayerNorm blocks, tied output head.

use std::sync::Arc;

use meshgrad_autograd::{no_grad, Var};
use meshgrad_tensor::{DType, Device, Random, Result, Tensor};

use crate::layers::{Block, BlockConfig, Dropout, Embedding, LayerNorm, LmHead};
use crate::module::{Forward, Module, ParamBuilder};
use crate::tp::{ParallelStyle, TpPlan};

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
    /// The output head over `wte` (tied; owns no parameters).
    pub lm_head: LmHead,
    /// Recompute each block's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
}

impl Gpt {
    /// A new model with GPT-2 initialisation: N(0, 0.02) weights, residual projections
    /// N(0, 0.02/sqrt(2 n_layer)), zero biases, unit norm weights. Each parameter's values depend
    /// only on `seed` and its name.
    pub fn new(config: GptConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        Gpt::build(config, ParamBuilder::new(seed).dtype(dtype).device(device))
    }

    /// A new model whose parameters `builder` creates (its seed, dtype and device; with
    /// [`ParamBuilder::tensor_parallel`] and [`Gpt::tp_plan`], this rank's part of a
    /// tensor-parallel model, every value equal to the single-device one).
    pub fn build(config: GptConfig, builder: ParamBuilder) -> Result<Self> {
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
        builder.build(|p| {
            Ok(Gpt {
                config,
                wte: Embedding::new(p, c.vocab_size, c.n_embd, 0.02)?,
                wpe: Embedding::new(p, c.block_size, c.n_embd, 0.01)?,
                drop: Dropout::new(c.dropout)?,
                h: (0..c.n_layer)
                    .map(|_| Block::new(p, bc).map(Arc::new))
                    .collect::<Result<_>>()?,
                ln_f: LayerNorm::new(p, c.n_embd, c.bias, c.layer_norm_eps)?,
                lm_head: LmHead::new(),
                activation_checkpointing: false,
            })
        })
    }

    /// The tensor-parallel plan of the GPT (Megatron-LM's split): q/k/v and the MLP
    /// up-projection column-parallel (q, k and v each split by heads), the output projections
    /// row-parallel, the token table split by vocabulary (the tied head and the loss stay split),
    /// the norms and dropouts sequence-parallel (the embedding dropout starts that region).
    pub fn tp_plan() -> TpPlan {
        TpPlan::new()
            .with("wte", ParallelStyle::VocabEmbedding)
            .with("drop", ParallelStyle::SequenceSplit)
            .with("h.*.ln_1", ParallelStyle::SequenceParallel)
            .with("h.*.attn.c_attn", ParallelStyle::Colwise { chunks: 3 })
            .with("h.*.attn.c_proj", ParallelStyle::Rowwise)
            .with("h.*.attn.resid_dropout", ParallelStyle::SequenceParallel)
            .with("h.*.ln_2", ParallelStyle::SequenceParallel)
            .with("h.*.mlp.c_fc", ParallelStyle::Colwise { chunks: 1 })
            .with("h.*.mlp.c_proj", ParallelStyle::Rowwise)
            .with("h.*.mlp.dropout", ParallelStyle::SequenceParallel)
            .with("ln_f", ParallelStyle::SequenceParallel)
            .with("lm_head", ParallelStyle::VocabHead)
    }

    /// Checks that the sizes split over `tp` ranks, with one line naming them (heads, width,
    /// vocabulary); `sequence` is the training sequence length when sequence parallelism is on.
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
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

    /// The final hidden states `[B, T, C]` (after `ln_f`) for token ids `[B, T]` (under sequence
    /// parallelism, this rank's positions `[B, T / tp, C]`).
    pub fn hidden(&self, ids: &Tensor) -> Result<Var> {
        self.run(ids, false)
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]` (under tensor parallelism, this rank's
    /// vocabulary slice `[B, T, vocab / tp]`). Dropout masks follow the current
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
            self.lm_head.forward(&x, &self.wte.weight)
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
        self.lm_head.loss(&logits, targets, ignore_index)
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
        if self.lm_head.vocab_parallel().is_some() {
            meshgrad_tensor::bail!(
                "generate: this model's logits are split over tensor-parallel ranks; generate \
                 from a single-device model (load the gathered checkpoint)"
            );
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

/// The tensor-parallel size checks of [`Gpt::check_tensor_parallel`].
pub fn check_tp_sizes(c: &GptConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
    if tp <= 1 {
        return Ok(());
    }
    for (what, n) in [
        ("n_head", c.n_head),
        ("the MLP width 4 x n_embd", 4 * c.n_embd),
        ("vocab_size", c.vocab_size),
    ] {
        if !n.is_multiple_of(tp) {
            meshgrad_tensor::bail!(
                "tensor parallelism: {what} = {n} is not divisible by tp = {tp}{}",
                if what == "vocab_size" {
                    " (choose a vocabulary size that is a multiple of tp)"
                } else {
                    ""
                }
            );
        }
    }
    if let Some(t) = sequence {
        if !t.is_multiple_of(tp) {
            meshgrad_tensor::bail!(
                "sequence parallelism: the sequence length {t} is not divisible by tp = {tp}"
            );
        }
    }
    Ok(())
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
