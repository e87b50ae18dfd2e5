//! Pre-tokenized token shards in llm.c's format, memory-mapped.
//!
//! A shard is a `.bin` file: a header of [`SHARD_HEADER_INTS`] little-endian `i32`
//! ([`SHARD_HEADER_BYTES`] bytes) whose first three are the magic number [`SHARD_MAGIC`]
//! (20240520), the version [`SHARD_VERSION`] (1: `u16` tokens, GPT-2 style) and the token count
//! `n`; then `n` little-endian `u16` token ids. So the file is exactly `1024 + 2 n` bytes.
//! [`Shard::open`] checks all of this and maps the file; tokens are read from the mapping as the
//! sampler asks for them, so a dataset of any size costs no memory up front.
//!
//! A [`ShardedDataset`] is the concatenation of its shards in order, indexed globally: token `i`
//! of the dataset is token `i - start(k)` of the shard `k` that holds it, and a window can span
//! two shards. The sampler ([`super::TokenSource`]) therefore draws the same windows from shards
//! as from the same tokens in memory. Ids are checked against the dataset's vocabulary size (a
//! shard header does not record it) when the dataset is opened, in one pass over every shard,
//! and again as they are read; an id out of range is an error naming the shard file and the
//! position in it.
//!
//! A [`ShardFolder`] holds every `.bin` file of a folder, sorted by file name. As in llm.c, shards
//! with `val` in the file name (`fineweb_val_000000.bin`, `tiny_shakespeare_val.bin`; see
//! [`is_validation_shard`]) are the validation set and the others the training set.

use std::fmt;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::{split_lengths, DataError, Result, TokenSource};

/// The magic number that opens a shard header (llm.c's GPT-2 token shards).
pub const SHARD_MAGIC: i32 = 20240520;
/// The shard format version meshgrad reads: `u16` tokens.
pub const SHARD_VERSION: i32 = 1;
/// Number of `i32` in a shard header.
pub const SHARD_HEADER_INTS: usize = 256;
/// Bytes in a shard header.
pub const SHARD_HEADER_BYTES: usize = SHARD_HEADER_INTS * 4;

/// One memory-mapped, validated token shard.
pub struct Shard {
    path: PathBuf,
    map: Mmap,
    len: usize,
}

impl fmt::Debug for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shard")
            .field("path", &self.path)
            .field("len", &self.len)
            .finish()
    }
}

