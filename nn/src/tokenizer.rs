//! Subword tokenizers: a small wrapper over Hugging Face's `tokenizers` crate.
//!
//! A [`Tokenizer`] loads and saves `tokenizer.json` (the format Hugging Face's Python and Rust
//! `tokenizers` read, so a file written here loads there and gives the same ids), encodes text to
//! ids and decodes ids to text, and trains two kinds from text files ([`TokenizerKind`]):
//!
//! * **byte-level BPE, GPT-2 style**: no normalizer, the GPT-2 pre-tokenizer regex over bytes
//!   mapped to printable characters (`Ġ` for a space), an initial alphabet of all 256 bytes (so no
//!   text is ever unknown), and one special token, `<|endoftext|>` ([`END_OF_TEXT`], id 0);
//! * **WordPiece, BERT style** (uncased): the BERT normalizer (clean text, split CJK characters,
//!   lowercase), the BERT pre-tokenizer (whitespace and punctuation), `##` continuation pieces,
//!   the special tokens `[PAD] [UNK] [CLS] [SEP] [MASK]` (ids 0 to 4, [`WORDPIECE_SPECIAL_TOKENS`])
//!   and the post-processor `[CLS] text [SEP]`.
//!
//! Training reads text files line by line (each line with its newline) and JSONL files
//! (`.jsonl`) document by document (each line's `text` field).
//!
//! [`TextStream`] turns generated ids into text as they come, through a tokenizer or as the
//! UTF-8 bytes of a byte-level model.
//!
//! Every error is one line and names the file involved.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainerBuilder};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;
use tokenizers::AddedToken;

/// The end-of-text token of byte-level BPE tokenizers, as in GPT-2.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// The special tokens of WordPiece tokenizers, in id order (0 to 4), as in BERT.
pub const WORDPIECE_SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// The smallest target vocabulary of a byte-level BPE: 256 bytes and [`END_OF_TEXT`].
pub const BPE_MIN_VOCAB: usize = 257;

/// The smallest target vocabulary of a WordPiece tokenizer: its 5 special tokens and one more.
pub const WORDPIECE_MIN_VOCAB: usize = 6;

/// Which kind of tokenizer to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE, GPT-2 style.
    Bpe,
    /// WordPiece, BERT style (uncased).
    WordPiece,
}

impl TokenizerKind {
    /// The smallest target vocabulary size this kind accepts.
    pub fn min_vocab_size(self) -> usize {
        match self {
            TokenizerKind::Bpe => BPE_MIN_VOCAB,
            TokenizerKind::WordPiece => WORDPIECE_MIN_VOCAB,
        }
    }
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenizerKind::Bpe => "bpe",
            TokenizerKind::WordPiece => "wordpiece",
        })
    }
}

impl FromStr for TokenizerKind {
    type Err = TokenizerError;

    /// `bpe` or `wordpiece` (any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bpe" => Ok(TokenizerKind::Bpe),
            "wordpiece" => Ok(TokenizerKind::WordPiece),
            _ => Err(TokenizerError::UnknownKind {
                kind: s.to_string(),
            }),
        }
    }
}

/// Errors from loading, saving, training and using tokenizers. Each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("cannot read {what} {}: {error}", path.display())]
    Io {
        /// What the file is for ("tokenizer file", "tokenizer training file").
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// A training file that is not UTF-8 text.
    #[error(
        "tokenizer training file {} is not valid UTF-8 (first bad byte at offset {offset})",
        path.display()
    )]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        offset: usize,
    },
    /// A tokenizer file that is not a valid tokenizer.json.
    #[error("cannot load tokenizer {}: {message}", path.display())]
    Load {
        /// The file.
        path: PathBuf,
        /// Why, on one line.
        message: String,
    },
    /// A tokenizer that could not be written.
    #[error("cannot write tokenizer {}: {message}", path.display())]
    Save {
        /// The file.
        path: PathBuf,
        /// Why, on one line.
        message: String,
    },
    /// A tokenizer kind other than `bpe` or `wordpiece`.
    #[error("unknown tokenizer kind {kind:?}: expected bpe or wordpiece")]
    UnknownKind {
        /// The kind as given.
        kind: String,
    },
    /// A target vocabulary size below the kind's minimum.
    #[error(
        "vocab size {vocab_size} is too small for a {kind} tokenizer: it needs at least {min} ({why})"
    )]
    VocabTooSmall {
        /// The kind.
        kind: TokenizerKind,
        /// The requested size.
        vocab_size: usize,
        /// The minimum.
        min: usize,
        /// What the minimum is made of.
        why: &'static str,
    },
    /// A vocabulary size above [`MAX_VOCAB_SIZE`].
    #[error(
        "vocab size {vocab_size} is too large: a tokenizer here holds at most {MAX_VOCAB_SIZE} \
         tokens"
    )]
    VocabTooLarge {
        /// The requested size.
        vocab_size: usize,
    },
    /// Training files with no text in them.
    #[error("no text to train a tokenizer on in {files}")]
    NoText {
        /// The files, comma-separated.
        files: String,
    },
    /// A training file that could not be parsed (a bad JSONL line); the message names the file and
    /// the line.
    #[error("{message}")]
    BadTrainingFile {
        /// What is wrong, naming the file.
        message: String,
    },
    /// Training failed inside the `tokenizers` crate.
    #[error("training a {kind} tokenizer on {files}: {message}")]
    Train {
        /// The kind.
        kind: TokenizerKind,
        /// The files, comma-separated.
        files: String,
        /// Why, on one line.
        message: String,
    },
    /// Text that could not be encoded.
    #[error("tokenizer {name}: cannot encode text: {message}")]
    Encode {
        /// The tokenizer's name (its file).
        name: String,
        /// Why, on one line.
        message: String,
    },
    /// Ids that could not be decoded.
    #[error("tokenizer {name}: cannot decode ids: {message}")]
    Decode {
        /// The tokenizer's name (its file).
        name: String,
        /// Why, on one line.
        message: String,
    },
}

