//! Token datasets for language-model training.
//!
//! Two kinds of token stream implement [`TokenSource`], the sampler's view of data:
//!
//! * [`TokenDataset`], tokens in memory, loaded from
//!   * a nanoGPT-style `.bin` file of little-endian `u16` ids ([`TokenDataset::from_bin`]),
//!   * a text file, as bytes (one token per byte, [`TokenDataset::from_text_file`]) or through a
//!     [`Tokenizer`] ([`TokenDataset::from_text_file_with`]),
//!   * a JSONL file with a `text` field per line ([`TokenDataset::from_jsonl`]),
//!   * bytes in memory, such as the built-in corpus ([`TokenDataset::from_bytes`]);
//! * [`ShardedDataset`], pre-tokenized shards in llm.c's format (a header of 256 little-endian
//!   `i32`: magic 20240520, version 1, token count; then the `u16` tokens), memory-mapped and never
//!   read whole. [`ShardFolder`] opens a folder of them and takes the shards with `val` in the file
//!   name (`*_val_*.bin`) as the validation set.
//!
//! [`load_split`] opens any of these by its path ([`DataFormat::of`]) and splits it into train and
//! validation parts; [`Dataset`] holds either kind.
//!
//! Training draws random windows with a *layout-invariant* sampler: the window of global batch row
//! `b` at step `s` is a pure function of `(seed, s, b)` (see [`window_hash`]) and of the length of the
//! token stream, over the concatenation of all shards. A data-parallel rank that owns rows `lo..hi`
//! of the global batch calls [`TokenSource::batch`] with that range and gets exactly the rows a single
//! device would get for the same range. The same tokens give the same batches whether they are in
//! memory or in shards.
//!
//! Evaluation uses fixed, non-overlapping windows ([`TokenSource::eval_windows`]).

use std::iter::StepBy;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::tokenizer::Tokenizer;

mod memory;
mod shards;
mod text;

pub use memory::TokenDataset;
pub use shards::{
    is_validation_shard, write_shard, Shard, ShardFolder, ShardedDataset, SHARD_HEADER_BYTES,
    SHARD_HEADER_INTS, SHARD_MAGIC, SHARD_VERSION,
};
pub use text::{for_each_jsonl_text, BYTE_LEVEL_DOCUMENT_END};

