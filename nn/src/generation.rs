//! Token generation shared by the language models: the argument checks, the loop over new
//! tokens, greedy choice and temperature / top-k sampling with counter-based draws.

use meshgrad_autograd::no_grad;
use meshgrad_tensor::{DType, Random, Result, Tensor};

use crate::causal_lm::CausalLm;

/// How to choose the next token.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sampling {
    /// 0: greedy; else sample from `softmax(logits / temperature)`.
    pub temperature: f64,
    /// Sample only among the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// The seed of the draws; the draw of the token at sequence position `p` is `(seed, p)`.
    pub seed: u64,
}

/// Continues `prompt` by `max_new` tokens of `model` without gradients: each step runs the model
/// on the last [`CausalLm::context_len`] tokens (a batch of one on its device) and takes the
/// logits of the last position; only ids below [`CausalLm::sampled_vocab`] are prompted or
/// chosen. `on_token` sees each token as it is chosen; its error stops the generation. Errors (one line, beginning `generate:`): an empty prompt, a prompt token
/// outside the vocabulary, a temperature that is not a finite number >= 0, `top_k` of
/// `Some(0)`, logits that are not finite (naming the step).
pub(crate) fn generate(
    model: &dyn CausalLm,
    prompt: &[u32],
    max_new: usize,
    sampling: Sampling,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let (vocab, context_len, device) = (model.sampled_vocab(), model.context_len(), model.device());
    let last_logits = |context: &[u32]| -> Result<Vec<f64>> {
        let ids = Tensor::from_slice(context, (1, context.len()), device)?;
        model
            .logits(&ids)?
            .tensor()
            .narrow(1, context.len() - 1, 1)?
            .to_vec_f64()
    };
    let Sampling {
        temperature,
        top_k,
        seed,
    } = sampling;
    if prompt.is_empty() {
        meshgrad_tensor::bail!("generate: the prompt is empty (give at least one token)");
    }
    if !(temperature.is_finite() && temperature >= 0.0) {
        meshgrad_tensor::bail!(
            "generate: temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        );
    }
    if top_k == Some(0) {
        meshgrad_tensor::bail!(
            "generate: top_k must be at least 1 (None samples among all tokens), got 0"
        );
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        meshgrad_tensor::bail!(
            "generate: prompt token {bad} is outside the vocabulary (size {vocab})"
        );
    }
    no_grad(|| {
        let mut tokens = prompt.to_vec();
        for i in 0..max_new {
            let start = tokens.len().saturating_sub(context_len.max(1));
            let mut last = last_logits(&tokens[start..])?;
            // Ids past the vocabulary in use (padding) are never chosen.
            last.truncate(vocab);
            if let Some(bad) = last.iter().find(|x| !x.is_finite()) {
                meshgrad_tensor::bail!(
                    "generate: the logits are not finite ({bad}) at step {} of {max_new}; the \
                     model's weights may hold NaN or infinite values",
                    i + 1
                );
            }
            let next = if temperature <= 0.0 {
                argmax(&last)
            } else {
                sample(
                    &last,
                    temperature,
                    top_k,
                    // The key GPT generation has always used (the count of tokens so far
                    // plus the step), kept so that sampled outputs stay the same.
                    uniform_draw(seed, (tokens.len() + i) as u64),
                )
            };
            tokens.push(next as u32);
            on_token(next as u32)?;
        }
        Ok(tokens[prompt.len()..].to_vec())
    })
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

/// The first index of the largest value.
fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// The token the draw `u` picks from `softmax(logits / temperature)` over the `top_k` largest.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_sampling_respects_top_k() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, -1.0]), 1);
        // With top_k = 1 every draw takes the most likely token.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample(&[0.1, 3.0, 0.2], 1.0, Some(1), u), 1);
        }
        // Two equal logits: the lower half of the draws takes the first, the upper the second.
        assert_eq!(sample(&[1.0, 1.0], 1.0, None, 0.25), 0);
        assert_eq!(sample(&[1.0, 1.0], 1.0, None, 0.75), 1);
    }
}
