//! The on-disk index (`index.json`): what every tensor is and where its pieces are, and the
//! check that a tensor's pieces cover it exactly once.

use std::ops::Range;

use meshgrad_autograd::distributed::Placement;
use meshgrad_tensor::{DType, Result, Tensor};
use serde::{Deserialize, Serialize};

/// The `format` field of every index.
pub const FORMAT: &str = "meshgrad-distributed-checkpoint";
/// The format version this crate writes and reads.
pub const VERSION: u32 = 1;
/// The index's file name inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";

/// The file rank `rank` writes its pieces to: `rank-00003.safetensors`.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Where a piece's local tensor sits in the global tensor: a tensor-parallel split (the
/// [`Placement`] of the variable it was saved from, without its process group). The global
/// dimension `dim` is seen as `chunks` equal blocks, each cut into `degree` equal parts; the
/// local tensor of part `index` is its part of every block, concatenated along `dim`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Split {
    /// The split dimension.
    pub dim: usize,
    /// Equal blocks along `dim` (3 for a fused q/k/v projection).
    pub chunks: usize,
    /// Number of parts (the tensor-parallel degree).
    pub degree: usize,
    /// This part.
    pub index: usize,
    /// The mesh dimension the split ran along (`"tp"`); informational.
    #[serde(default)]
    pub mesh_dim: String,
}

impl Split {
    /// The split a placement describes, or `None` for a placement over one rank (the local
    /// tensor is the whole tensor).
    pub fn of(placement: &Placement) -> Option<Split> {
        (placement.degree() > 1).then(|| Split {
            dim: placement.dim,
            chunks: placement.chunks.max(1),
            degree: placement.degree(),
            index: placement.index(),
            mesh_dim: placement.mesh_dim.clone(),
        })
    }

    /// `(dim, chunks, degree)`: splits with the same scheme cut a tensor the same way.
    pub fn scheme(&self) -> (usize, usize, usize) {
        (self.dim, self.chunks, self.degree)
    }

    /// The same scheme, part `index`.
    pub fn with_index(&self, index: usize) -> Split {
        Split {
            index,
            ..self.clone()
        }
    }

    /// Checks the split against a global shape: `index < degree` and `global[dim]` divisible
    /// into `chunks * degree` parts.
    pub fn check(&self, global: &[usize]) -> std::result::Result<(), String> {
        if self.degree == 0 || self.chunks == 0 || self.index >= self.degree {
            return Err(format!(
                "split part {} of {} ({} chunk(s)) is not a valid part",
                self.index, self.degree, self.chunks
            ));
        }
        let Some(parts) = self.chunks.checked_mul(self.degree) else {
            return Err(format!(
                "{} chunk(s) x {} parts is not a valid split (the count overflows)",
                self.chunks, self.degree
            ));
        };
        match global.get(self.dim) {
            Some(&n) if n % parts == 0 => Ok(()),
            Some(&n) => Err(format!(
                "dimension {} of size {n} does not split into {} chunk(s) x {} parts",
                self.dim, self.chunks, self.degree
            )),
            None => Err(format!(
                "shape {global:?} has no dimension {} to split",
                self.dim
            )),
        }
    }

    /// The local shape of a tensor of global shape `global` (checked by [`Split::check`]).
    pub fn local_dims(&self, global: &[usize]) -> Vec<usize> {
        let mut d = global.to_vec();
        d[self.dim] /= self.degree;
        d
    }

    /// The ranges of the global dimension `dim` (of length `global_len`) this part holds, one
    /// per chunk, in the order they are concatenated in the local tensor.
    pub fn ranges(&self, global_len: usize) -> Vec<Range<usize>> {
        let block = global_len / self.chunks;
        let part = block / self.degree;
        (0..self.chunks)
            .map(|c| c * block + self.index * part..c * block + (self.index + 1) * part)
            .collect()
    }

    /// This part of the global tensor `full` (a contiguous copy).
    pub fn extract(&self, full: &Tensor) -> Result<Tensor> {
        let ranges = self.ranges(full.dims()[self.dim]);
        let parts: Vec<Tensor> = ranges
            .iter()
            .map(|r| full.narrow(self.dim as isize, r.start, r.len()))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, self.dim as isize)?.contiguous()
    }

    /// Copies the local tensor `local` of this part into its place in the global tensor `full`.
    pub fn place(&self, full: &Tensor, local: &Tensor) -> Result<()> {
        let ranges = self.ranges(full.dims()[self.dim]);
        let mut at = 0;
        for r in ranges {
            full.narrow(self.dim as isize, r.start, r.len())?
                .copy_from(&local.narrow(self.dim as isize, at, r.len())?)?;
            at += r.len();
        }
        Ok(())
    }
}

