//! The parallel layout of a training run, as given on the command line (`--layout SPEC`): the
//! degrees of each kind of parallelism, which together arrange the ranks as one mesh.
//!
//! A spec is comma-separated `NAME=DEGREE` entries in any order; the product of the degrees is
//! the number of ranks (an entry left out is degree 1):
//!
//! | entry       | meaning                                                           |
//! |-------------|-------------------------------------------------------------------|
//! | `dp=R`      | replicate over R ranks: data parallel ([`crate::Ddp`]) on its own, the replicas of a sharded layout with a sharding entry |
//! | `zero1=S`   | sharded data parallel over S ranks, optimizer state sharded        |
//! | `zero2=S`   | ... plus gradients (reduce-scatter)                                |
//! | `zero3=S`, `fsdp=S` | ... plus parameters (FSDP)                                 |
//! | `hsdp=RxS`  | hybrid sharding, the same as `dp=R,fsdp=S`: shard over S ranks, replicate R times |
//! | `tp=T`      | tensor parallel over T ranks (each layer split across them)       |
//! | `pp=P`      | pipeline parallel over P ranks (the model cut into stages; [`crate::pipeline`]) |
//! | `cp=C`      | context parallel over C ranks: each row's sequence cut into 2C chunks, rank i holding chunks i and 2C-1-i; attention as ring attention |
//! | `ep=E`      | expert parallel over E ranks: a mixture of experts' experts sharded over them, tokens moved to their experts and back by all-to-alls; adds no ranks (see below) |
//!
//! For example `dp=4` (DDP over 4 ranks), `fsdp=4`, `zero1=4`, `hsdp=2x2` (= `dp=2,fsdp=2`),
//! `dp=2,zero2=2` (hybrid ZeRO-2) or `dp=2,tp=2`. At most one sharding entry (`fsdp`, `zero1`,
//! `zero2`, `zero3`) is allowed, `hsdp` excludes `dp` and the sharding entries, and no entry may
//! be given twice; degree 1 is allowed everywhere (`fsdp=1` is a one-rank ZeRO-3 run). `cp`
//! composes with every other entry.
//!
//! `ep=E` adds no ranks: it divides the data-parallel (times context-parallel) ranks into groups
//! of E consecutive ones (torchtitan's rule), each holding every expert once; the ranks that
//! hold the same experts average their gradients (see [`LayoutMesh::ep_group`]). Without a
//! `dp`, sharding or `hsdp` entry the data-parallel degree is E (`ep=2` is `dp=2,ep=2`; over the
//! context-parallel ranks alone, `dp=1,cp=2,ep=2`). `ep`
//! composes with `dp`, the sharding entries, `hsdp`, `tp` and `pp`; under a sharding entry the
//! other parameters are sharded over the data-parallel ranks and a rank's experts (already
//! split E ways) at the same ZeRO stage over the D / E ranks holding the same ones
//! ([`crate::ExpertDataParallel`]).
//!
//! The ranks form a [`crate::DeviceMesh`] with dimensions `["pp", "dp_replicate", "dp_shard",
//! "cp", "tp"]` (torchtitan's order; every one present, possibly of size 1; `tp` fastest, so
//! tensor-parallel ranks are adjacent, then the context-parallel ring): see
//! [`ParallelLayout::mesh`] and [`LayoutMesh`]. The data-parallel ranks (`dp_replicate x
//! dp_shard`) split the global batch evenly (and each rank's rows into micro-batches); the ranks
//! of one tensor-, context- or pipeline-parallel group read the same rows. Gradients are averaged
//! over `dp_replicate x dp_shard x cp` (the context-parallel ranks fold into the data-parallel
//! reduction, as torchtitan folds them into FSDP's group). So the same seed and global batch give
//! the same training run under any layout.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use meshgrad_tensor::{Error, Result};

use crate::comm::Communicator;
use crate::layout_mesh::LayoutMesh;

/// The most ranks a job may have (1,048,576): a layout's degrees multiply to at most this, and
/// `WORLD_SIZE` is checked against it before anything is allocated per rank.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// What ZeRO shards across the data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// Optimizer state.
    One,
    /// Optimizer state and gradients.
    Two,
    /// Optimizer state, gradients and parameters (FSDP).
    Three,
}