impl Shard {
    /// Opens and maps a shard, checking its header and size.
    ///
    /// Errors ([`DataError::BadShard`], naming the file and the values): shorter than the header,
    /// wrong magic number, wrong version, a negative token count, or a size other than
    /// `1024 + 2 * count` bytes; [`DataError::Io`] if it cannot be opened or mapped.
    pub fn open(path: impl AsRef<Path>) -> Result<Shard> {
        let path = path.as_ref();
        let io = |error| DataError::Io {
            path: path.to_path_buf(),
            error,
        };
        let bad = |reason: String| DataError::BadShard {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        if size < SHARD_HEADER_BYTES as u64 {
            return Err(bad(format!(
                "the file is {size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header"
            )));
        }
        // SAFETY: the mapping is read-only and private to this process. Like every memory-mapped
        // reader, it relies on nobody truncating or rewriting the file while it is open; shards
        // are written once and then only read.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        #[cfg(unix)]
        {
            // Training reads windows at random places: do not read ahead. Only a hint.
            let _ = map.advise(memmap2::Advice::Random);
        }
        let int = |i: usize| {
            i32::from_le_bytes([map[4 * i], map[4 * i + 1], map[4 * i + 2], map[4 * i + 3]])
        };
        let (magic, version, count) = (int(0), int(1), int(2));
        if magic != SHARD_MAGIC {
            return Err(bad(format!(
                "magic number is {magic}, expected {SHARD_MAGIC} (an llm.c token shard starts with \
                 256 little-endian i32: magic, version, token count)"
            )));
        }
        if version != SHARD_VERSION {
            return Err(bad(format!(
                "version is {version}, expected {SHARD_VERSION} (u16 tokens)"
            )));
        }
        if count < 0 {
            return Err(bad(format!(
                "the header's token count is negative ({count})"
            )));
        }
        let expected = SHARD_HEADER_BYTES as u64 + 2 * count as u64;
        if size != expected {
            return Err(bad(format!(
                "the header says {count} tokens, which makes {expected} bytes with the header, \
                 but the file is {size} bytes"
            )));
        }
        Ok(Shard {
            path: path.to_path_buf(),
            map,
            len: count as usize,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token `i` (`i < len`).
    pub fn token(&self, i: usize) -> u16 {
        let b = SHARD_HEADER_BYTES + 2 * i;
        u16::from_le_bytes([self.map[b], self.map[b + 1]])
    }

    /// The first token id at or above `limit`, with its position, if any: one pass over the
    /// mapped shard, in parallel chunks (a few GB/s).
    fn first_id_at_least(&self, limit: u32) -> Option<(usize, u16)> {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 20;
        #[cfg(unix)]
        let _ = self.map.advise(memmap2::Advice::Sequential);
        let tokens = &self.map[SHARD_HEADER_BYTES..SHARD_HEADER_BYTES + 2 * self.len];
        let found = tokens
            .par_chunks(2 * CHUNK)
            .enumerate()
            .find_map_first(|(c, bytes)| {
                bytes.chunks_exact(2).enumerate().find_map(|(i, pair)| {
                    let id = u16::from_le_bytes([pair[0], pair[1]]);
                    (u32::from(id) >= limit).then_some((c * CHUNK + i, id))
                })
            });
        #[cfg(unix)]
        let _ = self.map.advise(memmap2::Advice::Random);
        found
    }

    /// Copies tokens `start..start + out.len()` (in range) into `out`.
    fn read_into(&self, start: usize, out: &mut [u32]) {
        let bytes =
            &self.map[SHARD_HEADER_BYTES + 2 * start..SHARD_HEADER_BYTES + 2 * (start + out.len())];
        for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = u32::from(u16::from_le_bytes([pair[0], pair[1]]));
        }
    }
}

/// Writes `tokens` as an llm.c token shard (header: magic, version 1, count; then the tokens).
///
/// Errors if there are more than `i32::MAX` tokens ([`DataError::BadShard`]) or the file cannot
/// be written ([`DataError::Write`]).
pub fn write_shard(path: impl AsRef<Path>, tokens: &[u16]) -> Result<()> {
    let path = path.as_ref();
    let count = i32::try_from(tokens.len()).map_err(|_| DataError::BadShard {
        path: path.to_path_buf(),
        reason: format!("{} tokens do not fit the header's i32 count", tokens.len()),
    })?;
    let mut header = [0i32; SHARD_HEADER_INTS];
    header[0] = SHARD_MAGIC;
    header[1] = SHARD_VERSION;
    header[2] = count;
    let mut bytes = Vec::with_capacity(SHARD_HEADER_BYTES + 2 * tokens.len());
    bytes.extend(header.iter().flat_map(|v| v.to_le_bytes()));
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    let write = |error| DataError::Write {
        path: path.to_path_buf(),
        error,
    };
    let mut file = File::create(path).map_err(write)?;
    file.write_all(&bytes).map_err(write)?;
    file.flush().map_err(write)
}

/// Whether a shard file is a validation shard: its file name, split at `_`, `-` and `.`, has a
/// part equal to `val` (any case), as in llm.c's `fineweb_val_000000.bin`.
pub fn is_validation_shard(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        n.split(['_', '-', '.'])
            .any(|part| part.eq_ignore_ascii_case("val"))
    })
}

/// The concatenation of token shards (or a contiguous part of it), read through memory maps.
#[derive(Clone)]
pub struct ShardedDataset {
    shards: Arc<[Shard]>,
    /// `ends[k]`: tokens in shards `0..=k`.
    ends: Arc<[usize]>,
    /// The part of the concatenation this dataset is.
    range: Range<usize>,
    vocab_size: usize,
    source: String,
}

impl fmt::Debug for ShardedDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardedDataset")
            .field("source", &self.source)
            .field("shards", &self.shards.len())
            .field("range", &self.range)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl ShardedDataset {
    /// Opens the shards at `paths`, in this order, as one dataset whose ids must be below
    /// `vocab_size`; `source` names it in messages.
    pub fn open(paths: &[PathBuf], vocab_size: usize, source: impl Into<String>) -> Result<Self> {
        let shards = paths.iter().map(Shard::open).collect::<Result<Vec<_>>>()?;
        ShardedDataset::from_shards(shards, vocab_size, source)
    }

    /// A dataset over opened shards, in this order.
    pub fn from_shards(
        shards: Vec<Shard>,
        vocab_size: usize,
        source: impl Into<String>,
    ) -> Result<Self> {
        let source = source.into();
        if vocab_size == 0 || vocab_size > u32::MAX as usize + 1 {
            return Err(DataError::BadVocabSize {
                name: source,
                vocab_size,
            });
        }
        // Every id is checked once, here, before training starts: an id out of range is found
        // now, not at the step that happens to draw it. (u16 ids are all in range of a
        // vocabulary of 65,536 or more.)
        if vocab_size <= usize::from(u16::MAX) {
            for shard in &shards {
                if let Some((position, id)) = shard.first_id_at_least(vocab_size as u32) {
                    return Err(DataError::TokenOutOfRange {
                        name: shard.path().display().to_string(),
                        id: u32::from(id),
                        position,
                        vocab_size,
                    });
                }
            }
        }
        let mut total = 0usize;
        let ends: Vec<usize> = shards
            .iter()
            .map(|s| {
                total += s.len();
                total
            })
            .collect();
        Ok(ShardedDataset {
            shards: shards.into(),
            ends: ends.into(),
            range: 0..total,
            vocab_size,
            source,
        })
    }

    /// The shards (all of them, also when this dataset is a part of their concatenation).
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// The part of the shards' concatenation this dataset covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Splits into a train part (the head) and a validation part (the last
    /// `round(len * val_fraction)` tokens), as [`super::TokenDataset::split`] does; the parts
    /// share the mapped shards.
    pub fn split(&self, val_fraction: f64, min_len: usize) -> Result<(Self, Self)> {
        let (train, _) = split_lengths(&self.source, self.len(), val_fraction, min_len)?;
        let mid = self.range.start + train;
        let part = |range: Range<usize>, tag: &str| ShardedDataset {
            shards: self.shards.clone(),
            ends: self.ends.clone(),
            range,
            vocab_size: self.vocab_size,
            source: format!("{} [{tag}]", self.source),
        };
        Ok((
            part(self.range.start..mid, "train"),
            part(mid..self.range.end, "val"),
        ))
    }
}

impl TokenSource for ShardedDataset {
    fn source(&self) -> &str {
        &self.source
    }

