//! Saving: every rank writes the pieces it was assigned to its own file, rank 0 writes the index
//! and publishes the directory.
//!
//! 1. **Exchange.** Every rank's piece descriptions (name, role, dtype, global shape, split,
//!    range, byte size, or the error its own checks raised) are all-gathered through the
//!    communicator, so every rank sees every piece. This is why the descriptions travel through
//!    the communicator rather than as per-rank files merged by rank 0: every rank needs them
//!    *before* writing, to know which of its pieces it writes.
//! 2. **Plan** (the same on every rank, from the same bytes). Identical pieces offered by several
//!    ranks (data-parallel or hybrid-sharding replicas, the tied table's copies on the first and
//!    last pipeline stage, per-parameter counters) are written once, by the holder with the
//!    fewest bytes assigned so far (lowest rank on ties), which spreads replicated data over the
//!    replicas. Each tensor's pieces must cover it exactly once, with one dtype and shape;
//!    otherwise every rank fails with the same one-line error before anything is written.
//! 3. **Write.** Rank 0 makes `DIR/.tmp-<name>/`; each rank that owns pieces writes
//!    `rank-NNNNN.safetensors` there (temporary file, fsync, rename); rank 0 adds the caller's
//!    extra files. A barrier that also agrees on success follows.
//! 4. **Publish.** Rank 0 writes `index.json` (fsynced), renames the directory to `DIR/<name>`,
//!    flushes `DIR` and switches `DIR/latest` (see [`super::dir`]). A final agreement makes
//!    every rank return only after the checkpoint is published.
//!
//! Any rank's failure makes every rank return an error (the failing rank's own message, the
//! others one naming it) and nothing is published; a killed save leaves only `DIR/.tmp-<name>/`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use meshgrad_nn::state::{save_safetensors, write_bytes_atomic};
use meshgrad_tensor::{Error, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::dir::{check_name, prepare, publish, tmp_dir};
use super::exchange::{agree, all_gather_bytes, rank_and_size};
use super::format::{
    rank_file_name, Index, PieceEntry, Role, Split, TensorEntry, FORMAT, INDEX_FILE, VERSION,
};
use super::piece::Piece;
use crate::comm::Communicator;

/// What a save records besides the tensors.
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Free-form JSON stored in the index (`Checkpoint::metadata`): the step, the config, the
    /// learning-rate schedule position, the data position and RNG state, the layout it was
    /// saved under. The same on every rank (rank 0's is written).
    pub metadata: serde_json::Value,
    /// Extra files written into the checkpoint directory (config, tokenizer), by plain file
    /// name; rank 0's are written, the other ranks' are ignored.
    pub files: Vec<(String, Vec<u8>)>,
}

/// One piece as the ranks describe it to each other.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Desc {
    name: String,
    role: Role,
    dtype: String,
    shape: Vec<usize>,
    split: Option<Split>,
    range: Option<[usize; 2]>,
    bytes: u64,
}

/// What identifies a piece: its tensor, split part and range.
type PieceKey<'a> = (&'a str, Option<&'a Split>, Option<[usize; 2]>);

/// A rank's contribution to the exchange.
#[derive(Debug, Serialize, Deserialize)]
struct RankDescs {
    error: Option<String>,
    pieces: Vec<Desc>,
}

/// What the plan gives every rank: the index's tensors, and this rank's pieces to write (index
/// into its list, key in its file).
struct Plan {
    tensors: Vec<TensorEntry>,
    mine: Vec<(usize, String)>,
}