impl ZeroStage {
    /// The `--layout` key of the stage: `zero1`, `zero2` or `fsdp`.
    pub fn key(self) -> &'static str {
        match self {
            ZeroStage::One => "zero1",
            ZeroStage::Two => "zero2",
            ZeroStage::Three => "fsdp",
        }
    }
}

/// The names of the mesh dimensions of a layout, slowest first.
pub const MESH_DIMS: [&str; 5] = ["pp", "dp_replicate", "dp_shard", "cp", "tp"];

/// A parallel layout: the degree of each kind of parallelism (see the [module docs](self)).
///
/// The world is `pp x dp_replicate x dp_shard x cp x tp` ranks. Without a ZeRO stage the layout is
/// plain data parallel over `dp_replicate` ranks (`dp_shard` is 1); with one, parameters,
/// gradients and/or optimizer state are sharded over `dp_shard` ranks and replicated
/// `dp_replicate` times (hybrid sharding when `dp_replicate > 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParallelLayout {
    pp: usize,
    dp_replicate: usize,
    dp_shard: usize,
    zero: Option<ZeroStage>,
    cp: usize,
    tp: usize,
    ep: usize,
}

impl Default for ParallelLayout {
    /// One rank, no parallelism (`dp=1`).
    fn default() -> Self {
        ParallelLayout {
            pp: 1,
            dp_replicate: 1,
            dp_shard: 1,
            zero: None,
            cp: 1,
            tp: 1,
            ep: 1,
        }
    }
}