    fn len(&self) -> usize {
        self.range.len()
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let len = self.range.len();
        if start.checked_add(out.len()).is_none_or(|end| end > len) {
            return Err(DataError::ReadOutOfRange {
                name: self.source.clone(),
                start,
                count: out.len(),
                len,
            });
        }
        let mut global = self.range.start + start;
        let mut done = 0;
        while done < out.len() {
            // The first shard that ends after `global` holds it (empty shards are skipped).
            let k = self.ends.partition_point(|&end| end <= global);
            let shard = &self.shards[k];
            let local = global - (self.ends[k] - shard.len());
            let take = (shard.len() - local).min(out.len() - done);
            let dst = &mut out[done..done + take];
            shard.read_into(local, dst);
            if let Some(i) = dst.iter().position(|&id| id as usize >= self.vocab_size) {
                return Err(DataError::TokenOutOfRange {
                    name: shard.path().display().to_string(),
                    id: dst[i],
                    position: local + i,
                    vocab_size: self.vocab_size,
                });
            }
            done += take;
            global += take;
        }
        Ok(())
    }
}

/// The shards of a folder, split into training and validation shards by file name.
#[derive(Clone, Debug)]
pub struct ShardFolder {
    /// The folder.
    pub dir: PathBuf,
    /// The shards without `val` in the name, in file-name order.
    pub train: ShardedDataset,
    /// The shards with `val` in the name ([`is_validation_shard`]), if there are any.
    pub val: Option<ShardedDataset>,
}

impl ShardFolder {
    /// Opens every `.bin` file (any case) directly in `dir`, sorted by file name, as shards whose
    /// ids must be below `vocab_size`. Other files and sub-folders are ignored.
    ///
    /// Errors: the folder cannot be read ([`DataError::Io`]); it has no `.bin` file
    /// ([`DataError::NoShards`]) or only validation shards ([`DataError::NoTrainShards`]); a shard
    /// is invalid ([`DataError::BadShard`], naming it).
    pub fn open(dir: impl AsRef<Path>, vocab_size: usize) -> Result<Self> {
        let dir = dir.as_ref();
        let io = |error| DataError::Io {
            path: dir.to_path_buf(),
            error,
        };
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            let is_bin = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
            if is_bin && path.is_file() {
                paths.push(path);
            }
        }
        paths.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
        if paths.is_empty() {
            return Err(DataError::NoShards {
                dir: dir.to_path_buf(),
            });
        }
        let (val, train): (Vec<PathBuf>, Vec<PathBuf>) =
            paths.into_iter().partition(|p| is_validation_shard(p));
        if train.is_empty() {
            return Err(DataError::NoTrainShards {
                dir: dir.to_path_buf(),
                count: val.len(),
            });
        }
        let name = |tag: &str, n: usize| {
            format!(
                "{} [{tag}: {n} shard{}]",
                dir.display(),
                if n == 1 { "" } else { "s" }
            )
        };
        let train_name = if val.is_empty() {
            dir.display().to_string()
        } else {
            name("train", train.len())
        };
        let train_set = ShardedDataset::open(&train, vocab_size, train_name)?;
        let val_set = if val.is_empty() {
            None
        } else {
            Some(ShardedDataset::open(
                &val,
                vocab_size,
                name("val", val.len()),
            )?)
        };
        Ok(ShardFolder {
            dir: dir.to_path_buf(),
            train: train_set,
            val: val_set,
        })
    }
}