/// Saves this rank's `pieces` as part of checkpoint `name` in the run directory `dir`, and
/// returns the published checkpoint's path (`dir/name`). Collective over `comm`, which must
/// contain every rank that holds a piece of the model (the world); every rank calls it with the
/// same `dir` and `name`, which must not be a complete checkpoint already
/// ([`checkpoint_name`](super::checkpoint_name) makes `step-000140`). See the
/// [module docs](super) for the format.
///
/// 1. Every rank's piece descriptions (or the error its own checks raised) are all-gathered.
/// 2. Every rank makes the same plan: identical pieces offered by several ranks (replicas, the
///    tied table's copies on two pipeline stages, per-parameter counters) are written once, by
///    the holder with the fewest bytes assigned so far; every tensor must be described
///    consistently and covered exactly once, else every rank fails with the same error before
///    anything is written.
/// 3. Rank 0 makes `dir/.tmp-<name>/`; each rank writes its file there (fsynced); rank 0 adds
///    the extra files; a barrier agrees on success.
/// 4. Rank 0 writes `index.json`, renames the directory to `dir/<name>` and switches
///    `dir/latest`; a last agreement returns on every rank once it is published.
///
/// Any rank's failure makes every rank return an error (the failing rank's message, the
/// others' naming it) and nothing is published.
pub fn save(
    dir: &Path,
    name: &str,
    pieces: Vec<Piece>,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<PathBuf> {
    save_impl(dir, name, pieces, Some(comm), opts)
}

/// [`save`] for a single process (a world of one rank; no communicator).
pub fn save_single(
    dir: &Path,
    name: &str,
    pieces: Vec<Piece>,
    opts: &SaveOptions,
) -> Result<PathBuf> {
    save_impl(dir, name, pieces, None, opts)
}

fn save_impl(
    dir: &Path,
    name: &str,
    pieces: Vec<Piece>,
    comm: Option<&dyn Communicator>,
    opts: &SaveOptions,
) -> Result<PathBuf> {
    let (rank, size) = rank_and_size(comm);
    let what = format!("checkpoint save {}", dir.join(name).display());
    // 1. Exchange the descriptions (or this rank's error).
    let local = check_local(name, &pieces, rank, opts);
    let descs = match &local {
        Ok(d) => RankDescs {
            error: None,
            pieces: d.clone(),
        },
        Err(e) => RankDescs {
            error: Some(e.to_string()),
            pieces: Vec::new(),
        },
    };
    let bytes = serde_json::to_vec(&descs)
        .map_err(|e| Error::msg(format!("{what}: describing the pieces: {e}")))?;
    let all: Vec<RankDescs> = all_gather_bytes(comm, &bytes)?
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| {
                Error::msg(format!(
                    "{what}: the descriptions of rank {r} are corrupt: {e}"
                ))
            })
        })
        .collect::<Result<_>>()?;
    if let Some((r, e)) = all
        .iter()
        .enumerate()
        .find_map(|(r, d)| d.error.as_ref().map(|e| (r, e)))
    {
        meshgrad_tensor::bail!("{what}: rank {r}: {e}");
    }
    // 2. The plan, the same on every rank.
    let plan = make_plan(&all, rank).map_err(|e| Error::msg(format!("{what}: {e}")))?;
    // 3. Write.
    let tmp = agree(
        comm,
        &what,
        if rank == 0 {
            prepare(dir, name)
        } else {
            Ok(tmp_dir(dir, name))
        },
    )?;
    let written = write_rank_file(&tmp, rank, &pieces, &plan).and_then(|()| {
        if rank == 0 {
            for (f, b) in &opts.files {
                write_bytes_atomic(tmp.join(f), b)?;
            }
        }
        Ok(())
    });
    agree(comm, &what, written)?;
    // 4. Publish.
    let published = if rank == 0 {
        let index = Index {
            format: FORMAT.into(),
            version: VERSION,
            name: name.into(),
            world_size: size,
            metadata: opts.metadata.clone(),
            files: opts.files.iter().map(|(f, _)| f.clone()).collect(),
            tensors: plan.tensors,
        };
        serde_json::to_vec_pretty(&index)
            .map_err(|e| Error::msg(format!("writing the index: {e}")))
            .and_then(|json| write_bytes_atomic(tmp.join(INDEX_FILE), &json))
            .and_then(|()| publish(dir, name))
    } else {
        Ok(dir.join(name))
    };
    agree(comm, &what, published)
}

/// This rank's own checks, and its descriptions.
fn check_local(name: &str, pieces: &[Piece], rank: usize, opts: &SaveOptions) -> Result<Vec<Desc>> {
    check_name(name)?;
    if rank == 0 {
        for (f, _) in &opts.files {
            let reserved =
                f == INDEX_FILE || (f.starts_with("rank-") && f.ends_with(".safetensors"));
            if f.is_empty() || f.starts_with('.') || f.contains(['/', '\\']) || reserved {
                meshgrad_tensor::bail!(
                    "extra file name {f:?} must be a plain file name, not {INDEX_FILE} or a rank file"
                );
            }
        }
    }
    let mut seen: HashSet<PieceKey> = HashSet::new();
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        p.check()?;
        let range = p.range.as_ref().map(|r| [r.start, r.end]);
        if !seen.insert((p.name.as_str(), p.split.as_ref(), range)) {
            meshgrad_tensor::bail!("checkpoint piece {} is given twice on this rank", p.name);
        }
        out.push(Desc {
            name: p.name.clone(),
            role: p.role.clone(),
            dtype: p.data.dtype().to_string(),
            shape: p.shape.clone(),
            split: p.split.clone(),
            range,
            bytes: (p.data.elem_count() * p.data.dtype().size_in_bytes()) as u64,
        });
    }
    Ok(out)
}

