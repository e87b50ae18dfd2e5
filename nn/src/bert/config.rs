//! [`BertConfig`]: BERT's hyper-parameters (Hugging Face's `BertConfig` names) and their checks.

use meshgrad_tensor::Result;

/// BERT hyper-parameters, with Hugging Face's `BertConfig` field names. [`Default`] is
/// Hugging Face's default (the `bert-base` shape).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BertConfig {
    /// Token ids `0..vocab_size`.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// The longest sequence (rows of the position table).
    pub max_position_embeddings: usize,
    /// Token types (segments).
    pub type_vocab_size: usize,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f64,
    /// Dropout after the embeddings and after each residual branch.
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities.
    pub attention_probs_dropout_prob: f64,
    /// The padding token (its word-embedding row starts at zero, as Hugging Face initialises it).
    pub pad_token_id: usize,
    /// Standard deviation of the initial weights.
    pub initializer_range: f64,
}

impl Default for BertConfig {
    fn default() -> Self {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            pad_token_id: 0,
            initializer_range: 0.02,
        }
    }
}

impl BertConfig {
    /// Its sizes for memory and cost estimates: learned positions and token types, a norm after
    /// the embedding, biases everywhere, no final norm, the masked-LM head's transform and bias,
    /// the decoder tied to the token table.
    pub fn shape(&self) -> crate::ModelShape {
        crate::ModelShape {
            vocab_size: self.vocab_size,
            positions: self.max_position_embeddings,
            n_layer: self.num_hidden_layers,
            n_head: self.num_attention_heads,
            n_kv_head: self.num_attention_heads,
            n_embd: self.hidden_size,
            ffn: self.intermediate_size,
            bias: true,
            learned_positions: true,
            fused_qkv: false,
            type_vocab_size: self.type_vocab_size,
            embedding_norm: true,
            gated_mlp: false,
            final_norm: false,
            head_transform: true,
            tied: true,
            n_experts: 0,
            experts_per_token: 0,
            dropout: self.hidden_dropout_prob > 0.0,
            attention_dropout: self.attention_probs_dropout_prob > 0.0,
        }
    }

    /// Checks the values, with one-line errors naming the field.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        for (k, v) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("intermediate_size", c.intermediate_size),
            ("max_position_embeddings", c.max_position_embeddings),
            ("type_vocab_size", c.type_vocab_size),
        ] {
            if v == 0 {
                meshgrad_tensor::bail!("bert config: {k} must be at least 1, got 0");
            }
        }
        if !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            meshgrad_tensor::bail!(
                "bert config: hidden_size {} is not divisible by num_attention_heads {}",
                c.hidden_size,
                c.num_attention_heads
            );
        }
        for (k, p) in [
            ("hidden_dropout_prob", c.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                c.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                meshgrad_tensor::bail!("bert config: {k} must be in [0, 1), got {p}");
            }
        }
        if !(c.layer_norm_eps.is_finite() && c.layer_norm_eps > 0.0) {
            meshgrad_tensor::bail!(
                "bert config: layer_norm_eps must be positive and finite, got {}",
                c.layer_norm_eps
            );
        }
        if !(c.initializer_range.is_finite() && c.initializer_range >= 0.0) {
            meshgrad_tensor::bail!(
                "bert config: initializer_range must be a finite number >= 0, got {}",
                c.initializer_range
            );
        }
        if c.pad_token_id >= c.vocab_size {
            meshgrad_tensor::bail!(
                "bert config: pad_token_id {} is outside the vocabulary (vocab_size {})",
                c.pad_token_id,
                c.vocab_size
            );
        }
        Ok(())
    }

    /// Number of parameters of the whole [`BertForMaskedLM`](crate::bert::BertForMaskedLM) this
    /// config builds (the tied decoder counted once, as part of the word embeddings).
    pub fn num_parameters(&self) -> usize {
        let (v, h, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let ln = 2 * h;
        let embeddings = (v + self.max_position_embeddings + self.type_vocab_size) * h + ln;
        let layer = 4 * (h * h + h) + ln + (h * i + i) + (i * h + h) + ln;
        let head = (h * h + h) + ln + v;
        embeddings + self.num_hidden_layers * layer + head
    }
}
