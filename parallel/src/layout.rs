//! The parallel layout of a training run, as given on the command line (`--layout SPEC`).
//!
//! | spec        | layout                                             | ranks |
//! |-------------|----------------------------------------------------|-------|
//! | `dp=N`      | data parallel ([`crate::Ddp`])                     | N     |
//! | `zero1=N`   | sharded data parallel, optimizer state sharded     | N     |
//! | `zero2=N`   | ... plus gradients (reduce-scatter)                | N     |
//! | `zero3=N`, `fsdp=N` | ... plus parameters (FSDP)                  | N     |
//! | `hsdp=RxS`  | hybrid: shard over S ranks, replicate R times      | R * S |
//!
//! Every layout is data parallel over all its ranks: the global batch is split evenly across
//! them (and each rank's rows into micro-batches), so the same seed and global batch give the same
//! training run under any layout.

use std::fmt;
use std::str::FromStr;

use meshgrad_tensor::{Error, Result};

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

/// A parallel layout: the strategy and its degrees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParallelLayout {
    /// Data parallel over `degree` ranks (`dp=N`).
    DataParallel {
        /// Number of ranks.
        degree: usize,
    },
    /// Sharded data parallel over `degree` ranks (`zero1=N`, `zero2=N`, `zero3=N` / `fsdp=N`).
    Zero {
        /// What is sharded.
        stage: ZeroStage,
        /// Number of ranks.
        degree: usize,
    },
    /// Hybrid sharding (`hsdp=RxS`): fully sharded within groups of `shard` ranks, replicated
    /// across `replicate` such groups.
    HybridShard {
        /// Number of replicas (groups).
        replicate: usize,
        /// Ranks per shard group.
        shard: usize,
    },
}

impl ParallelLayout {
    /// Number of ranks the layout runs on.
    pub fn world_size(&self) -> usize {
        match *self {
            ParallelLayout::DataParallel { degree } | ParallelLayout::Zero { degree, .. } => degree,
            ParallelLayout::HybridShard { replicate, shard } => replicate * shard,
        }
    }

    /// Number of ranks the global batch is split across (all of them, for these layouts).
    pub fn data_parallel_degree(&self) -> usize {
        self.world_size()
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
                "layout {self}: each rank's {per_rank} rows (batch {global_batch} / {dp} ranks) do \
                 not split evenly into {microbatches} micro-batches"
            );
        }
        Ok(())
    }
}

fn parse_degree(spec: &str, key: &str, v: &str) -> Result<usize> {
    let d: usize = v.trim().parse().map_err(|_| {
        Error::msg(format!(
            "layout '{spec}': '{v}' is not a number of ranks for {key}"
        ))
    })?;
    if d == 0 {
        meshgrad_tensor::bail!("layout '{spec}': the {key} degree must be at least 1");
    }
    Ok(d)
}

impl FromStr for ParallelLayout {
    type Err = Error;

    /// Parses `dp=N`, `zero1=N`, `zero2=N`, `zero3=N`, `fsdp=N` or `hsdp=RxS`.
    fn from_str(spec: &str) -> Result<Self> {
        let s = spec.trim();
        let Some((key, value)) = s.split_once('=') else {
            meshgrad_tensor::bail!(
                "layout '{spec}': expected NAME=DEGREE, one of dp=N, zero1=N, zero2=N, zero3=N, \
                 fsdp=N, hsdp=RxS"
            );
        };
        let key = key.trim().to_ascii_lowercase();
        let zero = |stage| -> Result<Self> {
            Ok(ParallelLayout::Zero {
                stage,
                degree: parse_degree(spec, &key, value)?,
            })
        };
        match key.as_str() {
            "dp" | "ddp" => Ok(ParallelLayout::DataParallel {
                degree: parse_degree(spec, &key, value)?,
            }),
            "zero1" => zero(ZeroStage::One),
            "zero2" => zero(ZeroStage::Two),
            "zero3" | "fsdp" => zero(ZeroStage::Three),
            "hsdp" => {
                let Some((r, sh)) = value.split_once(['x', 'X', '*']) else {
                    meshgrad_tensor::bail!(
                        "layout '{spec}': hsdp needs REPLICATExSHARD degrees, e.g. hsdp=2x2"
                    );
                };
                Ok(ParallelLayout::HybridShard {
                    replicate: parse_degree(spec, "hsdp replicate", r)?,
                    shard: parse_degree(spec, "hsdp shard", sh)?,
                })
            }
            other => meshgrad_tensor::bail!(
                "layout '{spec}': unknown strategy '{other}' (expected dp, zero1, zero2, zero3, \
                 fsdp or hsdp)"
            ),
        }
    }
}

impl fmt::Display for ParallelLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ParallelLayout::DataParallel { degree } => write!(f, "dp={degree}"),
            ParallelLayout::Zero { stage, degree } => match stage {
                ZeroStage::One => write!(f, "zero1={degree}"),
                ZeroStage::Two => write!(f, "zero2={degree}"),
                ZeroStage::Three => write!(f, "fsdp={degree}"),
            },
            ParallelLayout::HybridShard { replicate, shard } => {
                write!(f, "hsdp={replicate}x{shard}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<ParallelLayout> {
        s.parse()
    }

    #[test]
    fn parses_every_spec() {
        assert_eq!(
            p("dp=4").unwrap(),
            ParallelLayout::DataParallel { degree: 4 }
        );
        assert_eq!(
            p("zero2=2").unwrap(),
            ParallelLayout::Zero {
                stage: ZeroStage::Two,
                degree: 2
            }
        );
        assert_eq!(p("fsdp=8").unwrap(), p("zero3=8").unwrap());
        let h = p("hsdp=2x3").unwrap();
        assert_eq!(
            h,
            ParallelLayout::HybridShard {
                replicate: 2,
                shard: 3
            }
        );
        assert_eq!(h.world_size(), 6);
        for s in ["dp=4", "zero1=4", "zero2=4", "fsdp=4", "hsdp=2x2"] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn refuses_bad_specs_and_runs() {
        for (s, needle) in [
            ("dp", "expected NAME=DEGREE"),
            ("dp=0", "at least 1"),
            ("dp=x", "not a number"),
            ("tp=2", "unknown strategy 'tp'"),
            ("hsdp=4", "REPLICATExSHARD"),
            ("hsdp=2x0", "at least 1"),
        ] {
            let e = p(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
            assert!(!e.contains('\n'));
        }
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
    }
}
