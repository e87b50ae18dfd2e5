//! Distributed checkpoints: every rank writes its own pieces (no rank gathers the model), one
//! index describes where every piece sits in its global tensor, a checkpoint is published by one
//! atomic rename, and loading reshards to any layout.
//!
//! # Format
//!
//! A checkpoint is a directory:
//!
//! ```text
//! step-000140/
//!   index.json                 every tensor and its pieces; the caller's metadata
//!   rank-00000.safetensors     the pieces rank 0 was assigned
//!   rank-00003.safetensors     ... (a rank with nothing assigned writes no file)
//!   config.json ...            extra files the caller passed (SaveOptions::files)
//! ```
//!
//! `index.json` ([`Index`]) lists each tensor ([`TensorEntry`]) with its name (parameters by
//! their model names; optimizer state as `optim/<the optimizer's state-dict key>`, e.g.
//! `optim/adamw.m.wte.weight` for AdamW's first moment, `optim/adamw.step_count`), its role
//! ([`Role`]: parameter; optimizer state, elementwise / per-parameter / global, with its
//! parameter; extra), dtype, global shape and pieces. A piece ([`PieceEntry`]) names its rank
//! file and key there, the tensor-parallel split ([`Split`]: `dim`, `chunks`, `degree`, `index`)
//! of the *local tensor* it belongs to (none: the local tensor is the whole tensor), and
//! optionally a flat element range `[start, end)` of that local tensor (a ZeRO segment). The
//! pieces of a tensor cover it exactly once; saving and opening check it. Example entry:
//!
//! ```json
//! { "name": "h.0.attn.c_attn.weight", "dtype": "f32", "shape": [96, 32],
//!   "role": { "kind": "parameter" },
//!   "pieces": [
//!     { "file": "rank-00000.safetensors", "key": "h.0.attn.c_attn.weight",
//!       "split": { "dim": 0, "chunks": 3, "degree": 2, "index": 0, "mesh_dim": "tp" },
//!       "range": [0, 768] }, ... ] }
//! ```
//!
//! Optimizer state keeps the optimizer's own names (any optimizer whose
//! [`Optimizer::state_kind`](meshgrad_nn::optim::Optimizer::state_kind) classifies its keys
//! works, SGD's momentum as well as AdamW's moments), so loading hands
//! [`Optimizer::load_state_dict`](meshgrad_nn::optim::Optimizer::load_state_dict) exactly what
//! the optimizer wrote.
//!
//! # Saving
//!
//! Each rank collects its pieces: [`pieces_of_module`] (parameters with their placements) and
//! [`pieces_of_optimizer`] for data-parallel, tensor-parallel and pipeline ranks without ZeRO;
//! [`ShardedDataParallel::local_pieces`](crate::ShardedDataParallel::local_pieces) (parameter
//! and optimizer-state segments) under ZeRO; two sets of segments under expert parallelism with
//! ZeRO (the dense parameters' over the data-parallel ranks, the rank's experts' over the ranks
//! holding the same experts, each with its optimizer's state).
//! [`DataParallel::local_pieces`](crate::DataParallel::local_pieces) and
//! [`DataParallel::load_pieces`](crate::DataParallel::load_pieces) choose for a rank's wrapper. [`save`] (collective over the world) exchanges the
//! piece descriptions, writes every distinct piece once (replicas share the writing), and
//! publishes (see [`save`] for the steps).
//!
//! # Atomicity
//!
//! Everything is written into `DIR/.tmp-<name>/`. Only when every rank's file is complete and
//! fsynced (a barrier that also agrees on success) does rank 0 write the index, rename the
//! directory to `DIR/<name>` (the atomic publish) and atomically switch the `DIR/latest` pointer
//! (temporary file + fsync + rename). A complete checkpoint is never modified; [`latest`]
//! never returns a temporary directory; [`cleanup`] removes what killed saves left; [`keep`]
//! deletes old checkpoints (renaming each to a temporary name first).
//!
//! # Loading with resharding
//!
//! [`Checkpoint::open`] reads and checks the index. [`Checkpoint::read_full`] assembles one
//! global tensor; [`Checkpoint::read_local`] the part a rank of another layout needs (reading
//! only the overlapping pieces when the tensor-parallel scheme is unchanged).
//! [`Checkpoint::load_into_module`] gives each parameter its part for the model's *current*
//! placements; [`Checkpoint::load_optimizer`] does the same for a plain optimizer's state;
//! [`ShardedDataParallel::load_pieces`](crate::ShardedDataParallel::load_pieces) fills a ZeRO
//! rank's segments. So a checkpoint saved under one layout loads under any other (dp, fsdp,
//! zero1/2, hsdp, tp, pp and their compositions, single device): pipeline ranks load the
//! parameters they hold by name (`strict = false`).
//!
//! # How the CLI uses this
//!
//! ```no_run
//! # use std::path::Path;
//! # use meshgrad_parallel::checkpoint::{self, Checkpoint, SaveOptions};
//! # use meshgrad_parallel::{Communicator, ShardedDataParallel};
//! # use meshgrad_nn::{Module, optim::Optimizer};
//! # fn f(out: &Path, resume: Option<&Path>, world: &dyn Communicator, model: &dyn Module,
//! #      opt: &mut dyn Optimizer, sdp: Option<&ShardedDataParallel>, pipeline: bool,
//! #      step: u64, keep: usize) -> meshgrad_tensor::Result<()> {
//! // At start, on rank 0 (no save is running): remove leftovers of killed saves. Refuse an
//! // `out` that already holds a run unless --resume (or an overwrite flag) is given:
//! // `checkpoint::latest(out)?.is_some()` says it does.
//! if world.rank() == 0 {
//!     checkpoint::cleanup(out)?;
//! }
//! // --resume DIR: DIR may be a run directory (its latest checkpoint) or a checkpoint.
//! if let Some(dir) = resume {
//!     let ck = Checkpoint::open(dir)?;
//!     let strict = !pipeline; // a pipeline stage holds some of the parameters
//!     match sdp {
//!         Some(z) => z.load_pieces(&ck, strict)?, // ZeRO: parameters and optimizer segments
//!         None => {
//!             ck.load_into_module(model, strict)?;
//!             ck.load_optimizer(opt, strict)?;
//!         }
//!     }
//!     let _step = ck.metadata()["step"].as_u64(); // and the schedule, data position, RNG ...
//! }
//! // Every --save-every N steps (and on SIGINT/SIGTERM, after the step), on every rank:
//! let pieces = match sdp {
//!     Some(z) => z.local_pieces()?,
//!     None => {
//!         let mut p = checkpoint::pieces_of_module(model)?;
//!         p.extend(checkpoint::pieces_of_optimizer(opt)?);
//!         p
//!     }
//! };
//! let opts = SaveOptions {
//!     metadata: serde_json::json!({ "step": step, "layout": "fsdp=4" /* config, lr, data, rng */ }),
//!     files: vec![("config.json".into(), b"{}".to_vec())],
//! };
//! checkpoint::save(out, &checkpoint::checkpoint_name(step), pieces, world, &opts)?;
//! if world.rank() == 0 {
//!     checkpoint::keep(out, keep)?; // --keep K
//! }
//! // eval / generate / export on one device: `ck.load_into_module(&model, true)`, or
//! // `ck.read_full(name)` / `ck.full_parameters()` one tensor at a time.
//! # Ok(()) }
//! ```
//!
//! A single process without a communicator uses [`save_single`].
//!
//! Names must be new: resuming from an *older* checkpoint of a run directory that holds newer
//! ones would meet those names again when saving (an error, since complete checkpoints are never
//! modified); the CLI should refuse that, or resume into another `--out`.

mod assemble;
mod dir;
mod exchange;
mod format;
mod load;
mod open;
mod piece;
mod reader;
mod save;

pub use dir::{checkpoint_name, cleanup, keep, latest, list, LATEST_FILE, TMP_PREFIX};
pub use format::{
    rank_file_name, Index, PieceEntry, Role, Split, StateRole, TensorEntry, FORMAT, INDEX_FILE,
    VERSION,
};
pub use open::Checkpoint;
pub use piece::{pieces_of_module, pieces_of_optimizer, pieces_of_parameters, Piece, OPTIM_PREFIX};
pub use save::{save, save_single, SaveOptions};

pub(crate) use load::{list as list_names, split_and_global};
pub(crate) use piece::state_role;
