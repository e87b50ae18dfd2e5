//! `meshgrad generate`: continue a prompt with a checkpoint, printing the text as each token is
//! chosen (through [`TextStream`]).

use std::io::Write;

use anyhow::{Context, Result};
use meshgrad_nn::tokenizer::{TextStream, Tokenizer};
use meshgrad_nn::CausalLm;

/// A prompt as token ids, from text (byte-level: each UTF-8 byte is a token) or from a
/// comma/space separated id list.
pub fn prompt_tokens(text: Option<&str>, ids: Option<&str>, vocab: usize) -> Result<Vec<u32>> {
    prompt_tokens_with(text, ids, vocab, None)
}

/// [`prompt_tokens`], with text encoded by `tokenizer` (without special tokens) when there is
/// one.
pub fn prompt_tokens_with(
    text: Option<&str>,
    ids: Option<&str>,
    vocab: usize,
    tokenizer: Option<&Tokenizer>,
) -> Result<Vec<u32>> {
    let tokens: Vec<u32> = match (text, ids, tokenizer) {
        (Some(_), Some(_), _) => {
            anyhow::bail!("give either --prompt or --prompt-tokens, not both")
        }
        (None, None, _) => anyhow::bail!("give a prompt: --prompt TEXT or --prompt-tokens IDS"),
        (Some(t), None, Some(tok)) => tok.encode(t, false)?,
        (Some(t), None, None) => {
            if vocab < 256 {
                anyhow::bail!("--prompt encodes text as bytes (vocab 256) but the model's vocabulary has {vocab} tokens; use --prompt-tokens");
            }
            t.bytes().map(u32::from).collect()
        }
        (None, Some(s), _) => s
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|p| !p.is_empty())
            .map(|p| {
                p.parse::<u32>().map_err(|_| {
                    anyhow::anyhow!(
                        "--prompt-tokens: '{p}' is not a token id (expected e.g. 12,7,99)"
                    )
                })
            })
            .collect::<Result<_>>()?,
    };
    if tokens.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        anyhow::bail!("prompt token {bad} is outside the model's vocabulary (size {vocab})");
    }
    Ok(tokens)
}

/// Renders byte-level tokens as text (invalid UTF-8 replaced).
pub fn detokenize(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| t.min(255) as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Checks `generate`'s sampling arguments before any work, with one-line errors naming the flag:
/// `--max-new-tokens` at least 1, `--temperature` a finite number >= 0 (0 is greedy), `--top-k`
/// at least 1 when given (a `k` above the vocabulary size keeps every token).
pub fn check_sampling(max_new_tokens: usize, temperature: f64, top_k: Option<usize>) -> Result<()> {
    if max_new_tokens == 0 {
        anyhow::bail!("--max-new-tokens must be at least 1, got 0");
    }
    if !(temperature.is_finite() && temperature >= 0.0) {
        anyhow::bail!(
            "--temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        );
    }
    if top_k == Some(0) {
        anyhow::bail!(
            "--top-k must be at least 1, got 0 (leave it out to sample among all tokens; \
             --temperature 0 is greedy)"
        );
    }
    Ok(())
}

/// Generates `max_new` tokens after `prompt` (see [`CausalLm::generate`]) and writes their text to
/// `out` as each token is chosen (flushed per token; see [`TextStream`]), then a newline when
/// there was text. Returns the generated ids. Errors: bad sampling arguments
/// ([`check_sampling`]), non-finite logits (naming the step), a failed write.
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &dyn CausalLm,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    top_k: Option<usize>,
    seed: u64,
    tokenizer: Option<&Tokenizer>,
    out: &mut dyn Write,
) -> Result<Vec<u32>> {
    check_sampling(max_new, temperature, top_k)?;
    let mut text = TextStream::new(tokenizer, model.sampled_vocab());
    let result = model.generate(prompt, max_new, temperature, top_k, seed, &mut |id| {
        let piece = text
            .push(id)
            .map_err(|e| meshgrad_tensor::Error::Msg(e.to_string()))?;
        if !piece.is_empty() {
            out.write_all(piece.as_bytes())
                .and_then(|()| out.flush())
                .map_err(|e| {
                    meshgrad_tensor::Error::Msg(format!("writing the generated text: {e}"))
                })?;
        }
        Ok(())
    });
    let ids = result?;
    if text.has_text() {
        let rest = text.finish();
        out.write_all(rest.as_bytes())
            .and_then(|()| writeln!(out))
            .and_then(|()| out.flush())
            .context("writing the generated text")?;
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_arguments_are_checked() {
        check_sampling(1, 0.0, None).unwrap();
        check_sampling(5, 0.8, Some(1)).unwrap();
        for (n, t, k, needle) in [
            (0, 0.8, None, "--max-new-tokens"),
            (1, -1.0, None, "--temperature"),
            (1, f64::NAN, None, "--temperature"),
            (1, f64::INFINITY, None, "--temperature"),
            (1, 0.8, Some(0), "--top-k"),
        ] {
            let e = check_sampling(n, t, k).unwrap_err().to_string();
            assert!(e.contains(needle) && !e.contains('\n'), "{e}");
        }
    }
}
