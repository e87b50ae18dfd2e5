//! In-memory token datasets: [`TokenDataset`], a flat `Vec<u32>` of token ids.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use super::{reduce, window_hash, Batch, DataError, Result};

/// A flat sequence of token ids with its vocabulary size and a human-readable origin.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenDataset {
    /// The token ids, in corpus order. Every id is `< vocab_size` when built by this module's
    /// constructors.
    pub tokens: Vec<u32>,
    /// Number of distinct ids the model must support (`max id + 1` at least).
    pub vocab_size: usize,
    /// Where the tokens came from (a file path, `"<builtin corpus>"`, `"... [train]"`); used in
    /// error messages.
    pub source: String,
}

impl fmt::Debug for TokenDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The token vector can be millions long: show its length, not its contents.
        f.debug_struct("TokenDataset")
            .field("source", &self.source)
            .field("len", &self.tokens.len())
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl TokenDataset {
    /// Builds a dataset from token ids, checking that every id is `< vocab_size`.
    ///
    /// `source` names the data in error messages.
    pub fn from_tokens(
        source: impl Into<String>,
        tokens: Vec<u32>,
        vocab_size: usize,
    ) -> Result<Self> {
        let dataset = TokenDataset {
            tokens,
            vocab_size,
            source: source.into(),
        };
        dataset.check_vocab(vocab_size)?;
        Ok(dataset)
    }

    /// Byte-level tokens from memory: each byte is one token, `vocab_size` is 256.
    ///
    /// `name` names the data in error messages (for the built-in corpus, e.g. `"<builtin corpus>"`).
    /// An empty slice gives an empty dataset; sampling from it fails with [`DataError::TooShort`].
    pub fn from_bytes(name: impl Into<String>, bytes: &[u8]) -> Self {
        TokenDataset {
            tokens: bytes.iter().map(|&b| u32::from(b)).collect(),
            vocab_size: 256,
            source: name.into(),
        }
    }

    /// Reads a nanoGPT-style token file: a flat array of little-endian `u16` token ids.
    ///
    /// `vocab_size` is set to `1 + max id`; raise it with [`TokenDataset::with_vocab_size`] when the
    /// tokenizer's vocabulary is known (e.g. 50257 for GPT-2).
    ///
    /// Errors: [`DataError::Io`] if the file is missing or unreadable (naming the path and the OS
    /// error), [`DataError::OddLength`] if its length is odd, [`DataError::EmptyFile`] if it is
    /// empty.
    pub fn from_bin(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = read_file(path)?;
        if bytes.is_empty() {
            return Err(DataError::EmptyFile {
                path: path.to_path_buf(),
            });
        }
        if bytes.len() % 2 != 0 {
            return Err(DataError::OddLength {
                path: path.to_path_buf(),
                len: bytes.len() as u64,
            });
        }
        let tokens: Vec<u32> = bytes
            .chunks_exact(2)
            .map(|pair| u32::from(u16::from_le_bytes([pair[0], pair[1]])))
            .collect();
        let max = tokens.iter().copied().max().unwrap_or(0);
        Ok(TokenDataset {
            tokens,
            vocab_size: max as usize + 1,
            source: path.display().to_string(),
        })
    }

    /// Reads a text file as byte-level tokens: each byte is one token, `vocab_size` is 256.
    ///
    /// The file is meant to be UTF-8 text, but it is not decoded or validated: any bytes work, and
    /// a multi-byte UTF-8 character becomes several tokens.
    ///
    /// Errors: [`DataError::Io`] if the file is missing or unreadable, [`DataError::EmptyFile`] if it
    /// is empty.
    pub fn from_text_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = read_file(path)?;
        if bytes.is_empty() {
            return Err(DataError::EmptyFile {
                path: path.to_path_buf(),
            });
        }
        Ok(TokenDataset::from_bytes(path.display().to_string(), &bytes))
    }

    /// Loads a file by its extension: `.bin` (any case) as `u16` token ids
    /// ([`TokenDataset::from_bin`]), anything else as byte-level text
    /// ([`TokenDataset::from_text_file`]).
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let is_bin = path
            .extension()
            .is_some_and(|ext| ext.eq_ignore_ascii_case("bin"));
        if is_bin {
            TokenDataset::from_bin(path)
        } else {
            TokenDataset::from_text_file(path)
        }
    }

    /// Sets the vocabulary size, checking that every token id is below it.
    ///
    /// Use it to declare a tokenizer's full vocabulary, which can exceed `1 + max id` of a file.
    pub fn with_vocab_size(mut self, vocab_size: usize) -> Result<Self> {
        self.check_vocab(vocab_size)?;
        self.vocab_size = vocab_size;
        Ok(self)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the dataset has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Splits into a train part (the head) and a validation part (the tail), contiguously.
    ///
    /// The validation part has `round(len * val_fraction)` tokens and the train part the rest; both
    /// keep this dataset's `vocab_size`, and their sources get ` [train]` / ` [val]` appended.
    /// Errors if `val_fraction` is not in (0, 1), or if either part has fewer than `min_len` tokens
    /// (pass `seq_len + 1` to make sure each part holds at least one window).
    pub fn split(&self, val_fraction: f64, min_len: usize) -> Result<(TokenDataset, TokenDataset)> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(DataError::BadValFraction {
                name: self.source.clone(),
                val_fraction,
            });
        }
        let len = self.tokens.len();
        // 0 < val_fraction < 1, so the product is in [0, len] and the cast cannot overflow.
        let val = ((len as f64) * val_fraction).round() as usize;
        let val = val.min(len);
        let train = len - val;
        if train < min_len.max(1) || val < min_len.max(1) {
            return Err(DataError::SplitTooShort {
                name: self.source.clone(),
                len,
                val_fraction,
                train,
                val,
                min_len: min_len.max(1),
            });
        }
        let part = |range: Range<usize>, tag: &str| TokenDataset {
            tokens: self.tokens[range].to_vec(),
            vocab_size: self.vocab_size,
            source: format!("{} [{tag}]", self.source),
        };
        Ok((part(0..train, "train"), part(train..len, "val")))
    }

    /// Checks that at least one window of `seq_len` inputs plus one target fits, and returns the
    /// number of valid window starts, `len - seq_len`.
    pub fn num_window_starts(&self, seq_len: usize) -> Result<usize> {
        super::window_starts(&self.source, self.tokens.len(), seq_len)
    }

    /// Start of the training window of global batch row `row` at step `step`.
    ///
    /// It is `reduce(window_hash(seed, step, row), len - seq_len)`, where `reduce(h, n)` is the high
    /// 64 bits of the 128-bit product `h * n`; so the start is uniform over `0..len - seq_len` (every
    /// start that leaves room for `seq_len + 1` tokens) and depends on nothing but
    /// `(seed, step, row)` and the dataset's length.
    ///
    /// Errors if `seq_len` is 0 or the dataset has fewer than `seq_len + 1` tokens.
    pub fn window_start(&self, seed: u64, step: u64, row: u64, seq_len: usize) -> Result<usize> {
        let starts = self.num_window_starts(seq_len)?;
        Ok(reduce(window_hash(seed, step, row), starts))
    }

    /// The inputs `tokens[start..start + seq_len]` and targets `tokens[start + 1..start + seq_len + 1]`
    /// of one window.
    pub fn window(&self, start: usize, seq_len: usize) -> Result<(&[u32], &[u32])> {
        let starts = self.num_window_starts(seq_len)?;
        if start >= starts {
            return Err(DataError::WindowOutOfRange {
                name: self.source.clone(),
                start,
                seq_len,
                len: self.tokens.len(),
            });
        }
        Ok((
            &self.tokens[start..start + seq_len],
            &self.tokens[start + 1..start + seq_len + 1],
        ))
    }

    /// The training batch made of global rows `rows` (e.g. `0..batch_size` on one device, or a
    /// rank's slice of the global batch) at step `step`.
    ///
    /// Row `i` of the result is the window of global row `rows.start + i`, placed by
    /// [`TokenDataset::window_start`]; so the rows of `batch(seed, step, 0..8, t)` equal those of
    /// `batch(seed, step, 0..4, t)` followed by `batch(seed, step, 4..8, t)`.
    ///
    /// Errors if the range is empty, `seq_len` is 0, or the dataset has fewer than `seq_len + 1`
    /// tokens.
    pub fn batch(&self, seed: u64, step: u64, rows: Range<u64>, seq_len: usize) -> Result<Batch> {
        if rows.is_empty() {
            return Err(DataError::EmptyBatch {
                name: self.source.clone(),
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

    /// A batch of the windows starting at `starts`, one row each, in order (for evaluation with
    /// [`TokenDataset::eval_windows`], or any explicit choice of windows).
    ///
    /// Errors if `starts` is empty or any start leaves no room for `seq_len + 1` tokens.
    pub fn batch_at(&self, starts: &[usize], seq_len: usize) -> Result<Batch> {
        if starts.is_empty() {
            return Err(DataError::EmptyBatch {
                name: self.source.clone(),
                start: 0,
                end: 0,
            });
        }
        self.num_window_starts(seq_len)?;
        let mut inputs = Vec::with_capacity(starts.len() * seq_len);
        let mut targets = Vec::with_capacity(starts.len() * seq_len);
        for &start in starts {
            let (x, y) = self.window(start, seq_len)?;
            inputs.extend_from_slice(x);
            targets.extend_from_slice(y);
        }
        Ok(Batch {
            inputs,
            targets,
            rows: starts.len(),
            seq_len,
        })
    }

    /// Number of evaluation windows of length `seq_len`: `(len - 1) / seq_len`, at least 1.
    ///
    /// Errors if `seq_len` is 0 or no window fits (fewer than `seq_len + 1` tokens).
    pub fn num_eval_windows(&self, seq_len: usize) -> Result<usize> {
        self.num_window_starts(seq_len)?;
        Ok((self.tokens.len() - 1) / seq_len)
    }

    /// Starts of the evaluation windows: `0, T, 2T, ...` while `start + T + 1 <= len`, with
    /// `T = seq_len`.
    ///
    /// Window `s` has inputs `tokens[s..s + T]` and targets `tokens[s + 1..s + T + 1]` (see
    /// [`TokenDataset::window`]). The windows do not overlap, and together they score every token
    /// but the first exactly once, except for a tail shorter than a window. For `len = k*T + 1`
    /// there are `k` windows; for `len = k*T` there are `k - 1`.
    ///
    /// Errors if `seq_len` is 0 or no window fits.
    pub fn eval_windows(&self, seq_len: usize) -> Result<impl ExactSizeIterator<Item = usize>> {
        let count = self.num_eval_windows(seq_len)?;
        Ok((0..count).map(move |i| i * seq_len))
    }

    fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        if vocab_size == 0 || vocab_size > u32::MAX as usize + 1 {
            return Err(DataError::BadVocabSize {
                name: self.source.clone(),
                vocab_size,
            });
        }
        if let Some((position, &id)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab_size)
        {
            return Err(DataError::TokenOutOfRange {
                name: self.source.clone(),
                id,
                position,
                vocab_size,
            });
        }
        Ok(())
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|error| DataError::Io {
        path: path.to_path_buf(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::splitmix64;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A file in the temp dir that is removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, contents: &[u8]) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!(
                "meshgrad-data-test-{}-{n}-{name}",
                std::process::id()
            ));
            std::fs::write(&path, contents).expect("write temp file");
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn counting(len: usize) -> TokenDataset {
        TokenDataset::from_tokens("counting", (0..len as u32).collect(), len.max(1)).unwrap()
    }

    #[test]
    fn bin_round_trip() {
        let ids: Vec<u16> = vec![0, 1, 513, 65535, 7, 300];
        let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        let file = TempFile::new("tokens.bin", &bytes);
        let ds = TokenDataset::from_bin(&file.0).unwrap();
        let expected: Vec<u32> = ids.iter().map(|&id| u32::from(id)).collect();
        assert_eq!(ds.tokens, expected);
        assert_eq!(ds.vocab_size, 65536);
        assert_eq!(ds.source, file.0.display().to_string());
        // from_path picks the u16 reader for .bin.
        assert_eq!(TokenDataset::from_path(&file.0).unwrap(), ds);
    }

    #[test]
    fn bin_vocab_is_max_plus_one_and_can_be_raised() {
        let bytes: Vec<u8> = [3u16, 9, 2]
            .iter()
            .flat_map(|id| id.to_le_bytes())
            .collect();
        let file = TempFile::new("small.BIN", &bytes);
        let ds = TokenDataset::from_path(&file.0).unwrap();
        assert_eq!(ds.vocab_size, 10);
        let ds = ds.with_vocab_size(50257).unwrap();
        assert_eq!(ds.vocab_size, 50257);
        let err = ds.with_vocab_size(9).unwrap_err().to_string();
        assert!(err.contains("token id 9"), "{err}");
        assert!(err.contains("vocab_size 9"), "{err}");
    }

    #[test]
    fn text_file_is_byte_level() {
        let text = "héllo\n";
        let file = TempFile::new("corpus.txt", text.as_bytes());
        let ds = TokenDataset::from_text_file(&file.0).unwrap();
        let expected: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(ds.tokens, expected);
        assert_eq!(ds.len(), 7); // 'é' is two bytes
        assert_eq!(ds.vocab_size, 256);
        assert_eq!(TokenDataset::from_path(&file.0).unwrap(), ds);
        // Invalid UTF-8 is accepted as bytes.
        let file = TempFile::new("raw.dat", &[0xff, 0x00, 0x80]);
        assert_eq!(
            TokenDataset::from_path(&file.0).unwrap().tokens,
            vec![255, 0, 128]
        );
    }

    #[test]
    fn from_bytes_builtin() {
        let ds = TokenDataset::from_bytes("<builtin corpus>", b"ab");
        assert_eq!(ds.tokens, vec![97, 98]);
        assert_eq!(ds.vocab_size, 256);
        assert_eq!(ds.source, "<builtin corpus>");
        assert!(format!("{ds:?}").contains("len: 2"));
    }

    #[test]
    fn odd_length_bin_is_an_error() {
        let file = TempFile::new("odd.bin", &[1, 0, 2]);
        let err = TokenDataset::from_bin(&file.0).unwrap_err();
        assert!(matches!(err, DataError::OddLength { len: 3, .. }));
        let msg = err.to_string();
        assert!(msg.contains(&file.0.display().to_string()), "{msg}");
        assert!(msg.contains("3 bytes"), "{msg}");
    }

    #[test]
    fn empty_files_are_errors() {
        let file = TempFile::new("empty.bin", &[]);
        let err = TokenDataset::from_bin(&file.0).unwrap_err();
        assert!(matches!(err, DataError::EmptyFile { .. }), "{err}");
        let file = TempFile::new("empty.txt", &[]);
        let err = TokenDataset::from_text_file(&file.0).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
    }

    #[test]
    fn missing_file_error_names_path() {
        let path = std::env::temp_dir().join("meshgrad-data-test-definitely-missing.bin");
        for result in [
            TokenDataset::from_bin(&path),
            TokenDataset::from_text_file(&path),
            TokenDataset::from_path(&path),
        ] {
            let err = result.unwrap_err();
            assert!(matches!(err, DataError::Io { .. }));
            let msg = err.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains("os error"), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn from_tokens_checks_vocab() {
        let err = TokenDataset::from_tokens("t", vec![1, 5], 5).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TokenOutOfRange {
                    id: 5,
                    position: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(TokenDataset::from_tokens("t", vec![], 0).is_err());
    }

    #[test]
    fn split_lengths() {
        let ds = counting(1000);
        let (train, val) = ds.split(0.1, 10).unwrap();
        assert_eq!(train.len(), 900);
        assert_eq!(val.len(), 100);
        assert_eq!(train.tokens[..], ds.tokens[..900]);
        assert_eq!(val.tokens[..], ds.tokens[900..]);
        assert_eq!(val.vocab_size, ds.vocab_size);
        assert!(train.source.ends_with("[train]"));
        assert!(val.source.ends_with("[val]"));

        let (train, val) = counting(10).split(0.25, 1).unwrap();
        assert_eq!((train.len(), val.len()), (7, 3)); // round(2.5) = 3
    }

    #[test]
    fn split_errors_name_lengths() {
        let err = counting(100).split(0.1, 20).unwrap_err().to_string();
        assert!(err.contains("90 train"), "{err}");
        assert!(err.contains("10 validation"), "{err}");
        assert!(err.contains("at least 20"), "{err}");
        assert!(err.contains("100 tokens"), "{err}");
        for bad in [0.0, 1.0, -0.5, 1.5, f64::NAN] {
            let err = counting(100).split(bad, 1).unwrap_err();
            assert!(matches!(err, DataError::BadValFraction { .. }), "{err}");
        }
        // A tiny fraction that rounds to zero validation tokens.
        assert!(counting(10).split(0.01, 0).is_err());
    }

    #[test]
    fn sampler_is_deterministic() {
        let ds = counting(10_000);
        let a = ds.batch(42, 7, 0..16, 32).unwrap();
        let b = ds.batch(42, 7, 0..16, 32).unwrap();
        assert_eq!(a, b);
        assert_eq!((a.rows, a.seq_len), (16, 32));
        assert_eq!(a.inputs.len(), 16 * 32);
        // Different step or seed gives different windows.
        assert_ne!(a, ds.batch(42, 8, 0..16, 32).unwrap());
        assert_ne!(a, ds.batch(43, 7, 0..16, 32).unwrap());
        // Rows differ from each other.
        let starts: std::collections::HashSet<usize> = (0..16)
            .map(|r| ds.window_start(42, 7, r, 32).unwrap())
            .collect();
        assert!(starts.len() > 12);
    }

    #[test]
    fn sampler_is_layout_invariant() {
        let ds = counting(5_000);
        for step in 0..5 {
            let whole = ds.batch(1234, step, 0..8, 16).unwrap();
            let lo = ds.batch(1234, step, 0..4, 16).unwrap();
            let hi = ds.batch(1234, step, 4..8, 16).unwrap();
            assert_eq!(whole.inputs, [lo.inputs, hi.inputs].concat());
            assert_eq!(whole.targets, [lo.targets, hi.targets].concat());
            // And row by row, through window_start.
            for r in 0..8u64 {
                let single = ds.batch(1234, step, r..r + 1, 16).unwrap();
                assert_eq!(single.row(0), whole.row(r as usize));
                let start = ds.window_start(1234, step, r, 16).unwrap();
                assert_eq!(single.inputs[0], ds.tokens[start]);
            }
        }
    }

    #[test]
    fn sampler_windows_stay_in_range_and_cover_it() {
        // 12 tokens, seq_len 4: valid starts are 0..=7.
        let ds = counting(12);
        let mut seen = [false; 8];
        for step in 0..200 {
            let b = ds.batch(9, step, 0..4, 4).unwrap();
            for r in 0..4 {
                let (x, y) = b.row(r).unwrap();
                let start = x[0] as usize;
                assert!(start + 4 < 12);
                seen[start] = true;
                assert_eq!(&x[1..], &y[..3]);
                assert_eq!(y[3], x[3] + 1);
            }
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
        // The smallest dataset that fits: exactly seq_len + 1 tokens, one possible window.
        let ds = counting(5);
        let b = ds.batch(0, 0, 0..3, 4).unwrap();
        assert_eq!(b.inputs, [0, 1, 2, 3].repeat(3));
        assert_eq!(b.targets, [1, 2, 3, 4].repeat(3));
    }

    #[test]
    fn sampler_errors() {
        let ds = counting(8);
        let err = ds.batch(0, 0, 0..2, 8).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TooShort {
                    len: 8,
                    seq_len: 8,
                    need: 9,
                    ..
                }
            ),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("8 tokens") && msg.contains("at least 9"),
            "{msg}"
        );
        assert!(ds.window_start(0, 0, 0, 100).is_err());
        assert!(matches!(
            ds.batch(0, 0, 3..3, 2),
            Err(DataError::EmptyBatch { .. })
        ));
        assert!(matches!(
            ds.batch(0, 0, 0..1, 0),
            Err(DataError::ZeroSeqLen { .. })
        ));
        assert!(matches!(
            ds.window(7, 1),
            Err(DataError::WindowOutOfRange { .. })
        ));
        assert!(ds.window(6, 1).is_ok());
        assert!(TokenDataset::from_bytes("e", b"")
            .batch(0, 0, 0..1, 1)
            .is_err());
    }

    #[test]
    fn hash_is_a_pure_function_of_its_key() {
        assert_eq!(window_hash(1, 2, 3), window_hash(1, 2, 3));
        let hs = [
            window_hash(1, 2, 3),
            window_hash(1, 3, 2),
            window_hash(2, 1, 3),
            window_hash(0, 0, 0),
            window_hash(1, 2, 4),
        ];
        for i in 0..hs.len() {
            for j in i + 1..hs.len() {
                assert_ne!(hs[i], hs[j]);
            }
        }
        // Pinned values: changing the sampler changes every training run, so do it on purpose.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn eval_windows_for_k_t_plus_one() {
        let t = 4;
        let ds = counting(3 * t + 1);
        let starts: Vec<usize> = ds.eval_windows(t).unwrap().collect();
        assert_eq!(starts, vec![0, 4, 8]);
        assert_eq!(ds.num_eval_windows(t).unwrap(), 3);
        // The last window reaches the very last token.
        let (x, y) = ds.window(8, t).unwrap();
        assert_eq!(x, &[8, 9, 10, 11]);
        assert_eq!(y, &[9, 10, 11, 12]);
        let batch = ds.batch_at(&starts, t).unwrap();
        assert_eq!(batch.rows, 3);
        for r in 0..3 {
            let (x, y) = batch.row(r).unwrap();
            let x_shifted: Vec<u32> = x.iter().map(|v| v + 1).collect();
            assert_eq!(y, &x_shifted[..]);
        }
    }

    #[test]
    fn eval_windows_for_k_t() {
        let t = 4;
        let ds = counting(3 * t);
        let starts: Vec<usize> = ds.eval_windows(t).unwrap().collect();
        assert_eq!(starts, vec![0, 4]);
        // One token short of a window: seq_len + 1 tokens are needed.
        let ds = counting(t);
        let err = ds.eval_windows(t).err().unwrap();
        assert!(matches!(
            err,
            DataError::TooShort {
                len: 4,
                need: 5,
                ..
            }
        ));
        let ds = counting(t + 1);
        assert_eq!(ds.eval_windows(t).unwrap().len(), 1);
    }
}
