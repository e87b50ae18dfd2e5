//! [`ModelShape`]: the sizes of a transformer that estimates of memory, FLOPs and time need,
//! described by the features that change them rather than by the family's name. Every family's
//! config gives its own (`GptConfig::shape`, `BertConfig::shape`, `LlamaConfig::shape`); the
//! memory and cost formulas that read it live in `meshgrad_parallel::plan`.

/// A transformer's sizes and the features that change its parameter count and activations.
///
/// ```
/// use meshgrad_nn::LlamaConfig;
/// let mut config = LlamaConfig::new(32000, 512, 256, 4, 8);
/// config.n_kv_head = 2;
/// let shape = config.shape();
/// assert_eq!((shape.n_head, shape.n_kv_head), (8, 2));
/// assert!(shape.gated_mlp && !shape.learned_positions && !shape.tied);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Rows of the token table (the padded vocabulary).
    pub vocab_size: usize,
    /// The context length.
    pub positions: usize,
    /// Blocks (layers).
    pub n_layer: usize,
    /// Attention (query) heads per block.
    pub n_head: usize,
    /// Key/value heads per block (`n_head` without grouped-query attention).
    pub n_kv_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Width of the MLP's hidden layer.
    pub ffn: usize,
    /// Whether linears and norms have biases (norms without a bias: RMSNorm, or a bias-free
    /// LayerNorm).
    pub bias: bool,
    /// Whether positions are a learned table (`false`: rotary, nothing to learn).
    pub learned_positions: bool,
    /// Whether attention reads q, k and v in place from the fused qkv projection (GPT's
    /// `c_attn`), keeping no heads-first copies of them (a single-device or tensor-parallel
    /// run; context parallelism makes the copies anyway).
    pub fused_qkv: bool,
    /// Rows of the token-type table (0 when there is none).
    pub type_vocab_size: usize,
    /// Whether the embedding ends with a norm (BERT).
    pub embedding_norm: bool,
    /// Whether the MLP is gated (SwiGLU: gate, up and down matrices) rather than up and down.
    pub gated_mlp: bool,
    /// Whether a norm follows the last block (pre-norm decoders).
    pub final_norm: bool,
    /// Whether the head transforms the hidden state first (BERT's masked-LM head: a dense
    /// layer and a norm) and adds a bias to the logits.
    pub head_transform: bool,
    /// Whether the head's matrix is the token table.
    pub tied: bool,
    /// Experts of each block's mixture of experts, each an MLP of width `ffn` (0: one dense
    /// MLP). A router (`n_embd x n_experts`) picks each token's experts.
    pub n_experts: usize,
    /// Experts each token goes through (with `n_experts > 0`).
    pub experts_per_token: usize,
    /// Whether training drops out the embedding's output and each block's attention and MLP
    /// outputs (the residual stream's dropouts; a dropout probability above 0).
    pub dropout: bool,
    /// Whether training drops out the attention probabilities (BERT's
    /// `attention_probs_dropout_prob` above 0): the attention is then composed from ops that
    /// form the `T x T` scores, not the fused kernel.
    pub attention_dropout: bool,
}

impl ModelShape {
    /// The MLPs (experts) one block holds: `n_experts`, or the one dense MLP.
    pub fn mlps_held(&self) -> usize {
        self.n_experts.max(1)
    }

    /// The MLPs (experts) one token goes through: `experts_per_token`, or the one dense MLP.
    pub fn mlps_per_token(&self) -> usize {
        if self.n_experts == 0 {
            1
        } else {
            self.experts_per_token.max(1)
        }
    }
}
