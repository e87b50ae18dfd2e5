//! `meshgrad generate`: continue a prompt with a checkpoint.

use anyhow::Result;
use meshgrad_nn::tokenizer::Tokenizer;
use meshgrad_nn::Gpt;

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

/// Generates `max_new` tokens after `prompt`.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    top_k: Option<usize>,
    seed: u64,
) -> Result<Vec<u32>> {
    Ok(model.generate(prompt, max_new, temperature, top_k, seed)?)
}