impl ParallelLayout {
    /// A layout of the given degrees. Every degree must be at least 1, and without a ZeRO stage
    /// `dp_shard` must be 1 (nothing is sharded); the degrees must not overflow when multiplied.
    pub fn new(
        pp: usize,
        dp_replicate: usize,
        dp_shard: usize,
        zero: Option<ZeroStage>,
        tp: usize,
    ) -> Result<Self> {
        let l = ParallelLayout {
            pp,
            dp_replicate,
            dp_shard,
            zero,
            cp: 1,
            tp,
            ep: 1,
        };
        for (name, d) in [
            ("pp", pp),
            ("dp_replicate", dp_replicate),
            ("dp_shard", dp_shard),
            ("tp", tp),
        ] {
            if d == 0 {
                meshgrad_tensor::bail!("parallel layout: the {name} degree must be at least 1");
            }
        }
        if zero.is_none() && dp_shard != 1 {
            meshgrad_tensor::bail!(
                "parallel layout: dp_shard {dp_shard} needs a ZeRO stage (without one nothing is \
                 sharded)"
            );
        }
        let world = [pp, dp_replicate, dp_shard, tp]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d));
        if world.is_none_or(|w| w > MAX_WORLD_SIZE) {
            meshgrad_tensor::bail!(
                "parallel layout: the degrees pp {pp} x dp_replicate {dp_replicate} x dp_shard \
                 {dp_shard} x tp {tp} make more than {MAX_WORLD_SIZE} ranks"
            );
        }
        Ok(l)
    }

    /// Data parallel over `degree` ranks (`dp=N`).
    pub fn data_parallel(degree: usize) -> Result<Self> {
        Self::new(1, degree, 1, None, 1)
    }

    /// Sharded data parallel (`stage`) over `degree` ranks (`zero1=N`, `zero2=N`, `fsdp=N`).
    pub fn sharded(stage: ZeroStage, degree: usize) -> Result<Self> {
        Self::new(1, 1, degree, Some(stage), 1)
    }

    /// Hybrid sharding (`hsdp=RxS`): ZeRO-3 within groups of `shard` ranks, replicated across
    /// `replicate` such groups.
    pub fn hybrid(replicate: usize, shard: usize) -> Result<Self> {
        Self::new(1, replicate, shard, Some(ZeroStage::Three), 1)
    }

    /// This layout with tensor-parallel degree `tp`.
    pub fn with_tp(self, tp: usize) -> Result<Self> {
        Self::new(self.pp, self.dp_replicate, self.dp_shard, self.zero, tp)?
            .with_cp(self.cp)?
            .with_ep(self.ep)
    }

    /// This layout with expert-parallel degree `ep` (at least 1; see the [module docs](self)),
    /// which must divide the data-parallel (times context-parallel) ranks. Composes with `dp`,
    /// the ZeRO stages, `fsdp`, `hsdp`, `cp`, `tp` and `pp` (the expert-parallel groups are
    /// data-parallel ranks of one tensor-parallel coordinate).
    pub fn with_ep(self, ep: usize) -> Result<Self> {
        if ep == 0 {
            meshgrad_tensor::bail!("parallel layout: the ep degree must be at least 1");
        }
        if ep > 1 {
            let ranks = self.data_parallel_degree() * self.cp;
            if !ranks.is_multiple_of(ep) {
                meshgrad_tensor::bail!(
                    "parallel layout: ep = {ep} does not divide the {ranks} data-parallel ranks \
                     (dp {} x cp {})",
                    self.data_parallel_degree(),
                    self.cp
                );
            }
        }
        Ok(ParallelLayout { ep, ..self })
    }

    /// This layout with context-parallel degree `cp` (at least 1). Context parallelism composes
    /// with every other degree: plain, sharded or hybrid data parallelism, `tp` and `pp`.
    pub fn with_cp(self, cp: usize) -> Result<Self> {
        if cp == 0 {
            meshgrad_tensor::bail!("parallel layout: the cp degree must be at least 1");
        }
        let world = self.world_size().checked_mul(cp);
        if world.is_none_or(|w| w > MAX_WORLD_SIZE) {
            meshgrad_tensor::bail!(
                "parallel layout: the degrees with cp {cp} make more than {MAX_WORLD_SIZE} ranks"
            );
        }
        Ok(ParallelLayout { cp, ..self })
    }

    /// Number of ranks the layout runs on: the product of its degrees.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
    }

    /// Number of ranks the global batch is split across: `dp_replicate * dp_shard`.
    pub fn data_parallel_degree(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// The pipeline-parallel degree.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// The tensor-parallel degree.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// The context-parallel degree (ranks that split each row's sequence).
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// The expert-parallel degree (ranks a mixture of experts' experts are sharded over; they
    /// are data-parallel ranks, see the [module docs](self)).
    pub fn ep(&self) -> usize {
        self.ep
    }

    /// The number of replicas of the data-parallel ranks (the DDP degree without a ZeRO stage).
    pub fn dp_replicate(&self) -> usize {
        self.dp_replicate
    }

    /// The number of ranks ZeRO shards over (1 without a ZeRO stage).
    pub fn dp_shard(&self) -> usize {
        self.dp_shard
    }

    /// The number of ranks a ZeRO stage shards over: `dp_shard x cp` (the context-parallel
    /// ranks hold the same parameters; see `LayoutMesh::shard_topology`).
    pub fn shard_degree(&self) -> usize {
        self.dp_shard * self.cp
    }

    /// What ZeRO shards, if the layout is sharded.
    pub fn zero(&self) -> Option<ZeroStage> {
        self.zero
    }

    /// The mesh dimension sizes, in the order of [`MESH_DIMS`].
    pub fn mesh_shape(&self) -> [usize; 5] {
        [self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp]
    }

    /// This rank's [`LayoutMesh`] over `world`, which must have [`Self::world_size`] ranks.
    /// Every rank of `world` must call it (it creates the mesh's process groups, in the same
    /// order on every rank).
    pub fn mesh(&self, world: Arc<dyn Communicator>) -> Result<LayoutMesh> {
        LayoutMesh::new(*self, world)
    }

    /// Checks the layout against a run before any work: the global batch must split evenly over
    /// the data-parallel ranks, and each rank's rows into `microbatches`; with `world` given, the
    /// degrees must multiply to it. Errors are one line naming the numbers.
    pub fn check(
        &self,
        global_batch: usize,
        microbatches: usize,
        world: Option<usize>,
    ) -> Result<()> {
        if let Some(w) = world {
            if w != self.world_size() {
                meshgrad_tensor::bail!(
                    "layout {self}: its degrees multiply to {} ranks, but the world has {w}",
                    self.world_size()
                );
            }
        }
        let dp = self.data_parallel_degree();
        if microbatches == 0 {
            meshgrad_tensor::bail!("layout {self}: --microbatches must be at least 1");
        }
        if global_batch == 0 || !global_batch.is_multiple_of(dp) {
            meshgrad_tensor::bail!(
                "layout {self}: the global batch of {global_batch} rows does not split evenly over \
                 {dp} data-parallel ranks"
            );
        }
        let per_rank = global_batch / dp;
        if !per_rank.is_multiple_of(microbatches) {
            meshgrad_tensor::bail!(
                "layout {self}: each rank's {per_rank} rows (batch {global_batch} / {dp} \
                 data-parallel ranks) do not split evenly into {microbatches} micro-batches"
            );
        }
        Ok(())
    }
}