/// Errors from loading, splitting and sampling token datasets.
///
/// Every message names the file or dataset and the numbers involved, on one line.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened or read.
    #[error("cannot read dataset file {}: {error}", path.display())]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// A `.bin` token file whose length is not a multiple of 2 bytes.
    #[error(
        "token file {} has an odd length of {len} bytes; a .bin file holds little-endian u16 \
         token ids, 2 bytes each",
        path.display()
    )]
    OddLength {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
    },
    /// A file with no tokens in it.
    #[error("dataset file {} is empty (0 bytes)", path.display())]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },
    /// A token id that is not below the dataset's vocabulary size.
    #[error(
        "dataset {name}: token id {id} at position {position} is out of range for vocab_size \
         {vocab_size} (ids must be < vocab_size)"
    )]
    TokenOutOfRange {
        /// The dataset's name ([`TokenDataset::source`]).
        name: String,
        /// The offending id.
        id: u32,
        /// Its position in the token sequence.
        position: usize,
        /// The vocabulary size it violates.
        vocab_size: usize,
    },
    /// A vocabulary size of zero for a non-empty dataset, or one too large to index.
    #[error("dataset {name}: invalid vocab_size {vocab_size}")]
    BadVocabSize {
        /// The dataset's name.
        name: String,
        /// The rejected vocabulary size.
        vocab_size: usize,
    },
    /// A validation fraction outside the open interval (0, 1).
    #[error("dataset {name}: val_fraction must be in (0, 1), got {val_fraction}")]
    BadValFraction {
        /// The dataset's name.
        name: String,
        /// The rejected fraction.
        val_fraction: f64,
    },
    /// A split whose train or validation part is shorter than required.
    #[error(
        "dataset {name}: splitting {len} tokens with val_fraction {val_fraction} gives {train} \
         train and {val} validation tokens, but each part needs at least {min_len}"
    )]
    SplitTooShort {
        /// The dataset's name.
        name: String,
        /// Total number of tokens.
        len: usize,
        /// The requested validation fraction.
        val_fraction: f64,
        /// Tokens in the train part.
        train: usize,
        /// Tokens in the validation part.
        val: usize,
        /// The required minimum length of each part.
        min_len: usize,
    },
    /// A sequence length of zero.
    #[error("dataset {name}: seq_len must be at least 1, got 0")]
    ZeroSeqLen {
        /// The dataset's name.
        name: String,
    },
    /// A dataset too short to hold a single window of `seq_len + 1` tokens.
    #[error(
        "dataset {name} has {len} tokens, but a window of seq_len {seq_len} needs at least {need} \
         (seq_len + 1 for the shifted targets)"
    )]
    TooShort {
        /// The dataset's name.
        name: String,
        /// Its length in tokens.
        len: usize,
        /// The requested sequence length.
        seq_len: usize,
        /// Tokens needed: `seq_len + 1`.
        need: usize,
    },
    /// A window start that does not leave room for `seq_len + 1` tokens.
    #[error(
        "dataset {name}: window start {start} with seq_len {seq_len} runs past the end of its \
         {len} tokens (needs start + seq_len + 1 <= len)"
    )]
    WindowOutOfRange {
        /// The dataset's name.
        name: String,
        /// The requested start.
        start: usize,
        /// The requested sequence length.
        seq_len: usize,
        /// The dataset's length in tokens.
        len: usize,
    },
    /// A request for a batch with no rows.
    #[error("dataset {name}: a batch needs at least one row, got rows {start}..{end}")]
    EmptyBatch {
        /// The dataset's name.
        name: String,
        /// First requested row.
        start: u64,
        /// One past the last requested row.
        end: u64,
    },
    /// A file could not be written.
    #[error("cannot write {}: {error}", path.display())]
    Write {
        /// The file that could not be written.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// A token shard (llm.c format) whose header or size is wrong.
    #[error("invalid token shard {}: {reason}", path.display())]
    BadShard {
        /// The shard file.
        path: PathBuf,
        /// What is wrong, naming the values found and expected.
        reason: String,
    },
    /// A folder without any `.bin` token shard.
    #[error(
        "folder {} has no .bin token shards (llm.c format: a header of 256 little-endian i32, \
         then u16 tokens)",
        dir.display()
    )]
    NoShards {
        /// The folder.
        dir: PathBuf,
    },
    /// A folder whose shards are all validation shards.
    #[error(
        "folder {} has only validation shards ({count} with `val` in the name); training needs \
         at least one other .bin shard",
        dir.display()
    )]
    NoTrainShards {
        /// The folder.
        dir: PathBuf,
        /// Number of validation shards found.
        count: usize,
    },
    /// A JSONL line that is not a JSON object with a string `text` field.
    #[error("{}, line {line}: {reason}", path.display())]
    Jsonl {
        /// The JSONL file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// Text that could not be turned into tokens (not UTF-8, or the tokenizer failed).
    #[error("dataset {name}: {message}")]
    Text {
        /// The dataset (file) name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// A read of tokens past the end of a dataset.
    #[error(
        "dataset {name}: reading {count} tokens at {start} runs past the end of its {len} tokens"
    )]
    ReadOutOfRange {
        /// The dataset's name.
        name: String,
        /// First token requested.
        start: usize,
        /// Number of tokens requested.
        count: usize,
        /// The dataset's length.
        len: usize,
    },
}

/// Result type of this module.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// A batch of training or evaluation windows, row-major `[rows, seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input ids, `rows * seq_len` of them; row `r` is `inputs[r * seq_len..(r + 1) * seq_len]`.
    pub inputs: Vec<u32>,
    /// Target ids, the inputs shifted left by one token within the corpus.
    pub targets: Vec<u32>,
    /// Number of rows (sequences).
    pub rows: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

