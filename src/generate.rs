//! `meshgrad generate`: continue a prompt with a checkpoint, printing the text as each token is
//! chosen.

use std::io::Write;

use anyhow::{Context, Result};
use meshgrad_nn::tokenizer::{DecodeStream, Tokenizer};
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

/// Turns generated token ids into text piece by piece, as they come: through a tokenizer's
/// streaming decoder (special tokens skipped), or as UTF-8 bytes for a byte-level model (a
/// character split over several tokens comes out whole once complete; invalid bytes become
/// U+FFFD, as [`detokenize`] renders them), or not at all for a model with neither (a vocabulary
/// above 256 and no tokenizer).
pub struct TextStream<'a> {
    decoder: Decoder<'a>,
}

enum Decoder<'a> {
    Tokenizer(DecodeStream<'a>),
    Bytes(Vec<u8>),
    None,
}

impl<'a> TextStream<'a> {
    /// The stream for a model of vocabulary `vocab`, with `tokenizer` when the checkpoint has one.
    pub fn new(tokenizer: Option<&'a Tokenizer>, vocab: usize) -> TextStream<'a> {
        let decoder = match tokenizer {
            Some(tok) => Decoder::Tokenizer(tok.decode_stream(true)),
            None if vocab <= 256 => Decoder::Bytes(Vec::new()),
            None => Decoder::None,
        };
        TextStream { decoder }
    }

    /// Whether the stream produces text at all.
    pub fn has_text(&self) -> bool {
        !matches!(self.decoder, Decoder::None)
    }

    /// The text that token `id` completes (often empty for the first bytes of a character).
    pub fn push(&mut self, id: u32) -> Result<String> {
        match &mut self.decoder {
            Decoder::Tokenizer(stream) => Ok(stream.step(id)?.unwrap_or_default()),
            Decoder::Bytes(pending) => {
                pending.push(id.min(255) as u8);
                Ok(take_utf8(pending, false))
            }
            Decoder::None => Ok(String::new()),
        }
    }

    /// The text still held back at the end (the bytes of an incomplete character, as U+FFFD).
    pub fn finish(&mut self) -> String {
        match &mut self.decoder {
            Decoder::Bytes(pending) => take_utf8(pending, true),
            _ => String::new(),
        }
    }
}

/// Removes from `pending` the longest prefix that renders as text and returns it: valid UTF-8,
/// and each invalid sequence as one U+FFFD (as `String::from_utf8_lossy`). An incomplete
/// character at the end stays in `pending` unless `at_end`.
fn take_utf8(pending: &mut Vec<u8>, at_end: bool) -> String {
    let mut out = String::new();
    let mut rest: &[u8] = pending;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // The first `valid` bytes are UTF-8 (checked by from_utf8).
                out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                match e.error_len() {
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        rest = &rest[valid + bad..];
                    }
                    None if at_end => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        rest = &[];
                        break;
                    }
                    None => {
                        rest = &rest[valid..];
                        break;
                    }
                }
            }
        }
    }
    let keep = rest.len();
    pending.drain(..pending.len() - keep);
    out
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
    fn byte_stream_matches_lossy_decoding() {
        let cases: Vec<Vec<u8>> = vec![
            "plain ascii".bytes().collect(),
            "héllo wörld, 日本語 🎉".bytes().collect(),
            vec![0x68, 0xff, 0x69, 0xe6, 0x97, 0xa5, 0xe6, 0x97],
            vec![0xe6, 0x41, 0xf0, 0x9f, 0x8e],
            vec![0xc3],
        ];
        for bytes in cases {
            let ids: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
            let mut stream = TextStream::new(None, 256);
            let mut text = String::new();
            for &id in &ids {
                text.push_str(&stream.push(id).unwrap());
            }
            text.push_str(&stream.finish());
            assert_eq!(text, detokenize(&ids), "{bytes:?}");
        }
        // A character split over tokens comes out whole when its last byte arrives.
        let mut stream = TextStream::new(None, 256);
        assert_eq!(stream.push(0xe6).unwrap(), "");
        assert_eq!(stream.push(0x97).unwrap(), "");
        assert_eq!(stream.push(0xa5).unwrap(), "日");
        assert!(!TextStream::new(None, 300).has_text());
    }

    #[test]
    fn tokenizer_stream_joins_to_the_full_decoding() {
        use meshgrad_nn::tokenizer::TokenizerKind;
        let corpus = String::from_utf8_lossy(crate::corpus::BUILTIN_CORPUS);
        let text = corpus.lines().take(2000).collect::<Vec<_>>();
        for (kind, size) in [(TokenizerKind::Bpe, 400), (TokenizerKind::WordPiece, 300)] {
            let tok = Tokenizer::train_on(kind, size, text.iter(), "test").unwrap();
            let ids = tok
                .encode(
                    "It is a truth universally acknowledged, that a single man.",
                    false,
                )
                .unwrap();
            let mut stream = TextStream::new(Some(&tok), tok.vocab_size());
            let mut joined = String::new();
            for &id in &ids {
                joined.push_str(&stream.push(id).unwrap());
            }
            joined.push_str(&stream.finish());
            assert_eq!(joined, tok.decode(&ids, true).unwrap(), "{kind}");
            let bad = tok.vocab_size() as u32;
            let err = stream.push(bad).unwrap_err().to_string();
            assert!(err.contains("outside the vocabulary"), "{err}");
        }
    }

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