fn parse_degree(spec: &str, key: &str, v: &str) -> Result<usize> {
    let d: usize = v.trim().parse().map_err(|_| {
        Error::msg(format!(
            "layout '{spec}': '{}' is not a number of ranks for {key}",
            v.trim()
        ))
    })?;
    if d == 0 {
        meshgrad_tensor::bail!("layout '{spec}': the {key} degree must be at least 1");
    }
    Ok(d)
}

const EXPECTED: &str = "dp=R, fsdp=S, zero1=S, zero2=S, zero3=S, hsdp=RxS, tp=T, pp=P, cp=C, ep=E";

impl FromStr for ParallelLayout {
    type Err = Error;

    /// Parses comma-separated `dp=R`, `fsdp=S` (`zero3=S`), `zero1=S`, `zero2=S`, `hsdp=RxS`,
    /// `tp=T`, `pp=P`, `cp=C` and `ep=E` entries (see the [module docs](self)). Errors are one line naming the
    /// offending entries.
    fn from_str(spec: &str) -> Result<Self> {
        let spec = spec.trim();
        // (key as written, degree) of each kind of entry.
        let mut dp: Option<(String, usize)> = None;
        let mut shard: Option<(String, ZeroStage, usize)> = None;
        let mut hsdp: Option<(usize, usize)> = None;
        let mut tp: Option<usize> = None;
        let mut pp: Option<usize> = None;
        let mut cp: Option<usize> = None;
        let mut ep: Option<usize> = None;
        for entry in spec.split(',') {
            let entry = entry.trim();
            if entry.is_empty() {
                meshgrad_tensor::bail!(
                    "layout '{spec}': empty entry; expected comma-separated NAME=DEGREE entries \
                     ({EXPECTED})"
                );
            }
            let Some((key, value)) = entry.split_once('=') else {
                meshgrad_tensor::bail!(
                    "layout '{spec}': '{entry}' is not NAME=DEGREE; expected comma-separated \
                     entries of {EXPECTED}"
                );
            };
            let key = key.trim().to_ascii_lowercase();
            let twice = || Error::msg(format!("layout '{spec}': {key} is given twice"));
            match key.as_str() {
                "dp" | "ddp" => {
                    if let Some((k, _)) = &dp {
                        if *k == key {
                            return Err(twice());
                        }
                        meshgrad_tensor::bail!(
                            "layout '{spec}': {k} and {key} are the same entry; give one"
                        );
                    }
                    dp = Some((key.clone(), parse_degree(spec, &key, value)?));
                }
                "zero1" | "zero2" | "zero3" | "fsdp" => {
                    if let Some((k, _, _)) = &shard {
                        if *k == key {
                            return Err(twice());
                        }
                        meshgrad_tensor::bail!(
                            "layout '{spec}': {k} and {key} conflict; give one sharding entry \
                             (fsdp, zero1, zero2 or zero3)"
                        );
                    }
                    let stage = match key.as_str() {
                        "zero1" => ZeroStage::One,
                        "zero2" => ZeroStage::Two,
                        _ => ZeroStage::Three,
                    };
                    shard = Some((key.clone(), stage, parse_degree(spec, &key, value)?));
                }
                "hsdp" => {
                    if hsdp.is_some() {
                        return Err(twice());
                    }
                    let Some((r, s)) = value.split_once(['x', 'X', '*']) else {
                        meshgrad_tensor::bail!(
                            "layout '{spec}': hsdp needs REPLICATExSHARD degrees, e.g. hsdp=2x2"
                        );
                    };
                    hsdp = Some((
                        parse_degree(spec, "hsdp replicate", r)?,
                        parse_degree(spec, "hsdp shard", s)?,
                    ));
                }
                "tp" => {
                    if tp.is_some() {
                        return Err(twice());
                    }
                    tp = Some(parse_degree(spec, &key, value)?);
                }
                "pp" => {
                    if pp.is_some() {
                        return Err(twice());
                    }
                    pp = Some(parse_degree(spec, &key, value)?);
                }
                "cp" => {
                    if cp.is_some() {
                        return Err(twice());
                    }
                    cp = Some(parse_degree(spec, &key, value)?);
                }
                "ep" => {
                    if ep.is_some() {
                        return Err(twice());
                    }
                    ep = Some(parse_degree(spec, &key, value)?);
                }
                other => meshgrad_tensor::bail!(
                    "layout '{spec}': unknown entry '{other}' (expected {EXPECTED})"
                ),
            }
        }
        let (dp_replicate, dp_shard, zero) = match (hsdp, dp, shard) {
            (Some(_), Some((k, _)), _) => meshgrad_tensor::bail!(
                "layout '{spec}': hsdp and {k} conflict (hsdp=RxS is dp=R,fsdp=S); give one of them"
            ),
            (Some(_), None, Some((k, _, _))) => meshgrad_tensor::bail!(
                "layout '{spec}': hsdp and {k} conflict (hsdp=RxS is dp=R,fsdp=S); give one of them"
            ),
            (Some((r, s)), None, None) => (r, s, Some(ZeroStage::Three)),
            (None, dp, Some((_, stage, s))) => (dp.map_or(1, |d| d.1), s, Some(stage)),
            // Without a data-parallel entry, ep=E is dp=E,ep=E.
            (None, dp, None) => (dp.map_or(ep.unwrap_or(1), |d| d.1), 1, None),
        };
        ParallelLayout::new(
            pp.unwrap_or(1),
            dp_replicate,
            dp_shard,
            zero,
            tp.unwrap_or(1),
        )
        .and_then(|l| l.with_cp(cp.unwrap_or(1)))
        .and_then(|l| l.with_ep(ep.unwrap_or(1)))
        .map_err(|e| Error::msg(format!("layout '{spec}': {e}")))
    }
}