impl Batch {
    /// The inputs and targets of row `r`, or `None` when `r >= rows`.
    pub fn row(&self, r: usize) -> Option<(&[u32], &[u32])> {
        if r >= self.rows {
            return None;
        }
        let span = r * self.seq_len..(r + 1) * self.seq_len;
        Some((&self.inputs[span.clone()], &self.targets[span]))
    }
}

/// Domain tag mixed into the sampler's key so that its stream differs from other users of the same
/// seed (dropout masks, weight initialisation). It is the ASCII bytes of `"mg-data\0"`.
pub const SAMPLER_DOMAIN: u64 = 0x6d67_2d64_6174_6100;

/// One SplitMix64 step: adds the golden-ratio increment to `x` and applies the SplitMix64
/// finaliser. A bijection on `u64` with strong avalanche.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sampler's counter-based hash of `(seed, step, row)`.
///
/// Defined as
///
/// ```text
/// h = splitmix64(seed ^ SAMPLER_DOMAIN)
/// h = splitmix64(h ^ step)
/// h = splitmix64(h ^ row)
/// ```
///
/// Each stage is a bijection of its input, so for a fixed `(seed, step)` distinct rows give
/// distinct hashes, and nothing depends on how many rows were drawn before or by whom.
pub fn window_hash(seed: u64, step: u64, row: u64) -> u64 {
    let h = splitmix64(seed ^ SAMPLER_DOMAIN);
    let h = splitmix64(h ^ step);
    splitmix64(h ^ row)
}

/// Maps a 64-bit hash uniformly onto `0..n` by taking the high 64 bits of `hash * n`
/// (Lemire's multiply-shift). The bias is at most `n / 2^64`.
fn reduce(hash: u64, n: usize) -> usize {
    // n <= usize::MAX <= u64::MAX on all supported targets; the result is < n.
    ((u128::from(hash) * n as u128) >> 64) as usize
}

/// Number of window starts of a stream of `len` tokens (`len - seq_len`), or why there is none.
fn window_starts(name: &str, len: usize, seq_len: usize) -> Result<usize> {
    if seq_len == 0 {
        return Err(DataError::ZeroSeqLen {
            name: name.to_string(),
        });
    }
    let need = seq_len.saturating_add(1);
    if len < need {
        return Err(DataError::TooShort {
            name: name.to_string(),
            len,
            seq_len,
            need,
        });
    }
    Ok(len - seq_len)
}

/// The lengths of the train (head) and validation (tail) parts of a contiguous split of `len`
/// tokens: the validation part has `round(len * val_fraction)` tokens. Errors as
/// [`TokenDataset::split`] does.
fn split_lengths(
    name: &str,
    len: usize,
    val_fraction: f64,
    min_len: usize,
) -> Result<(usize, usize)> {
    if !(val_fraction > 0.0 && val_fraction < 1.0) {
        return Err(DataError::BadValFraction {
            name: name.to_string(),
            val_fraction,
        });
    }
    // 0 < val_fraction < 1, so the product is in [0, len] and the cast cannot overflow.
    let val = (((len as f64) * val_fraction).round() as usize).min(len);
    let train = len - val;
    if train < min_len.max(1) || val < min_len.max(1) {
        return Err(DataError::SplitTooShort {
            name: name.to_string(),
            len,
            val_fraction,
            train,
            val,
            min_len: min_len.max(1),
        });
    }
    Ok((train, val))
}

/// A stream of token ids that the sampler can read: in memory ([`TokenDataset`]) or in
/// memory-mapped shards ([`ShardedDataset`]).
///
/// Implementors give [`TokenSource::read`]; the sampler (windows, batches, evaluation windows) is
/// written once on top of it, so equal token streams give equal batches whatever holds them.
pub trait TokenSource: Send + Sync {
    /// Where the tokens come from, for messages (a path, with ` [train]` / ` [val]` for a part).
    fn source(&self) -> &str;

    /// Number of tokens.
    fn len(&self) -> usize;

    /// Whether there are no tokens.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every id is below this.
    fn vocab_size(&self) -> usize;

