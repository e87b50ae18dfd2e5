//! [`Checkpoint`]: an opened checkpoint directory, its index checked.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use meshgrad_tensor::{Error, Result};

use super::dir::latest;
use super::format::{Index, TensorEntry, FORMAT, INDEX_FILE, VERSION};
use super::reader::RankFile;

/// A complete checkpoint, opened for reading. Opening reads and checks `index.json` (every
/// tensor's pieces cover it exactly once); tensor data is read on demand, one tensor (or one
/// rank's part of one) at a time, from the rank files that hold its pieces.
pub struct Checkpoint {
    pub(crate) dir: PathBuf,
    pub(crate) index: Index,
    by_name: HashMap<String, usize>,
    files: Mutex<HashMap<String, Arc<RankFile>>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Checkpoint({}, {} tensors, saved by {} ranks)",
            self.dir.display(),
            self.index.tensors.len(),
            self.index.world_size
        )
    }
}

/// Whether `name` is a rank file name this crate writes (`rank-00003.safetensors`).
fn is_rank_file(name: &str) -> bool {
    name.strip_prefix("rank-")
        .and_then(|s| s.strip_suffix(".safetensors"))
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

impl Checkpoint {
    /// Opens the checkpoint at `path`: a checkpoint directory (holding `index.json`), or a run
    /// directory, whose [`latest`] complete checkpoint is opened. Errors are one line naming the
    /// path (and the tensor, for an index whose pieces do not cover a tensor).
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        let dir = if path.join(INDEX_FILE).is_file() {
            path.to_path_buf()
        } else {
            match latest(path)? {
                Some(p) => p,
                None => meshgrad_tensor::bail!(
                    "{} is not a checkpoint (no {INDEX_FILE}) and holds no complete checkpoint",
                    path.display()
                ),
            }
        };
        let index_path = dir.join(INDEX_FILE);
        let bad = |why: String| Error::msg(format!("checkpoint {}: {why}", index_path.display()));
        let bytes = std::fs::read(&index_path).map_err(|e| bad(format!("cannot read: {e}")))?;
        let index: Index =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a valid index: {e}")))?;
        if index.format != FORMAT || index.version != VERSION {
            return Err(bad(format!(
                "format {} version {}, but this build reads {FORMAT} version {VERSION}",
                index.format, index.version
            )));
        }
        let mut by_name = HashMap::with_capacity(index.tensors.len());
        for (i, t) in index.tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(bad(format!("tensor {} is listed twice", t.name)));
            }
            t.check_coverage()
                .map_err(|e| bad(format!("tensor {}: {e}", t.name)))?;
            if let Some(p) = t.pieces.iter().find(|p| !is_rank_file(&p.file)) {
                return Err(bad(format!(
                    "tensor {}: piece file {:?} is not a rank file",
                    t.name, p.file
                )));
            }
        }
        let ck = Checkpoint {
            dir,
            index,
            by_name,
            files: Mutex::new(HashMap::new()),
        };
        ck.check_pieces_in_files()?;
        Ok(ck)
    }

    /// Checks every piece the index lists against its rank file's header (the key exists, with
    /// the dtype and element count the index says), before any tensor is allocated at a size
    /// the index claims: a damaged or hand-edited index cannot make a load allocate more than
    /// the files hold. Reads the headers only.
    fn check_pieces_in_files(&self) -> Result<()> {
        for t in &self.index.tensors {
            let dtype = t.dtype()?;
            let local_numel: usize = match t.split_scheme() {
                Some(s) => s.local_dims(&t.shape).iter().product(),
                None => t.numel(),
            };
            for p in &t.pieces {
                let n = p.range.map_or(local_numel, |[a, b]| b - a);
                self.rank_file(&p.file)?
                    .entry(&p.key, dtype, n)
                    .map_err(|e| self.err(format!("tensor {}: {e}", t.name)))?;
            }
        }
        Ok(())
    }

    /// The checkpoint directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The checkpoint's name (`step-000140`).
    pub fn name(&self) -> &str {
        &self.index.name
    }

    /// The caller's metadata recorded by the save ([`super::SaveOptions::metadata`]).
    pub fn metadata(&self) -> &serde_json::Value {
        &self.index.metadata
    }

    /// The whole index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Every tensor's entry, in index order.
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.index.tensors
    }

    /// The entry of tensor `name`, if the checkpoint has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name).map(|&i| &self.index.tensors[i])
    }

    /// The entry of tensor `name`, or a one-line error naming it and the checkpoint.
    pub(crate) fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensor(name)
            .ok_or_else(|| self.err(format!("has no tensor {name}")))
    }

    /// An extra file saved with the checkpoint ([`super::SaveOptions::files`]).
    pub fn read_file(&self, name: &str) -> Result<Vec<u8>> {
        if !self.index.files.iter().any(|f| f == name) {
            return Err(self.err(format!("has no extra file {name}")));
        }
        let p = self.dir.join(name);
        std::fs::read(&p).map_err(|e| Error::msg(format!("checkpoint file {}: {e}", p.display())))
    }

    /// A one-line error about this checkpoint.
    pub(crate) fn err(&self, why: String) -> Error {
        Error::msg(format!("checkpoint {}: {why}", self.dir.display()))
    }

    /// The rank file `file`, opened once.
    pub(crate) fn rank_file(&self, file: &str) -> Result<Arc<RankFile>> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = files.get(file) {
            return Ok(f.clone());
        }
        let f = Arc::new(RankFile::open(&self.dir.join(file))?);
        files.insert(file.to_string(), f.clone());
        Ok(f)
    }
}