/// Streaming decoding of ids, one at a time; see [`Tokenizer::decode_stream`].
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    inner: tokenizers::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
}

impl DecodeStream<'_> {
    /// The text that `id` adds to what was decoded so far, or `None` when it adds none yet.
    /// Errors (one line): an id outside the vocabulary, or the tokenizer's decoding error.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        let t = self.tokenizer;
        if id as usize >= t.vocab_size {
            return Err(TokenizerError::Decode {
                name: t.name.clone(),
                message: format!("id {id} is outside the vocabulary (size {})", t.vocab_size),
            });
        }
        self.inner.step(id).map_err(|e| TokenizerError::Decode {
            name: t.name.clone(),
            message: one_line(e),
        })
    }
}

/// Turns generated token ids into text piece by piece, as they come (as `meshgrad generate`
/// prints them): through a tokenizer's streaming decoder (special tokens skipped), or as UTF-8
/// bytes for a byte-level model (a character split over several tokens comes out whole once
/// complete; invalid bytes become U+FFFD, as [`String::from_utf8_lossy`] renders them), or not at
/// all for a model with neither (a vocabulary above 256 and no tokenizer).
///
/// ```
/// use meshgrad_nn::tokenizer::TextStream;
///
/// // A byte-level model: "日" is three tokens (its UTF-8 bytes).
/// let mut stream = TextStream::new(None, 256);
/// assert_eq!(stream.push(0xe6)?, "");
/// assert_eq!(stream.push(0x97)?, "");
/// assert_eq!(stream.push(0xa5)?, "日");
/// assert_eq!(stream.push(0xe6)?, "");
/// assert_eq!(stream.finish(), "\u{FFFD}"); // an incomplete character at the end
/// # Ok::<(), meshgrad_nn::tokenizer::TokenizerError>(())
/// ```
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
    /// Errors: the tokenizer's ([`DecodeStream::step`]).
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

/// Result type of this module.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// A tokenizer: a Hugging Face `tokenizers::Tokenizer` with a name for messages and its
/// vocabulary size.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    name: String,
    vocab_size: usize,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