/// What an optimizer-state tensor holds (see `meshgrad_nn::optim::StateKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateRole {
    /// Shaped like its parameter, element for element (AdamW's moments): split like it.
    Elementwise,
    /// One value for a whole parameter (AdamW's per-parameter step count).
    PerParam,
    /// Optimizer-wide (the completed-step count).
    Global,
}

/// What a tensor of the checkpoint is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Role {
    /// A model parameter, named as the model names it.
    Parameter,
    /// Optimizer state, named `optim/<the optimizer's state-dict key>`.
    Optimizer {
        /// Its kind.
        state: StateRole,
        /// The parameter it belongs to (elementwise and per-parameter state).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        param: Option<String>,
    },
    /// Anything else the caller saves (loaders ignore it unless asked for it by name).
    Extra,
}

/// One piece of a tensor: a contiguous range of the flattened local tensor of one split part.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceEntry {
    /// The rank file holding it (`rank-00003.safetensors`).
    pub file: String,
    /// Its tensor's name inside that file.
    pub key: String,
    /// The split part whose local tensor it belongs to; `None`: the local tensor is the whole
    /// tensor.
    #[serde(default)]
    pub split: Option<Split>,
    /// The flat element range `[start, end)` of the local tensor it holds (ZeRO segments);
    /// `None`: all of it (the piece then has the local shape, else shape `[end - start]`).
    #[serde(default)]
    pub range: Option<[usize; 2]>,
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Its name: a parameter's model name, `optim/<key>` for optimizer state.
    pub name: String,
    /// Its dtype (`f32`, `bf16`, `i64`, ...).
    pub dtype: String,
    /// Its global shape.
    pub shape: Vec<usize>,
    /// What it is.
    pub role: Role,
    /// Its pieces, which cover it exactly once.
    pub pieces: Vec<PieceEntry>,
}

impl TensorEntry {
    /// The dtype, parsed.
    pub fn dtype(&self) -> Result<DType> {
        self.dtype.parse()
    }

    /// Number of elements of the global tensor (its shape checked by
    /// [`TensorEntry::check_coverage`]: the product and its bytes fit in memory's address
    /// range).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The number of elements, or why the shape cannot be a tensor: its product, or its size
    /// in bytes, overflows the address range.
    pub fn checked_numel(&self) -> std::result::Result<usize, String> {
        let size = self.dtype().map_err(|e| e.to_string())?.size_in_bytes();
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|n| {
                n.checked_mul(size)
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| format!("shape {:?} is too large for a tensor", self.shape))
    }

    /// The split scheme its pieces share (`None`: unsplit).
    pub fn split_scheme(&self) -> Option<&Split> {
        self.pieces.first().and_then(|p| p.split.as_ref())
    }

    /// Checks that the pieces cover the tensor exactly once: all split the same way (or none
    /// is split), and the ranges of each part tile its local tensor with no gap and no
    /// overlap. The message names the first problem (without the tensor's name).
    pub fn check_coverage(&self) -> std::result::Result<(), String> {
        self.checked_numel()?;
        let first = self
            .pieces
            .first()
            .ok_or_else(|| "it has no pieces".to_string())?;
        let scheme = first.split.as_ref().map(Split::scheme);
        for p in &self.pieces {
            if p.split.as_ref().map(Split::scheme) != scheme {
                return Err(format!(
                    "its pieces are split in different ways ({:?} in {} vs {:?} in {})",
                    first.split, first.file, p.split, p.file
                ));
            }
            if let Some(s) = &p.split {
                s.check(&self.shape)?;
            }
        }
        let (degree, local_numel) = match &first.split {
            Some(s) => (s.degree, s.local_dims(&self.shape).iter().product()),
            None => (1, self.numel()),
        };
        if local_numel == 0 {
            // Nothing to cover (a zero-element tensor).
            return Ok(());
        }
        for part in 0..degree {
            let mut ranges: Vec<(usize, usize, &str)> = self
                .pieces
                .iter()
                .filter(|p| p.split.as_ref().map_or(0, |s| s.index) == part)
                .map(|p| {
                    let [a, b] = p.range.unwrap_or([0, local_numel]);
                    (a, b, p.file.as_str())
                })
                .collect();
            ranges.sort_unstable();
            let what = if degree > 1 {
                format!(" of split part {part} of {degree}")
            } else {
                String::new()
            };
            let mut at = 0;
            for (a, b, file) in ranges {
                if a >= b || b > local_numel {
                    return Err(format!(
                        "a piece in {file} has element range {a}..{b}, not within 0..{local_numel}{what}"
                    ));
                }
                if a < at {
                    return Err(format!("pieces overlap at element {a}{what} ({file})"));
                }
                if a > at {
                    return Err(format!(
                        "elements {at}..{a}{what} are in no piece (a piece is missing)"
                    ));
                }
                at = b;
            }
            if at < local_numel {
                return Err(format!(
                    "elements {at}..{local_numel}{what} are in no piece (a piece is missing)"
                ));
            }
        }
        Ok(())
    }
}