    /// Copies tokens `start..start + out.len()` into `out`.
    ///
    /// Errors if the range runs past the end, or (for shards, checked as they are read) if an id is
    /// not below [`TokenSource::vocab_size`], naming the file and the position in it.
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()>;

    /// Checks that at least one window of `seq_len` inputs plus one target fits, and returns the
    /// number of valid window starts, `len - seq_len`.
    fn num_window_starts(&self, seq_len: usize) -> Result<usize> {
        window_starts(self.source(), self.len(), seq_len)
    }

    /// Start of the training window of global batch row `row` at step `step`:
    /// `reduce(window_hash(seed, step, row), len - seq_len)`, where `reduce(h, n)` is the high 64
    /// bits of the 128-bit product `h * n`; uniform over every start that leaves room for
    /// `seq_len + 1` tokens, and a function of nothing but `(seed, step, row)` and the length.
    fn window_start(&self, seed: u64, step: u64, row: u64, seq_len: usize) -> Result<usize> {
        let starts = self.num_window_starts(seq_len)?;
        Ok(reduce(window_hash(seed, step, row), starts))
    }

    /// The training batch made of global rows `rows` at step `step`: row `i` is the window of
    /// global row `rows.start + i` ([`TokenSource::window_start`]), so `batch(.., 0..8, ..)` equals
    /// `batch(.., 0..4, ..)` followed by `batch(.., 4..8, ..)`.
    fn batch(&self, seed: u64, step: u64, rows: Range<u64>, seq_len: usize) -> Result<Batch> {
        if rows.is_empty() {
            return Err(DataError::EmptyBatch {
                name: self.source().to_string(),
                start: rows.start,
                end: rows.end,
            });
        }
        let starts = self.num_window_starts(seq_len)?;
        let picks: Vec<usize> = rows
            .map(|row| reduce(window_hash(seed, step, row), starts))
            .collect();
        self.batch_at(&picks, seq_len)
    }

    /// A batch of the windows starting at `starts`, one row each, in order: inputs
    /// `tokens[s..s + seq_len]`, targets `tokens[s + 1..s + seq_len + 1]`.
    fn batch_at(&self, starts: &[usize], seq_len: usize) -> Result<Batch> {
        if starts.is_empty() {
            return Err(DataError::EmptyBatch {
                name: self.source().to_string(),
                start: 0,
                end: 0,
            });
        }
        let n = self.num_window_starts(seq_len)?;
        let mut inputs = Vec::with_capacity(starts.len() * seq_len);
        let mut targets = Vec::with_capacity(starts.len() * seq_len);
        let mut window = vec![0u32; seq_len + 1];
        for &start in starts {
            if start >= n {
                return Err(DataError::WindowOutOfRange {
                    name: self.source().to_string(),
                    start,
                    seq_len,
                    len: self.len(),
                });
            }
            self.read(start, &mut window)?;
            inputs.extend_from_slice(&window[..seq_len]);
            targets.extend_from_slice(&window[1..]);
        }
        Ok(Batch {
            inputs,
            targets,
            rows: starts.len(),
            seq_len,
        })
    }

    /// Number of evaluation windows of length `seq_len`: `(len - 1) / seq_len`, at least 1.
    fn num_eval_windows(&self, seq_len: usize) -> Result<usize> {
        self.num_window_starts(seq_len)?;
        Ok((self.len() - 1) / seq_len)
    }

    /// Starts of the evaluation windows: `0, T, 2T, ...` while `start + T + 1 <= len`, with
    /// `T = seq_len` (see [`TokenDataset::eval_windows`]).
    fn eval_windows(&self, seq_len: usize) -> Result<StepBy<Range<usize>>> {
        let count = self.num_eval_windows(seq_len)?;
        Ok((0..count * seq_len).step_by(seq_len))
    }
}

impl TokenSource for TokenDataset {
    fn source(&self) -> &str {
        &self.source
    }
    fn len(&self) -> usize {
        self.tokens.len()
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let end = start
            .checked_add(out.len())
            .filter(|&e| e <= self.tokens.len());
        match end {
            Some(end) => {
                out.copy_from_slice(&self.tokens[start..end]);
                Ok(())
            }
            None => Err(DataError::ReadOutOfRange {
                name: self.source.clone(),
                start,
                count: out.len(),
                len: self.tokens.len(),
            }),
        }
    }
}

