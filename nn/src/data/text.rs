//! Text to tokens: text files and JSONL documents, byte-level or through a [`Tokenizer`].
//!
//! * A text file is one document.
//! * A JSONL file holds one document per line: a JSON object whose `text` field is a string
//!   (other fields are ignored; blank lines are skipped). A line that is not JSON, not an object,
//!   or has no string `text` is an error naming the file and the line number.
//!
//! Byte-level (no tokenizer): each byte is a token (vocabulary 256); a JSONL document's bytes are
//! followed by a newline ([`BYTE_LEVEL_DOCUMENT_END`]), so documents stay apart.
//! Through a tokenizer: each document is [`Tokenizer::encode_document`]: `<|endoftext|>` first
//! when the vocabulary has it (byte-level BPE, as GPT-2 and llm.c do), then the text with the
//! tokenizer's special tokens (`[CLS] ... [SEP]` for WordPiece); the vocabulary is the
//! tokenizer's.

use std::io::BufRead;
use std::path::Path;

use super::{DataError, Result, TokenDataset};
use crate::tokenizer::Tokenizer;

/// The byte that ends each JSONL document in byte-level data: a newline.
pub const BYTE_LEVEL_DOCUMENT_END: u8 = b'\n';

/// JSONL documents handed to the tokenizer at once (encoded in parallel).
const JSONL_BATCH: usize = 1024;

/// Calls `f(line_number, text)` for the `text` field of every non-blank line of a JSONL file, in
/// order, reading one line at a time; returns the number of documents.
///
/// Errors: [`DataError::Io`] naming the file; [`DataError::Jsonl`] naming the file and the 1-based
/// line for a line that is not UTF-8, not valid JSON, not an object, or without a string `text`
/// field; any error `f` returns.
pub fn for_each_jsonl_text(
    path: &Path,
    mut f: impl FnMut(usize, String) -> Result<()>,
) -> Result<usize> {
    let io = |error| DataError::Io {
        path: path.to_path_buf(),
        error,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut reader = std::io::BufReader::new(file);
    let mut buf = Vec::new();
    let mut line = 0usize;
    let mut docs = 0usize;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io)? == 0 {
            break;
        }
        line += 1;
        let bad = |reason: String| DataError::Jsonl {
            path: path.to_path_buf(),
            line,
            reason,
        };
        let text = std::str::from_utf8(&buf).map_err(|e| {
            bad(format!(
                "not valid UTF-8 (first bad byte at column {})",
                e.valid_up_to() + 1
            ))
        })?;
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
            let msg = e.to_string();
            let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
            match e.column() {
                0 => bad(format!("invalid JSON: {msg}")),
                c => bad(format!("invalid JSON at column {c}: {msg}")),
            }
        })?;
        let doc = match value {
            serde_json::Value::Object(mut map) => match map.remove("text") {
                Some(serde_json::Value::String(s)) => s,
                Some(other) => {
                    return Err(bad(format!(
                        "the \"text\" field is {}, not a string",
                        json_kind(&other)
                    )))
                }
                None => return Err(bad("no \"text\" field".to_string())),
            },
            other => {
                return Err(bad(format!(
                    "expected a JSON object with a \"text\" field, got {}",
                    json_kind(&other)
                )))
            }
        };
        f(line, doc)?;
        docs += 1;
    }
    Ok(docs)
}

/// "a number", "an array", ... for messages.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl TokenDataset {
    /// Text through a tokenizer: [`Tokenizer::encode_document`] of `text`, with the tokenizer's
    /// vocabulary size. `name` names the data in messages.
    pub fn from_text(name: impl Into<String>, text: &str, tokenizer: &Tokenizer) -> Result<Self> {
        let name = name.into();
        let ids = tokenizer
            .encode_document(text)
            .map_err(|e| DataError::Text {
                name: name.clone(),
                message: e.to_string(),
            })?;
        TokenDataset::from_tokens(name, ids, tokenizer.vocab_size())
    }

    /// A text file as one document: byte-level without a tokenizer
    /// ([`TokenDataset::from_text_file`]), or through `tokenizer` ([`TokenDataset::from_text`]),
    /// in which case the file must be UTF-8.
    pub fn from_text_file_with(
        path: impl AsRef<Path>,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<Self> {
        let path = path.as_ref();
        let Some(tokenizer) = tokenizer else {
            return TokenDataset::from_text_file(path);
        };
        let bytes = std::fs::read(path).map_err(|error| DataError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        if bytes.is_empty() {
            return Err(DataError::EmptyFile {
                path: path.to_path_buf(),
            });
        }
        let name = path.display().to_string();
        let text = String::from_utf8(bytes).map_err(|e| DataError::Text {
            name: name.clone(),
            message: format!(
                "not valid UTF-8 (first bad byte at offset {}); a tokenizer needs UTF-8 text",
                e.utf8_error().valid_up_to()
            ),
        })?;
        TokenDataset::from_text(name, &text, tokenizer)
    }

    /// A JSONL file ([`for_each_jsonl_text`]): byte-level, each document's bytes followed by a
    /// newline, vocabulary 256; or each document through `tokenizer`
    /// ([`Tokenizer::encode_documents`], in batches encoded in parallel), with the tokenizer's
    /// vocabulary. The documents are read one line at a time; only their tokens are kept.
    ///
    /// Errors name the file (and the line for a bad line), or say that it has no documents.
    pub fn from_jsonl(path: impl AsRef<Path>, tokenizer: Option<&Tokenizer>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let mut tokens: Vec<u32> = Vec::new();
        let mut pending: Vec<String> = Vec::new();
        let flush = |pending: &mut Vec<String>, tokens: &mut Vec<u32>| -> Result<()> {
            if let Some(tok) = tokenizer {
                let texts: Vec<&str> = pending.iter().map(String::as_str).collect();
                let ids = tok.encode_documents(&texts).map_err(|e| DataError::Text {
                    name: name.clone(),
                    message: e.to_string(),
                })?;
                tokens.extend(ids);
            }
            pending.clear();
            Ok(())
        };
        let docs = for_each_jsonl_text(path, |_, text| {
            match tokenizer {
                None => {
                    tokens.extend(text.bytes().map(u32::from));
                    tokens.push(u32::from(BYTE_LEVEL_DOCUMENT_END));
                }
                Some(_) => {
                    pending.push(text);
                    if pending.len() >= JSONL_BATCH {
                        flush(&mut pending, &mut tokens)?;
                    }
                }
            }
            Ok(())
        })?;
        flush(&mut pending, &mut tokens)?;
        if docs == 0 {
            return Err(DataError::Text {
                name,
                message: "no documents (every line is blank)".to_string(),
            });
        }
        let vocab = tokenizer.map_or(256, Tokenizer::vocab_size);
        TokenDataset::from_tokens(name, tokens, vocab)
    }
}