/// Assigns each distinct piece to one of its holders and builds the index's tensors; checks
/// that every tensor is described consistently and covered exactly once.
fn make_plan(all: &[RankDescs], my_rank: usize) -> std::result::Result<Plan, String> {
    let mut tensors: Vec<TensorEntry> = Vec::new();
    let mut tensor_of: HashMap<&str, (usize, usize)> = HashMap::new(); // name -> (entry, first rank)
    let mut distinct: Vec<(PieceKey, Vec<(usize, usize)>)> = Vec::new(); // key -> holders (rank, piece)
    let mut distinct_of: HashMap<PieceKey, usize> = HashMap::new();
    for (r, descs) in all.iter().enumerate() {
        for (i, d) in descs.pieces.iter().enumerate() {
            match tensor_of.get(d.name.as_str()) {
                None => {
                    tensor_of.insert(&d.name, (tensors.len(), r));
                    tensors.push(TensorEntry {
                        name: d.name.clone(),
                        dtype: d.dtype.clone(),
                        shape: d.shape.clone(),
                        role: d.role.clone(),
                        pieces: Vec::new(),
                    });
                }
                Some(&(t, first)) => {
                    let e = &tensors[t];
                    if e.dtype != d.dtype || e.shape != d.shape || e.role != d.role {
                        return Err(format!(
                            "tensor {}: rank {first} describes it as {} {:?} ({:?}), rank {r} as {} \
                             {:?} ({:?})",
                            d.name, e.dtype, e.shape, e.role, d.dtype, d.shape, d.role
                        ));
                    }
                }
            }
            let key = (d.name.as_str(), d.split.as_ref(), d.range);
            match distinct_of.get(&key) {
                Some(&k) => distinct[k].1.push((r, i)),
                None => {
                    distinct_of.insert(key, distinct.len());
                    distinct.push((key, vec![(r, i)]));
                }
            }
        }
    }
    let mut load = vec![0u64; all.len()];
    let mut keys_in_file: Vec<HashMap<&str, usize>> = vec![HashMap::new(); all.len()];
    let mut mine = Vec::new();
    for ((name, split, range), holders) in &distinct {
        let &(r, i) = holders
            .iter()
            .min_by_key(|(r, _)| (load[*r], *r))
            .expect("every distinct piece has a holder");
        load[r] += all[r].pieces[i].bytes;
        let n = keys_in_file[r].entry(name).or_insert(0);
        let key = if *n == 0 {
            name.to_string()
        } else {
            format!("{name}#{n}")
        };
        *n += 1;
        if r == my_rank {
            mine.push((i, key.clone()));
        }
        tensors[tensor_of[name].0].pieces.push(PieceEntry {
            file: rank_file_name(r),
            key,
            split: split.cloned(),
            range: *range,
        });
    }
    for t in &tensors {
        t.check_coverage()
            .map_err(|e| format!("tensor {}: {e}", t.name))?;
    }
    Ok(Plan { tensors, mine })
}

/// Writes this rank's assigned pieces (fsynced), if it has any.
fn write_rank_file(tmp: &Path, rank: usize, pieces: &[Piece], plan: &Plan) -> Result<()> {
    if plan.mine.is_empty() {
        return Ok(());
    }
    let tensors: Vec<(String, Tensor)> = plan
        .mine
        .iter()
        .map(|(i, key)| {
            let p = &pieces[*i];
            let data = match &p.range {
                Some(r) => p.data.contiguous()?.reshape(r.len())?,
                None => p.data.clone(),
            };
            Ok((key.clone(), data))
        })
        .collect::<Result<_>>()?;
    save_safetensors(tmp.join(rank_file_name(rank)), &tensors, None)
}
