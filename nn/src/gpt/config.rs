//! [`GptConfig`]: the GPT's hyper-parameters and their checks.

use meshgrad_tensor::Result;

use crate::layers::BlockConfig;

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
    /// Its sizes for memory and cost estimates: learned positions, a 4x MLP, a final norm, the
    /// head tied to the token table.
    pub fn shape(&self) -> crate::ModelShape {
        crate::ModelShape {
            vocab_size: self.vocab_size,
            positions: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_kv_head: self.n_head,
            n_embd: self.n_embd,
            ffn: self.n_embd.saturating_mul(4),
            bias: self.bias,
            learned_positions: true,
            fused_qkv: true,
            type_vocab_size: 0,
            embedding_norm: false,
            gated_mlp: false,
            final_norm: true,
            head_transform: false,
            tied: true,
            n_experts: 0,
            experts_per_token: 0,
            dropout: self.dropout > 0.0,
            attention_dropout: false,
        }
    }

    /// Checks the sizes (positive, `n_embd` divisible by `n_head`), the dropout (in [0, 1)) and
    /// the layer-norm epsilon (positive and finite), with one-line errors.
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
        if !(c.layer_norm_eps.is_finite() && c.layer_norm_eps > 0.0) {
            meshgrad_tensor::bail!(
                "gpt config: layer_norm_epsilon must be positive and finite, got {}",
                c.layer_norm_eps
            );
        }
        Ok(())
    }

    /// The blocks' hyper-parameters (GPT-2's residual projections start at
    /// N(0, 0.02/sqrt(2 n_layer))).
    pub(super) fn block_config(&self) -> BlockConfig {
        BlockConfig {
            n_embd: self.n_embd,
            n_head: self.n_head,
            bias: self.bias,
            dropout: self.dropout,
            proj_std: 0.02 / (2.0 * self.n_layer as f64).sqrt(),
            eps: self.layer_norm_eps,
        }
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
