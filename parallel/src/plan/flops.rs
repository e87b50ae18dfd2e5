//! The floating-point operations of a training step, from the model's [`ModelShape`]: what the
//! planner's compute time and MFU start from.
//!
//! Convention (that of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
//! Clusters Using Megatron-LM", 2021, section 5.1, so figures compare with published ones): only
//! matrix multiplications count, two operations per multiply-add; the attention scores and their
//! weighted sum are counted over the whole `T x T` square (a causal kernel that skips the masked
//! half does less work than counted); the backward pass costs twice the forward; recomputing the
//! activations in the backward adds one forward. Per token of a sequence of `T` tokens, the
//! forward of one block is
//!
//! * attention projections: `2 C (C + 2 K + C)` for q, k, v and the output (`K` the key/value
//!   width: `C` without grouped-query attention);
//! * scores and their weighted sum: `4 T C`;
//! * MLP: `4 C F` (up and down), `6 C F` when gated (gate, up and down); a mixture of experts
//!   counts the MLPs of the `k` experts a token goes through and its router, `2 C E` for `E`
//!   experts;
//!
//! and the head's logits add `2 C V`. For a GPT (`K = C`, `F = 4 C`) a step of `B` sequences is
//! then `72 B T L C^2 (1 + T / (6 C) + V / (12 L C))`, the paper's equation (without
//! recomputation; `96 ...` with it), which the tests check.

use meshgrad_nn::ModelShape;

/// Forward operations of one token, split as the planner needs them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenFlops {
    /// One block (all blocks are alike).
    pub block: f64,
    /// The head's logits.
    pub head: f64,
}

/// The forward operations of one token in a sequence of `seq` tokens (see the module docs).
pub fn forward_per_token(shape: &ModelShape, seq: usize) -> TokenFlops {
    let c = shape.n_embd as f64;
    let kv = (shape.n_embd / shape.n_head.max(1) * shape.n_kv_head) as f64;
    let f = shape.ffn as f64;
    let t = seq as f64;
    let projections = 2.0 * c * (2.0 * c + 2.0 * kv);
    let attention = 4.0 * t * c;
    let one_mlp = if shape.gated_mlp { 6.0 } else { 4.0 } * c * f;
    let router = 2.0 * c * shape.n_experts as f64;
    let mlp = shape.mlps_per_token() as f64 * one_mlp + router;
    TokenFlops {
        block: projections + attention + mlp,
        head: 2.0 * c * shape.vocab_size as f64,
    }
}

/// The operations of one training step over `rows` sequences of `seq` tokens: forward, backward
/// (twice the forward) and, when `recompute`, the blocks' forward once more.
///
/// ```
/// use meshgrad_nn::GptConfig;
/// use meshgrad_parallel::plan::flops::training_step;
/// let gpt2 = GptConfig {
///     vocab_size: 50257,
///     block_size: 1024,
///     n_layer: 12,
///     n_head: 12,
///     n_embd: 768,
///     dropout: 0.0,
///     bias: true,
///     layer_norm_eps: 1e-5,
/// };
/// // GPT-2 small, 8 x 1024 tokens: about 7.0 TFLOP per step (6 x 124 M parameters x 8192
/// // tokens is 6.1, plus the attention scores).
/// let f = training_step(&gpt2.shape(), 8, 1024, false);
/// assert!((f / 1e12 - 7.0).abs() < 0.05, "{f}");
/// ```
pub fn training_step(shape: &ModelShape, rows: usize, seq: usize, recompute: bool) -> f64 {
    let per = forward_per_token(shape, seq);
    let blocks = shape.n_layer as f64 * per.block;
    let passes = if recompute { 4.0 } else { 3.0 };
    let tokens = rows as f64 * seq as f64;
    tokens * (passes * blocks + 3.0 * per.head)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_nn::{GptConfig, LlamaConfig};

    fn gpt(l: usize, c: usize, heads: usize, v: usize, t: usize) -> ModelShape {
        GptConfig {
            vocab_size: v,
            block_size: t,
            n_layer: l,
            n_head: heads,
            n_embd: c,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        }
        .shape()
    }

    /// Narayanan et al. (2021), equation (3) and the line before it: `72 B s l h^2 (1 + s/6h +
    /// V/(12 l h))` without recomputation, `96 B s l h^2 (1 + s/6h + V/(16 l h))` with it.
    fn paper(b: f64, s: f64, l: f64, h: f64, v: f64, recompute: bool) -> f64 {
        if recompute {
            96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
        } else {
            72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
        }
    }

    #[test]
    fn gpt_steps_match_the_megatron_paper() {
        // Model shapes of the paper's weak-scaling table (Table 1: layers, hidden size, heads):
        // 1.7B (24, 2304, 24), 18.4B (40, 6144, 48), 145.6B (80, 12288, 96), 1T (128, 25600,
        // 160); sequence 2048, vocabulary 51200. The count is linear in the batch.
        for (l, h, heads, b) in [
            (24, 2304, 24, 8),
            (40, 6144, 48, 8),
            (80, 12288, 96, 8),
            (128, 25600, 160, 8),
        ] {
            let shape = gpt(l, h, heads, 51200, 2048);
            for recompute in [false, true] {
                let ours = training_step(&shape, b, 2048, recompute);
                let theirs = paper(b as f64, 2048.0, l as f64, h as f64, 51200.0, recompute);
                assert!(
                    (ours / theirs - 1.0).abs() < 1e-12,
                    "l {l} h {h} recompute {recompute}: {ours} vs {theirs}"
                );
            }
        }
    }

    #[test]
    fn grouped_query_attention_and_a_gated_mlp_change_the_count() {
        let mut c = LlamaConfig::new(32000, 4096, 4096, 32, 32);
        c.intermediate_size = 11008;
        let mha = forward_per_token(&c.shape(), 4096);
        c.n_kv_head = 8;
        let gqa = forward_per_token(&c.shape(), 4096);
        // k and v shrink from C x C to C x C/4 each: 2 C (2 C - 2 C/4) fewer.
        let (cc, f) = (4096.0f64, 11008.0f64);
        assert_eq!(mha.block - gqa.block, 2.0 * cc * (2.0 * cc - 0.5 * cc));
        // The gated MLP's three matrices.
        let dense = 2.0 * cc * 4.0 * cc + 4.0 * 4096.0 * cc + 6.0 * cc * f;
        assert_eq!(mha.block, dense);
        assert_eq!(mha.head, 2.0 * cc * 32000.0);
    }

    #[test]
    fn a_mixture_of_experts_counts_the_routed_experts_and_the_router() {
        // Mixtral-8x7B's shape: 8 experts of width 14336, 2 per token, 8 key/value heads.
        let mut c = LlamaConfig::new(32000, 4096, 4096, 32, 32);
        c.intermediate_size = 14336;
        c.n_kv_head = 8;
        let dense = forward_per_token(&c.shape(), 4096);
        c.moe = Some(meshgrad_nn::moe::MoeSettings {
            n_experts: 8,
            experts_per_token: 2,
            router_aux_loss_coef: 0.02,
            capacity_factor: None,
        });
        let moe = forward_per_token(&c.shape(), 4096);
        let (cc, f) = (4096.0f64, 14336.0f64);
        // One more expert's gated MLP, and the router's 4096 x 8 product.
        assert_eq!(moe.block - dense.block, 6.0 * cc * f + 2.0 * cc * 8.0);
        assert_eq!(moe.head, dense.head);
    }
}