impl fmt::Display for ParallelLayout {
    /// The canonical spec, which parses back to the same layout: `pp=P` (when above 1), then
    /// `dp=R` (left out when 1 beside other entries), `hsdp=RxS` for hybrid ZeRO-3 or `dp=R`
    /// and `fsdp=S` / `zero1=S` / `zero2=S`, then `cp=C` and `tp=T` (when above 1); e.g. `dp=4`, `fsdp=4`,
    /// `hsdp=2x2`, `dp=2,zero1=2`, `dp=2,tp=2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if self.pp > 1 {
            parts.push(format!("pp={}", self.pp));
        }
        match self.zero {
            Some(ZeroStage::Three) if self.dp_replicate > 1 => {
                parts.push(format!("hsdp={}x{}", self.dp_replicate, self.dp_shard));
            }
            Some(stage) => {
                if self.dp_replicate > 1 {
                    parts.push(format!("dp={}", self.dp_replicate));
                }
                parts.push(format!("{}={}", stage.key(), self.dp_shard));
            }
            None => {
                // `dp=1` stays beside `ep` (alone, `ep=E` means `dp=E,ep=E`).
                if self.dp_replicate > 1
                    || self.ep > 1
                    || (self.tp == 1 && self.pp == 1 && self.cp == 1)
                {
                    parts.push(format!("dp={}", self.dp_replicate));
                }
            }
        }
        if self.cp > 1 {
            parts.push(format!("cp={}", self.cp));
        }
        if self.tp > 1 {
            parts.push(format!("tp={}", self.tp));
        }
        if self.ep > 1 {
            parts.push(format!("ep={}", self.ep));
        }
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<ParallelLayout> {
        s.parse()
    }

    fn l(pp: usize, r: usize, s: usize, zero: Option<ZeroStage>, tp: usize) -> ParallelLayout {
        ParallelLayout::new(pp, r, s, zero, tp).unwrap()
    }

    #[test]
    fn parses_every_spec() {
        use ZeroStage::*;
        assert_eq!(p("dp=4").unwrap(), l(1, 4, 1, None, 1));
        assert_eq!(p("ddp=4").unwrap(), p("dp=4").unwrap());
        assert_eq!(p("zero1=4").unwrap(), l(1, 1, 4, Some(One), 1));
        assert_eq!(p("zero2=2").unwrap(), l(1, 1, 2, Some(Two), 1));
        assert_eq!(p("fsdp=8").unwrap(), p("zero3=8").unwrap());
        assert_eq!(p("fsdp=8").unwrap(), l(1, 1, 8, Some(Three), 1));
        let h = p("hsdp=2x3").unwrap();
        assert_eq!(h, l(1, 2, 3, Some(Three), 1));
        assert_eq!(h, p("dp=2,fsdp=3").unwrap());
        assert_eq!(h, p(" fsdp=3 , DP=2 ").unwrap());
        assert_eq!(h.world_size(), 6);
        assert_eq!(h.data_parallel_degree(), 6);
        assert_eq!(p("tp=2").unwrap(), l(1, 1, 1, None, 2));
        assert_eq!(p("pp=1").unwrap(), ParallelLayout::default());
        assert_eq!(p("fsdp=1").unwrap(), l(1, 1, 1, Some(Three), 1));
        assert_eq!(
            ParallelLayout::hybrid(2, 2).unwrap(),
            p("hsdp=2x2").unwrap()
        );
        assert_eq!(
            ParallelLayout::sharded(One, 4).unwrap(),
            p("zero1=4").unwrap()
        );
        assert_eq!(
            ParallelLayout::data_parallel(2)
                .unwrap()
                .with_tp(2)
                .unwrap(),
            p("tp=2,dp=2").unwrap()
        );
    }

    #[test]
    fn combinations_and_their_degrees() {
        use ZeroStage::*;
        let c = p("dp=2,zero1=2,tp=2,pp=1").unwrap();
        assert_eq!(c, l(1, 2, 2, Some(One), 2));
        assert_eq!(
            (c.world_size(), c.data_parallel_degree(), c.tp(), c.pp()),
            (8, 4, 2, 1)
        );
        assert_eq!(
            (c.dp_replicate(), c.dp_shard(), c.zero()),
            (2, 2, Some(One))
        );
        assert_eq!(c.mesh_shape(), [1, 2, 2, 1, 2]);
        let c = p("dp=2,cp=4").unwrap();
        assert_eq!(c.mesh_shape(), [1, 2, 1, 4, 1]);
        assert_eq!(
            (c.world_size(), c.data_parallel_degree(), c.cp()),
            (8, 2, 4)
        );
        let c = p("hsdp=2x2,tp=4").unwrap();
        assert_eq!((c.world_size(), c.data_parallel_degree()), (16, 4));
        let c = p("tp=4,dp=2").unwrap();
        assert_eq!((c.world_size(), c.data_parallel_degree()), (8, 2));
        assert_eq!(c.zero(), None);
    }

    #[test]
    fn display_is_canonical_and_parses_back() {
        // Today's single-strategy forms print as they always did.
        for s in [
            "dp=4", "zero1=4", "zero2=4", "fsdp=4", "hsdp=2x2", "dp=1", "fsdp=1",
        ] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
        for (s, canonical) in [
            ("zero3=4", "fsdp=4"),
            ("dp=2,fsdp=2", "hsdp=2x2"),
            ("fsdp=2,dp=2,tp=2", "hsdp=2x2,tp=2"),
            ("tp=2,dp=2", "dp=2,tp=2"),
            ("zero1=2,dp=2", "dp=2,zero1=2"),
            ("dp=2,zero2=3,tp=2,pp=1", "dp=2,zero2=3,tp=2"),
            ("tp=2", "tp=2"),
            ("dp=1,tp=2", "tp=2"),
            ("pp=1", "dp=1"),
            ("hsdp=2x1", "hsdp=2x1"),
            ("dp=1,zero1=2", "zero1=2"),
            ("cp=2", "cp=2"),
            ("cp=2,dp=2", "dp=2,cp=2"),
            ("cp=1", "dp=1"),
            ("ep=2", "dp=2,ep=2"),
            ("ep=4,dp=4", "dp=4,ep=4"),
            ("dp=4,ep=2", "dp=4,ep=2"),
            ("ep=2,pp=2", "pp=2,dp=2,ep=2"),
            ("ep=1", "dp=1"),
            ("tp=2,ep=2", "dp=2,tp=2,ep=2"),
            ("dp=1,cp=2,ep=2", "dp=1,cp=2,ep=2"),
            ("cp=2,ep=2", "dp=2,cp=2,ep=2"),
        ] {
            let layout = p(s).unwrap();
            assert_eq!(layout.to_string(), canonical, "{s}");
            assert_eq!(p(canonical).unwrap(), layout, "{s}");
        }
    }

    #[test]
    fn refuses_bad_and_conflicting_specs_in_one_line() {
        for (s, needles) in [
            ("dp", &["'dp' is not NAME=DEGREE"][..]),
            ("dp=0", &["dp degree must be at least 1"][..]),
            ("dp=x", &["'x' is not a number of ranks for dp"][..]),
            ("dp=2,", &["empty entry"][..]),
            ("sp=2", &["unknown entry 'sp'"][..]),
            ("hsdp=4", &["REPLICATExSHARD"][..]),
            ("hsdp=2x0", &["at least 1"][..]),
            ("tp=0", &["tp degree must be at least 1"][..]),
            ("pp=0", &["pp degree must be at least 1"][..]),
            ("dp=2,dp=4", &["dp is given twice"][..]),
            ("tp=2,tp=2", &["tp is given twice"][..]),
            ("hsdp=2x2,hsdp=1x2", &["hsdp is given twice"][..]),
            ("dp=2,ddp=2", &["dp and ddp"][..]),
            ("fsdp=2,zero1=2", &["fsdp and zero1 conflict"][..]),
            ("zero2=2,zero3=2", &["zero2 and zero3 conflict"][..]),
            ("fsdp=2,fsdp=2", &["fsdp is given twice"][..]),
            ("hsdp=2x2,dp=2", &["hsdp and dp conflict"][..]),
            ("fsdp=2,hsdp=2x2", &["hsdp and fsdp conflict"][..]),
            ("cp=0", &["cp degree must be at least 1"][..]),
            ("cp=2,cp=2", &["cp is given twice"][..]),
            ("hsdp=2x2,zero1=2", &["hsdp and zero1 conflict"][..]),
            ("ep=0", &["ep degree must be at least 1"][..]),
            ("ep=2,ep=2", &["ep is given twice"][..]),
            (
                "dp=3,ep=2",
                &["ep = 2 does not divide the 3 data-parallel ranks"][..],
            ),
            (
                "ep=2,fsdp=3",
                &["ep = 2 does not divide the 3 data-parallel ranks"][..],
            ),
        ] {
            let e = p(s).unwrap_err().to_string();
            for n in needles {
                assert!(e.contains(n), "{s}: {e}");
            }
            assert!(e.contains(&format!("'{s}'")), "{s}: {e}");
            assert!(!e.contains('\n'), "{s}: {e}");
        }
        let e = ParallelLayout::new(1, 2, 2, None, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("dp_shard 2 needs a ZeRO stage"), "{e}");
        let e = ParallelLayout::new(1, usize::MAX, 2, Some(ZeroStage::One), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 1048576 ranks"), "{e}");
        let e = ParallelLayout::new(1, 1 << 11, 1 << 10, Some(ZeroStage::One), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 1048576 ranks"), "{e}");
        ParallelLayout::new(1, 1 << 10, 1 << 10, Some(ZeroStage::One), 1).unwrap();
    }

    #[test]
    fn check_is_over_the_data_parallel_ranks() {
        let dp4 = p("dp=4").unwrap();
        assert!(dp4.check(8, 2, Some(4)).is_ok());
        let e = dp4.check(6, 1, None).unwrap_err().to_string();
        assert!(e.contains("6 rows does not split evenly over 4"), "{e}");
        let e = dp4.check(8, 4, None).unwrap_err().to_string();
        assert!(e.contains("2 rows") && e.contains("4 micro-batches"), "{e}");
        let e = p("hsdp=2x2")
            .unwrap()
            .check(8, 1, Some(8))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("multiply to 4 ranks, but the world has 8"),
            "{e}"
        );
        // tp ranks read the same rows: 6 rows over dp=2,tp=2 is 3 per data-parallel rank.
        let c = p("dp=2,tp=2").unwrap();
        assert!(c.check(6, 3, Some(4)).is_ok());
        let e = p("dp=3,fsdp=2")
            .unwrap()
            .check(8, 1, None)
            .unwrap_err()
            .to_string();
        // dp=R,fsdp=S is hsdp=RxS, and prints so.
        assert!(e.starts_with("layout hsdp=3x2:"), "{e}");
        assert!(e.contains("8 rows does not split evenly over 6"), "{e}");
        assert!(!e.contains('\n'));
    }
}