/// A token stream of either kind.
#[derive(Clone, Debug)]
pub enum Dataset {
    /// Tokens in memory.
    Memory(TokenDataset),
    /// Memory-mapped token shards.
    Shards(ShardedDataset),
}

impl From<TokenDataset> for Dataset {
    fn from(d: TokenDataset) -> Self {
        Dataset::Memory(d)
    }
}

impl From<ShardedDataset> for Dataset {
    fn from(d: ShardedDataset) -> Self {
        Dataset::Shards(d)
    }
}

impl Dataset {
    /// The dataset as a [`TokenSource`].
    pub fn as_source(&self) -> &dyn TokenSource {
        match self {
            Dataset::Memory(d) => d,
            Dataset::Shards(d) => d,
        }
    }

    /// Splits into a train part (the head) and a validation part (the last
    /// `round(len * val_fraction)` tokens), contiguously; see [`TokenDataset::split`].
    pub fn split(&self, val_fraction: f64, min_len: usize) -> Result<(Dataset, Dataset)> {
        Ok(match self {
            Dataset::Memory(d) => {
                let (a, b) = d.split(val_fraction, min_len)?;
                (a.into(), b.into())
            }
            Dataset::Shards(d) => {
                let (a, b) = d.split(val_fraction, min_len)?;
                (a.into(), b.into())
            }
        })
    }
}

impl TokenSource for Dataset {
    fn source(&self) -> &str {
        self.as_source().source()
    }
    fn len(&self) -> usize {
        self.as_source().len()
    }
    fn vocab_size(&self) -> usize {
        self.as_source().vocab_size()
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        self.as_source().read(start, out)
    }
}

/// What a data path holds, as [`DataFormat::of`] tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataFormat {
    /// A text file: bytes, or text through a tokenizer.
    Text,
    /// A `.jsonl` file: one JSON object with a string `text` field per line.
    Jsonl,
    /// A nanoGPT-style `.bin` file: little-endian `u16` ids, no header.
    U16Bin,
    /// One llm.c token shard: a `.bin` file that starts with the shard magic number.
    Shard,
    /// A folder of llm.c token shards.
    ShardFolder,
}

impl DataFormat {
    /// The format of `path`: a folder is a [`DataFormat::ShardFolder`]; a `.jsonl` file (any case)
    /// is [`DataFormat::Jsonl`]; a `.bin` file is a [`DataFormat::Shard`] when its first four bytes
    /// are the shard magic number 20240520 (little-endian i32) and [`DataFormat::U16Bin`]
    /// otherwise; anything else is [`DataFormat::Text`].
    ///
    /// Errors ([`DataError::Io`]) if the path does not exist or a `.bin` file cannot be read.
    pub fn of(path: &Path) -> Result<DataFormat> {
        let io = |error| DataError::Io {
            path: path.to_path_buf(),
            error,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.is_dir() {
            return Ok(DataFormat::ShardFolder);
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext.eq_ignore_ascii_case("jsonl") {
            return Ok(DataFormat::Jsonl);
        }
        if ext.eq_ignore_ascii_case("bin") {
            use std::io::Read;
            let mut head = [0u8; 4];
            let mut file = std::fs::File::open(path).map_err(io)?;
            let mut got = 0;
            while got < 4 {
                match file.read(&mut head[got..]).map_err(io)? {
                    0 => break,
                    n => got += n,
                }
            }
            return Ok(if got == 4 && i32::from_le_bytes(head) == SHARD_MAGIC {
                DataFormat::Shard
            } else {
                DataFormat::U16Bin
            });
        }
        Ok(DataFormat::Text)
    }
}

/// How [`load_dataset`] and [`load_split`] turn files into tokens.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions<'a> {
    /// Text (text files, JSONL) goes through this tokenizer; `None` means byte-level (one token
    /// per UTF-8 byte, vocabulary 256).
    pub tokenizer: Option<&'a Tokenizer>,
    /// The vocabulary size of token shards (a shard header does not record it): every id read from
    /// a shard is checked against it.
    pub shard_vocab_size: usize,
}

impl Default for LoadOptions<'_> {
    /// Byte-level text, and shards of up to 65536 ids (any `u16`).
    fn default() -> Self {
        LoadOptions {
            tokenizer: None,
            shard_vocab_size: 1 << 16,
        }
    }
}

