//! The benchmark models of `shared/notes/anchors.md` and the FLOPs of their training step.

use meshgrad_tensor::{bail, Result};

use crate::GptConfig;

/// The benchmark model configs of `shared/notes/anchors.md`: `(config, batch)`.
pub fn bench_config(name: &str) -> Result<(GptConfig, usize)> {
    let (n_layer, n_head, n_embd, seq) = match name {
        "tiny-gpt" => (4, 4, 256, 128),
        "small-gpt" => (6, 6, 384, 256),
        "gpt2-124m" => (12, 12, 768, 1024),
        other => {
            bail!("bench: unknown model {other:?} (expected tiny-gpt, small-gpt or gpt2-124m)")
        }
    };
    // GPT-2's 50257 tokens padded to a multiple of 128 (anchors.md); byte-level for the others.
    let vocab_size = if name == "gpt2-124m" { 50304 } else { 256 };
    Ok((
        GptConfig {
            vocab_size,
            block_size: seq,
            n_layer,
            n_head,
            n_embd,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        },
        8,
    ))
}

/// FLOPs of one training step (forward + backward) by the anchors' formula.
pub fn step_flops(cfg: &GptConfig, params: usize, batch: usize) -> f64 {
    let tokens = (batch * cfg.block_size) as f64;
    6.0 * params as f64 * tokens
        + 12.0 * (cfg.n_layer * cfg.n_embd * cfg.block_size) as f64 * tokens
}

/// The chunk count of `--reference-chunks` (0: the model's), checked as training checks it.
pub fn reference_chunk_count(cfg: &GptConfig, set: usize) -> Result<usize> {
    let model_k = crate::gpt::reference_chunks(cfg);
    match set {
        0 => Ok(model_k),
        k if k.is_power_of_two() && model_k.is_multiple_of(k) => Ok(k),
        k => bail!("bench: --reference-chunks {k} must be 0 or a power of two dividing {model_k}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_has_the_anchor_shape() {
        let (cfg, batch) = bench_config("gpt2-124m").unwrap();
        assert_eq!(
            (
                cfg.vocab_size,
                cfg.n_layer,
                cfg.n_head,
                cfg.n_embd,
                cfg.block_size,
                batch
            ),
            (50304, 12, 12, 768, 1024, 8)
        );
        // 124M parameters with the tied head (nanoGPT counts 124,475,904 with vocab 50304).
        assert_eq!(cfg.num_parameters(), 124_475_904);
    }
}