/// A `tokenizers` error as one line.
fn one_line(e: impl fmt::Display) -> String {
    e.to_string()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// File names joined for messages.
fn file_list(files: &[PathBuf]) -> String {
    if files.is_empty() {
        return "no files".to_string();
    }
    files
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The largest vocabulary a tokenizer may be trained to: token ids are `u32`, and a model's
/// embedding table has a row per token, so sizes are bounded well below `u32::MAX`
/// (16,777,216, 64 times the largest vocabularies in use).
pub const MAX_VOCAB_SIZE: usize = 1 << 24;

/// Refuses a vocabulary size below what `kind` needs for its alphabet and special tokens, or
/// above [`MAX_VOCAB_SIZE`], before any text is read.
fn check_vocab_size(kind: TokenizerKind, vocab_size: usize) -> Result<()> {
    let min = kind.min_vocab_size();
    if vocab_size < min {
        return Err(TokenizerError::VocabTooSmall {
            kind,
            vocab_size,
            min,
            why: match kind {
                TokenizerKind::Bpe => "256 bytes and <|endoftext|>",
                TokenizerKind::WordPiece => "[PAD] [UNK] [CLS] [SEP] [MASK] and one more",
            },
        });
    }
    if vocab_size > MAX_VOCAB_SIZE {
        return Err(TokenizerError::VocabTooLarge { vocab_size });
    }
    Ok(())
}

impl Tokenizer {
    /// Wraps a `tokenizers::Tokenizer`; `name` names it in messages (usually its file).
    ///
    /// Errors if its vocabulary is empty.
    pub fn from_inner(inner: tokenizers::Tokenizer, name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if vocab_size == 0 {
            return Err(TokenizerError::Load {
                path: PathBuf::from(&name),
                message: "the vocabulary is empty".to_string(),
            });
        }
        Ok(Tokenizer {
            inner,
            name,
            vocab_size,
        })
    }

    /// Loads a `tokenizer.json` file (Hugging Face format).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let json = std::fs::read_to_string(path).map_err(|error| TokenizerError::Io {
            what: "tokenizer file",
            path: path.to_path_buf(),
            error,
        })?;
        Tokenizer::from_json(&json, path)
    }

    /// Parses `tokenizer.json` text; `path` names it in messages.
    pub fn from_json(json: &str, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_str(json).map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            message: one_line(e),
        })?;
        Tokenizer::from_inner(inner, path.display().to_string())
    }

    /// Writes the tokenizer as `tokenizer.json` (pretty-printed), creating no directories.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let json = self.to_json().map_err(|e| TokenizerError::Save {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        // Atomically: a failed write (a full disk) leaves an old tokenizer.json as it was.
        crate::state::write_bytes_atomic(path, json.as_bytes()).map_err(|e| TokenizerError::Save {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// The tokenizer as `tokenizer.json` text (pretty-printed).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(true)
            .map_err(|e| TokenizerError::Save {
                path: PathBuf::from(&self.name),
                message: one_line(e),
            })
    }

    /// The name used in messages: the file it was loaded from, or how it was trained.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of ids a model needs: one more than the largest id, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token (special tokens included), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id, if there is one.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes `text` to ids. With `add_special_tokens` the post-processor adds its tokens
    /// (`[CLS] ... [SEP]` for WordPiece; nothing for byte-level BPE), as Hugging Face's
    /// `encode` does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.encode_pieces(text, add_special_tokens)?.0)
    }

    /// Encodes `text` to ids and their token strings.
    pub fn encode_pieces(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Vec<String>)> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.encode_error(e))?;
        Ok((enc.get_ids().to_vec(), enc.get_tokens().to_vec()))
    }

    /// Encodes several texts (in parallel).
    pub fn encode_batch(&self, texts: &[&str], add_special_tokens: bool) -> Result<Vec<Vec<u32>>> {
        let encs = self
            .inner
            .encode_batch(texts.to_vec(), add_special_tokens)
            .map_err(|e| self.encode_error(e))?;
        Ok(encs.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// The ids of one training document: [`END_OF_TEXT`] first when the vocabulary has it (GPT-2
    /// and llm.c put it before every document), then `encode(text, true)` (which adds
    /// `[CLS] ... [SEP]` for WordPiece).
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = self.token_to_id(END_OF_TEXT).into_iter().collect();
        ids.extend(self.encode(text, true)?);
        Ok(ids)
    }

    /// [`Tokenizer::encode_document`] of each text (in parallel), concatenated.
    pub fn encode_documents(&self, texts: &[&str]) -> Result<Vec<u32>> {
        let eot = self.token_to_id(END_OF_TEXT);
        let mut ids = Vec::new();
        for doc in self.encode_batch(texts, true)? {
            ids.extend(eot);
            ids.extend(doc);
        }
        Ok(ids)
    }

    /// Decodes ids to text; `skip_special_tokens` leaves out special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizerError::Decode {
                name: self.name.clone(),
                message: format!(
                    "id {bad} is outside the vocabulary (size {})",
                    self.vocab_size
                ),
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode {
                name: self.name.clone(),
                message: one_line(e),
            })
    }

    /// A decoder that turns ids into text one at a time, as they are generated (for streaming
    /// output): each [`DecodeStream::step`] returns the text the new id adds, the same pieces
    /// [`Tokenizer::decode`] would join (spacing between tokens included), or `None` while the
    /// id does not complete any text yet (a byte-fallback piece of a character).
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream {
            tokenizer: self,
            inner: self.inner.decode_stream(skip_special_tokens),
        }
    }

    fn encode_error(&self, e: impl fmt::Display) -> TokenizerError {
        TokenizerError::Encode {
            name: self.name.clone(),
            message: one_line(e),
        }
    }

    /// Trains a tokenizer of `kind` with a target vocabulary of `vocab_size` (special tokens
    /// included) on text files: a `.jsonl` file gives the `text` field of each line, any other
    /// file its lines (each with its newline). The result can be smaller than the target when the
    /// text has too few distinct pairs to merge, and a WordPiece vocabulary can be larger when
    /// the text has more distinct characters than the target.
    ///
    /// Errors name the file: missing or unreadable, not UTF-8, a bad JSONL line, no text at all;
    /// or the target size below [`TokenizerKind::min_vocab_size`].
    pub fn train(kind: TokenizerKind, vocab_size: usize, files: &[PathBuf]) -> Result<Self> {
        check_vocab_size(kind, vocab_size)?;
        let mut texts: Vec<String> = Vec::new();
        for path in files {
            read_training_text(path, &mut texts)?;
        }
        if texts.iter().all(|t| t.trim().is_empty()) {
            return Err(TokenizerError::NoText {
                files: file_list(files),
            });
        }
        let name = format!("<{kind} tokenizer trained on {}>", file_list(files));
        Tokenizer::train_on(kind, vocab_size, texts.iter(), name).map_err(|e| match e {
            TokenizerError::Train { kind, message, .. } => TokenizerError::Train {
                kind,
                files: file_list(files),
                message,
            },
            other => other,
        })
    }

    /// Trains a tokenizer of `kind` on the given texts (each one sequence); see
    /// [`Tokenizer::train`]. `name` names the result in messages.
    pub fn train_on<I, S>(
        kind: TokenizerKind,
        vocab_size: usize,
        texts: I,
        name: impl Into<String>,
    ) -> Result<Self>
    where
        I: Iterator<Item = S> + Send,
        S: AsRef<str> + Send,
    {
        check_vocab_size(kind, vocab_size)?;
        let name = name.into();
        let fail = |e: tokenizers::Error| TokenizerError::Train {
            kind,
            files: name.clone(),
            message: one_line(e),
        };
        let inner = match kind {
            TokenizerKind::Bpe => {
                let mut tk = tokenizers::Tokenizer::new(BPE::default());
                // GPT-2: no prefix space, offsets trimmed, the GPT-2 split regex.
                tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
                tk.with_post_processor(Some(ByteLevel::new(false, true, true)));
                tk.with_decoder(Some(ByteLevel::default()));
                let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
                    .vocab_size(vocab_size)
                    .min_frequency(0)
                    .show_progress(false)
                    .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
                    .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                    .build()
                    .into();
                tk.train(&mut trainer, texts).map_err(fail)?;
                tk
            }
            TokenizerKind::WordPiece => {
                let mut tk = tokenizers::Tokenizer::new(WordPiece::default());
                tk.with_normalizer(Some(BertNormalizer::default()))
                    .map_err(fail)?;
                tk.with_pre_tokenizer(Some(BertPreTokenizer));
                tk.with_decoder(Some(WordPieceDecoder::default()));
                let mut trainer: TrainerWrapper = WordPieceTrainerBuilder::new()
                    .vocab_size(vocab_size)
                    .min_frequency(0)
                    .show_progress(false)
                    .special_tokens(
                        WORDPIECE_SPECIAL_TOKENS
                            .iter()
                            .map(|t| AddedToken::from(*t, true))
                            .collect(),
                    )
                    .continuing_subword_prefix("##".to_string())
                    .build()
                    .into();
                tk.train(&mut trainer, texts).map_err(fail)?;
                let id = |t: &str| {
                    tk.token_to_id(t).ok_or_else(|| TokenizerError::Train {
                        kind,
                        files: name.clone(),
                        message: format!("the trained vocabulary has no {t}"),
                    })
                };
                let (cls, sep) = (id("[CLS]")?, id("[SEP]")?);
                tk.with_post_processor(Some(BertProcessing::new(
                    ("[SEP]".to_string(), sep),
                    ("[CLS]".to_string(), cls),
                )));
                tk
            }
        };
        Tokenizer::from_inner(inner, name)
    }
}

/// Appends the training texts of one file to `out`: the `text` of each JSONL line, or each line
/// (with its newline) of a text file.
fn read_training_text(path: &Path, out: &mut Vec<String>) -> Result<()> {
    let is_jsonl = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"));
    if is_jsonl {
        crate::data::for_each_jsonl_text(path, |_, text| {
            out.push(text);
            Ok(())
        })
        .map_err(|e| match e {
            crate::data::DataError::Io { path, error } => TokenizerError::Io {
                what: "tokenizer training file",
                path,
                error,
            },
            other => TokenizerError::BadTrainingFile {
                message: other.to_string(),
            },
        })?;
        return Ok(());
    }
    let bytes = std::fs::read(path).map_err(|error| TokenizerError::Io {
        what: "tokenizer training file",
        path: path.to_path_buf(),
        error,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| TokenizerError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    out.extend(text.split_inclusive('\n').map(str::to_string));
    Ok(())
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
            assert_eq!(text, String::from_utf8_lossy(&bytes), "{bytes:?}");
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
        // The CLI's built-in corpus (Pride and Prejudice).
        let corpus = String::from_utf8_lossy(include_bytes!("../../assets/corpus.txt"));
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
}