/// Loads the data at `path`, whatever its [`DataFormat`]. A folder of shards gives its validation
/// shards when it has any (for evaluation), and all its shards otherwise.
pub fn load_dataset(path: &Path, opts: &LoadOptions<'_>) -> Result<Dataset> {
    Ok(match DataFormat::of(path)? {
        DataFormat::Text => TokenDataset::from_text_file_with(path, opts.tokenizer)?.into(),
        DataFormat::Jsonl => TokenDataset::from_jsonl(path, opts.tokenizer)?.into(),
        DataFormat::U16Bin => TokenDataset::from_bin(path)?.into(),
        DataFormat::Shard => {
            ShardedDataset::open(&[path.to_path_buf()], opts.shard_vocab_size, display(path))?
                .into()
        }
        DataFormat::ShardFolder => {
            let folder = ShardFolder::open(path, opts.shard_vocab_size)?;
            match folder.val {
                Some(val) => val.into(),
                None => folder.train.into(),
            }
        }
    })
}

/// Train and validation data.
#[derive(Clone, Debug)]
pub struct DataSplit {
    /// The training part.
    pub train: Dataset,
    /// The validation part.
    pub val: Dataset,
    /// Where the data came from.
    pub source: String,
    /// How the validation part was chosen, e.g. `"last 10% of the tokens"` or
    /// `"1 validation shard"`.
    pub validation: String,
}

/// Loads the data at `path` ([`load_dataset`]) and splits it into train and validation parts.
///
/// A folder of shards with validation shards (`val` in the file name, see
/// [`is_validation_shard`]) uses them as the validation part and the other shards as the train
/// part. Anything else holds out its last `round(len * val_fraction)` tokens for validation
/// ([`Dataset::split`]). Errors if either part has fewer than `min_len` tokens (pass
/// `seq_len + 1`).
pub fn load_split(
    path: &Path,
    opts: &LoadOptions<'_>,
    val_fraction: f64,
    min_len: usize,
) -> Result<DataSplit> {
    if DataFormat::of(path)? == DataFormat::ShardFolder {
        let folder = ShardFolder::open(path, opts.shard_vocab_size)?;
        if let Some(val) = folder.val {
            let need = min_len.max(1);
            for part in [&folder.train, &val] {
                if part.len() < need {
                    return Err(DataError::TooShort {
                        name: part.source().to_string(),
                        len: part.len(),
                        seq_len: need - 1,
                        need,
                    });
                }
            }
            let n = val.shards().len();
            return Ok(DataSplit {
                validation: format!("{n} validation shard{}", if n == 1 { "" } else { "s" }),
                train: folder.train.into(),
                val: val.into(),
                source: display(path),
            });
        }
        return split_dataset(folder.train.into(), display(path), val_fraction, min_len);
    }
    let data = load_dataset(path, opts)?;
    split_dataset(data, display(path), val_fraction, min_len)
}

/// Splits `data` by [`Dataset::split`] into a [`DataSplit`].
pub fn split_dataset(
    data: Dataset,
    source: String,
    val_fraction: f64,
    min_len: usize,
) -> Result<DataSplit> {
    let (train, val) = data.split(val_fraction, min_len)?;
    Ok(DataSplit {
        train,
        val,
        source,
        // Rounded so that 0.1 prints as 10, not 10.000000000000002.
        validation: format!(
            "last {}% of the tokens",
            (val_fraction * 100.0 * 1e6).round() / 1e6
        ),
    })
}

fn display(path: &Path) -> String {
    path.display().to_string()
}
