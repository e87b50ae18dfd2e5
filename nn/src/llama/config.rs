//! [`LlamaConfig`]: the hyper-parameters of a Llama (Hugging Face `LlamaConfig` naming in
//! comments), their checks and the parameter count.

use meshgrad_tensor::Result;

use super::RopeAngles;
use crate::moe::MoeSettings;

/// Llama hyper-parameters. The Hugging Face `config.json` key of each field is in its comment;
/// [`crate::state::hf_llama`] reads and writes them.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// Context length: the longest sequence the model takes (`max_position_embeddings`).
    pub n_positions: usize,
    /// Model width (`hidden_size`).
    pub n_embd: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub n_layer: usize,
    /// Query heads (`num_attention_heads`).
    pub n_head: usize,
    /// Key/value heads (`num_key_value_heads`): `n_head` is multi-head attention, fewer is
    /// grouped-query attention (each kv head serves `n_head / n_kv_head` query heads).
    pub n_kv_head: usize,
    /// The MLP's hidden width (`intermediate_size`).
    pub intermediate_size: usize,
    /// RoPE base (`rope_theta`; 10000 in Llama 2, 500000 in Llama 3).
    pub rope_theta: f64,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub norm_eps: f64,
    /// The output head is the token table `model.embed_tokens.weight` (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// How the rotary embedding computes its angles: exactly in the fused op (the default), or
    /// in f32 tables as transformers does (the choice of a config read from Hugging Face, so a
    /// checkpoint's logits are transformers'). Numerics only; no parameter depends on it.
    #[serde(default)]
    pub rope_angles: RopeAngles,
    /// `Some`: every layer's feed-forward is a mixture of experts ([`crate::moe::SparseMoe`],
    /// `block_sparse_moe`, each expert `intermediate_size` wide): a Mixtral (Hugging Face
    /// `MixtralForCausalLM`). `None`: the dense SwiGLU MLP of a Llama.
    #[serde(default)]
    pub moe: Option<MoeSettings>,
}

impl LlamaConfig {
    /// Its sizes for memory and cost estimates: rotary positions, grouped-query attention, a
    /// gated MLP, RMSNorm without biases, a final norm, the head tied or not, and a mixture
    /// of experts' expert count and experts per token.
    pub fn shape(&self) -> crate::ModelShape {
        crate::ModelShape {
            vocab_size: self.vocab_size,
            positions: self.n_positions,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            n_embd: self.n_embd,
            ffn: self.intermediate_size,
            bias: false,
            learned_positions: false,
            fused_qkv: false,
            type_vocab_size: 0,
            embedding_norm: false,
            gated_mlp: true,
            final_norm: true,
            head_transform: false,
            tied: self.tie_embeddings,
            n_experts: self.moe.map_or(0, |m| m.n_experts),
            experts_per_token: self.moe.map_or(0, |m| m.experts_per_token),
            dropout: false,
            attention_dropout: false,
        }
    }

    /// A config of width `n_embd`, `n_layer` layers and `n_head` heads with Llama's defaults for
    /// the rest: multi-head attention (`n_kv_head = n_head`), `intermediate_size` the Llama
    /// rule `256 * ceil(8 n_embd / 3 / 256)`, RoPE base 10000, norm epsilon 1e-5, untied head,
    /// the fused rotation ([`RopeAngles::Fused`]).
    pub fn new(
        vocab_size: usize,
        n_positions: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
    ) -> Self {
        let hidden = (8 * n_embd).div_ceil(3);
        LlamaConfig {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_kv_head: n_head,
            intermediate_size: hidden.div_ceil(256) * 256,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            tie_embeddings: false,
            rope_angles: RopeAngles::Fused,
            moe: None,
        }
    }

    /// The width of one head, `n_embd / n_head`.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// Checks the config with one-line errors: every size positive, `n_embd` divisible by
    /// `n_head`, an even head width (RoPE rotates pairs), `n_kv_head` dividing `n_head`, and a
    /// positive finite RoPE base and norm epsilon.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        let sizes = [
            ("vocab_size", c.vocab_size),
            ("n_positions", c.n_positions),
            ("n_embd", c.n_embd),
            ("n_layer", c.n_layer),
            ("n_head", c.n_head),
            ("n_kv_head", c.n_kv_head),
            ("intermediate_size", c.intermediate_size),
        ];
        if let Some((k, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            meshgrad_tensor::bail!("llama config: {k} must be at least 1, got 0");
        }
        if !c.n_embd.is_multiple_of(c.n_head) {
            meshgrad_tensor::bail!(
                "llama config: n_embd {} is not divisible by n_head {}",
                c.n_embd,
                c.n_head
            );
        }
        if !c.head_dim().is_multiple_of(2) {
            meshgrad_tensor::bail!(
                "llama config: the head width n_embd / n_head = {} / {} = {} must be even \
                 (rotary embeddings rotate pairs)",
                c.n_embd,
                c.n_head,
                c.head_dim()
            );
        }
        if !c.n_head.is_multiple_of(c.n_kv_head) {
            meshgrad_tensor::bail!(
                "llama config: n_kv_head {} does not divide n_head {} (each kv head serves a \
                 whole group of query heads)",
                c.n_kv_head,
                c.n_head
            );
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
            meshgrad_tensor::bail!(
                "llama config: rope_theta must be positive and finite, got {}",
                c.rope_theta
            );
        }
        if let Some(moe) = &c.moe {
            moe.validate()
                .map_err(|e| meshgrad_tensor::Error::msg(format!("llama config: {e}")))?;
        }
        if !(c.norm_eps.is_finite() && c.norm_eps > 0.0) {
            meshgrad_tensor::bail!(
                "llama config: norm_eps must be positive and finite, got {}",
                c.norm_eps
            );
        }
        Ok(())
    }

    /// Number of parameters of the model this config builds (a tied head counted once; every
    /// expert and the routers of a mixture of experts).
    pub fn num_parameters(&self) -> usize {
        let (v, c, l) = (self.vocab_size, self.n_embd, self.n_layer);
        let kv = self.n_kv_head * self.head_dim();
        let attn = 2 * c * c + 2 * c * kv;
        let mlp = match &self.moe {
            None => 3 * c * self.intermediate_size,
            Some(m) => m.n_experts * (3 * c * self.intermediate_size + c),
        };
        let layer = attn + mlp + 2 * c;
        let head = if self.tie_embeddings { 0 } else { v * c };
        v * c + l * layer + c + head
    }
}