/// The whole `index.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The checkpoint's name (its directory's name, e.g. `step-000140`).
    pub name: String,
    /// Ranks that took part in the save.
    pub world_size: usize,
    /// The caller's metadata (step, config, schedule and data position, layout, ...).
    pub metadata: serde_json::Value,
    /// Extra files saved beside the tensors (config, tokenizer), by name.
    #[serde(default)]
    pub files: Vec<String>,
    /// Every tensor, in the order the ranks listed them (rank 0's first).
    pub tensors: Vec<TensorEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(file: &str, split: Option<Split>, range: Option<[usize; 2]>) -> PieceEntry {
        PieceEntry {
            file: file.into(),
            key: "w".into(),
            split,
            range,
        }
    }

    fn split(index: usize) -> Option<Split> {
        Some(Split {
            dim: 0,
            chunks: 1,
            degree: 2,
            index,
            mesh_dim: "tp".into(),
        })
    }

    fn entry(pieces: Vec<PieceEntry>) -> TensorEntry {
        TensorEntry {
            name: "w".into(),
            dtype: "f32".into(),
            shape: vec![4, 3],
            role: Role::Parameter,
            pieces,
        }
    }

    #[test]
    fn coverage_is_exact() {
        assert!(entry(vec![piece("a", None, None)]).check_coverage().is_ok());
        let ok = entry(vec![
            piece("a", split(0), Some([0, 4])),
            piece("b", split(0), Some([4, 6])),
            piece("c", split(1), None),
        ]);
        assert!(ok.check_coverage().is_ok());
        let gap = entry(vec![
            piece("a", split(0), Some([0, 4])),
            piece("c", split(1), None),
        ]);
        let e = gap.check_coverage().unwrap_err();
        assert!(e.contains("elements 4..6 of split part 0 of 2"), "{e}");
        let over = entry(vec![
            piece("a", None, Some([0, 7])),
            piece("b", None, Some([6, 12])),
        ]);
        assert!(over
            .check_coverage()
            .unwrap_err()
            .contains("overlap at element 6"));
        let mixed = entry(vec![piece("a", split(0), None), piece("b", None, None)]);
        assert!(mixed
            .check_coverage()
            .unwrap_err()
            .contains("different ways"));
        let none = entry(vec![piece("a", split(0), None)]);
        assert!(none
            .check_coverage()
            .unwrap_err()
            .contains("split part 1 of 2"));
    }

    #[test]
    fn split_extract_and_place_invert() {
        let full = Tensor::from_vec(
            (0..24).map(|i| i as f32).collect(),
            (6, 4),
            meshgrad_tensor::Device::Cpu,
        )
        .unwrap();
        let out = Tensor::zeros((6, 4), DType::F32, meshgrad_tensor::Device::Cpu).unwrap();
        for index in 0..2 {
            let s = Split {
                dim: 0,
                chunks: 3,
                degree: 2,
                index,
                mesh_dim: "tp".into(),
            };
            let local = s.extract(&full).unwrap();
            assert_eq!(local.dims(), &[3, 4]);
            s.place(&out, &local).unwrap();
        }
        assert_eq!(out.to_vec::<f32>().unwrap(), full.to_vec::<f32>().unwrap());
    }
}
