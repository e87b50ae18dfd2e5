//! Rendezvous from the environment: which rank this process is, in a world of how many, and where
//! rank 0's key-value store listens, as told by the launcher that started it.
//!
//! # Sources and precedence
//!
//! [`RankEnv::from_vars`] looks at the first source whose marker variable is set, in this order:
//!
//! 1. **torchrun** (and `meshgrad launch`), marked by `RANK`: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!    `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the node's index). `WORLD_SIZE` is required with `RANK`;
//!    `LOCAL_RANK` defaults to `RANK`, `LOCAL_WORLD_SIZE` to `WORLD_SIZE` and `GROUP_RANK` to
//!    `RANK / LOCAL_WORLD_SIZE`.
//! 2. **Open MPI** (`mpirun`), marked by `OMPI_COMM_WORLD_RANK`: `OMPI_COMM_WORLD_RANK`, `_SIZE`,
//!    `_LOCAL_RANK`, `_LOCAL_SIZE`. Open MPI does not export the node's index
//!    (`OMPI_COMM_WORLD_NODE_RANK` is the process's rank among all processes on its node, not the
//!    node's rank), so `node_rank` is `RANK / LOCAL_SIZE`, right for mpirun's default by-slot
//!    placement of equally many ranks per node.
//! 3. **Slurm** (`srun`), marked by `SLURM_PROCID`: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else
//!    `SLURM_NTASKS`), `SLURM_LOCALID`, `SLURM_NODEID`; the local world size is this node's entry
//!    of `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_TASKS_PER_NODE`; both look like `2(x3),1`), else
//!    `SLURM_NTASKS_PER_NODE`, else the world size on one node (`SLURM_NNODES` unset or 1).
//!    `MASTER_ADDR` defaults to `SLURM_LAUNCH_NODE_IPADDR`.
//! 4. **None**: a single process, rank 0 of 1.
//!
//! A launcher that wraps another sets its own variables on top (torchrun under srun, mpirun in a
//! Slurm allocation), hence this order: the innermost launcher's variables are the ones that
//! describe this process. `MASTER_ADDR` and `MASTER_PORT` are read for every source.
//!
//! A variable that is not a number, a rank not below its size, or a size of 0 is a one-line
//! error naming the variable, e.g. `RANK=4 is not below WORLD_SIZE=4`.

use meshgrad_tensor::{Error, Result};

/// Which launcher's variables a [`RankEnv`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvSource {
    /// torchrun's (`RANK`, `WORLD_SIZE`, ...), also set by `meshgrad launch`.
    Torchrun,
    /// Open MPI's (`OMPI_COMM_WORLD_*`), set by `mpirun`.
    OpenMpi,
    /// Slurm's (`SLURM_PROCID`, ...), set by `srun`.
    Slurm,
    /// No launcher: a single process.
    None,
}

impl EnvSource {
    /// A short description for messages, e.g. `torchrun's variables`.
    pub fn describe(self) -> &'static str {
        match self {
            EnvSource::Torchrun => "torchrun's variables",
            EnvSource::OpenMpi => "Open MPI's variables",
            EnvSource::Slurm => "Slurm's variables",
            EnvSource::None => "no launcher variables",
        }
    }

    /// The variable that holds the world size for this source (for messages).
    pub fn world_size_var(self) -> &'static str {
        match self {
            EnvSource::Torchrun => "WORLD_SIZE",
            EnvSource::OpenMpi => "OMPI_COMM_WORLD_SIZE",
            EnvSource::Slurm => "SLURM_NTASKS",
            EnvSource::None => "WORLD_SIZE",
        }
    }
}

/// This process's place in a multi-process job (see the [module docs](self) for the sources).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes of this node, `0..local_world_size`.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Index of this node.
    pub node_rank: usize,
    /// Where rank 0's store listens (`MASTER_ADDR`), if known.
    pub master_addr: Option<String>,
    /// The store's port (`MASTER_PORT`), if known.
    pub master_port: Option<u16>,
    /// Where the values came from.
    pub source: EnvSource,
}

impl RankEnv {
    /// A single process: rank 0 of 1, no store.
    pub fn single() -> RankEnv {
        RankEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            source: EnvSource::None,
        }
    }

    /// Reads this process's environment (see [`RankEnv::from_vars`]).
    pub fn detect() -> Result<RankEnv> {
        RankEnv::from_vars(&|name| std::env::var(name).ok())
    }

    /// Reads the variables through `var` (a name to its value, `None` when unset), so tests need
    /// not touch the process environment. Empty values count as unset.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let num =
            |name: &str| -> Result<Option<usize>> {
                match get(name) {
                    None => Ok(None),
                    Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                        Error::msg(format!("{name}={v} is not a non-negative integer"))
                    }),
                }
            };
        let need = |name: &str, marker: &str| -> Result<usize> {
            num(name)?.ok_or_else(|| Error::msg(format!("{marker} is set but {name} is not")))
        };
        let master_addr = get("MASTER_ADDR");
        let master_port =
            match get("MASTER_PORT") {
                None => None,
                Some(v) => match v.trim().parse::<u16>() {
                    Ok(0) => return Err(Error::msg(
                        "MASTER_PORT=0 is not a port the ranks can meet at: give rank 0's store \
                         a fixed port (1 to 65535)",
                    )),
                    Ok(p) => Some(p),
                    Err(_) => {
                        return Err(Error::msg(format!(
                            "MASTER_PORT={v} is not a port number (1 to 65535)"
                        )))
                    }
                },
            };
        let env = if let Some(rank) = num("RANK")? {
            let world_size = need("WORLD_SIZE", "RANK")?;
            let local_world_size = num("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
            RankEnv {
                rank,
                world_size,
                local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
                local_world_size,
                node_rank: num("GROUP_RANK")?.unwrap_or(rank / local_world_size.max(1)),
                master_addr,
                master_port,
                source: EnvSource::Torchrun,
            }
        } else if let Some(rank) = num("OMPI_COMM_WORLD_RANK")? {
            let world_size = need("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")?;
            let local_world_size = num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world_size);
            RankEnv {
                rank,
                world_size,
                local_rank: num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank),
                local_world_size,
                node_rank: rank / local_world_size.max(1),
                master_addr,
                master_port,
                source: EnvSource::OpenMpi,
            }
        } else if let Some(rank) = num("SLURM_PROCID")? {
            let world_size = match num("SLURM_STEP_NUM_TASKS")? {
                Some(n) => n,
                None => need("SLURM_NTASKS", "SLURM_PROCID")?,
            };
            let node_rank = num("SLURM_NODEID")?.unwrap_or(0);
            let per_node = match get("SLURM_STEP_TASKS_PER_NODE") {
                Some(v) => Some(("SLURM_STEP_TASKS_PER_NODE", v)),
                None => get("SLURM_TASKS_PER_NODE").map(|v| ("SLURM_TASKS_PER_NODE", v)),
            };
            let local_world_size = match per_node {
                Some((name, v)) => tasks_on_node(name, &v, node_rank)?,
                None => match num("SLURM_NTASKS_PER_NODE")? {
                    Some(n) => n,
                    None if num("SLURM_NNODES")?.unwrap_or(1) <= 1 => world_size,
                    None => {
                        return Err(Error::msg(
                            "SLURM_NNODES is above 1 but neither SLURM_TASKS_PER_NODE nor \
                             SLURM_NTASKS_PER_NODE is set",
                        ))
                    }
                },
            };
            RankEnv {
                rank,
                world_size,
                local_rank: num("SLURM_LOCALID")?.unwrap_or(0),
                local_world_size,
                node_rank,
                master_addr: master_addr.or_else(|| get("SLURM_LAUNCH_NODE_IPADDR")),
                master_port,
                source: EnvSource::Slurm,
            }
        } else {
            RankEnv {
                master_addr,
                master_port,
                ..RankEnv::single()
            }
        };
        env.check()?;
        Ok(env)
    }

    /// Whether the job has more than one process.
    pub fn is_multi_process(&self) -> bool {
        self.world_size > 1
    }

    /// The names of this source's rank, world size, local rank and local world size variables.
    fn var_names(&self) -> [&'static str; 4] {
        match self.source {
            EnvSource::Torchrun | EnvSource::None => {
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]
            }
            EnvSource::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
            EnvSource::Slurm => [
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_TASKS_PER_NODE",
            ],
        }
    }

    fn check(&self) -> Result<()> {
        let [rank, world, local_rank, local_world] = self.var_names();
        if self.world_size == 0 {
            meshgrad_tensor::bail!("{world}=0: a job needs at least one process");
        }
        if self.world_size > crate::layout::MAX_WORLD_SIZE {
            meshgrad_tensor::bail!(
                "{world}={} is more than the {} processes a job may have",
                self.world_size,
                crate::layout::MAX_WORLD_SIZE
            );
        }
        if self.rank >= self.world_size {
            meshgrad_tensor::bail!(
                "{rank}={} is not below {world}={}",
                self.rank,
                self.world_size
            );
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            meshgrad_tensor::bail!(
                "{local_world}={} must be between 1 and {world}={}",
                self.local_world_size,
                self.world_size
            );
        }
        if self.local_rank >= self.local_world_size {
            meshgrad_tensor::bail!(
                "{local_rank}={} is not below {local_world}={}",
                self.local_rank,
                self.local_world_size
            );
        }
        Ok(())
    }
}

/// The number of tasks on node `node` from a Slurm list such as `2(x3),1` (3 nodes with 2 tasks,
/// then one with 1).
fn tasks_on_node(name: &str, value: &str, node: usize) -> Result<usize> {
    let bad = || {
        Error::msg(format!(
            "{name}={value} is not a Slurm task list like 2(x3),1"
        ))
    };
    let mut seen = 0usize;
    for part in value.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        seen += repeat;
        if node < seen {
            return Ok(count);
        }
    }
    Err(Error::msg(format!(
        "{name}={value} lists {seen} node(s), but SLURM_NODEID is {node}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<RankEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_vars(&|k| map.get(k).cloned())
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        env(pairs).unwrap_err().to_string()
    }

    #[test]
    fn nothing_set_is_a_single_process() {
        assert_eq!(env(&[]).unwrap(), RankEnv::single());
        assert!(!RankEnv::single().is_multi_process());
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            e,
            RankEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                master_addr: Some("10.0.0.1".into()),
                master_port: Some(29500),
                source: EnvSource::Torchrun,
            }
        );
        assert!(e.is_multi_process());
        // Defaults: one node.
        let e = env(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap();
        assert_eq!((e.local_rank, e.local_world_size, e.node_rank), (1, 2, 0));
        assert_eq!(e.master_addr, None);
    }

    #[test]
    fn torchrun_errors_name_the_variable() {
        assert_eq!(
            err(&[("RANK", "4"), ("WORLD_SIZE", "4")]),
            "RANK=4 is not below WORLD_SIZE=4"
        );
        assert_eq!(
            err(&[("RANK", "x"), ("WORLD_SIZE", "4")]),
            "RANK=x is not a non-negative integer"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "-2")]),
            "WORLD_SIZE=-2 is not a non-negative integer"
        );
        assert_eq!(err(&[("RANK", "0")]), "RANK is set but WORLD_SIZE is not");
        assert!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")])
                .starts_with("MASTER_PORT=0 is not a port the ranks can meet at"),
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "0")]),
            "WORLD_SIZE=0: a job needs at least one process"
        );
        assert_eq!(
            err(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2")
            ]),
            "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")]),
            "MASTER_PORT=70000 is not a port number (1 to 65535)"
        );
    }

    #[test]
    fn open_mpi_variables() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_COMM_WORLD_NODE_RANK", "1"),
        ])
        .unwrap();
        assert_eq!(e.source, EnvSource::OpenMpi);
        assert_eq!(
            (
                e.rank,
                e.world_size,
                e.local_rank,
                e.local_world_size,
                e.node_rank
            ),
            (3, 4, 1, 2, 1)
        );
        assert_eq!(
            err(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")]),
            "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"
        );
        assert_eq!(
            err(&[("OMPI_COMM_WORLD_RANK", "1")]),
            "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"
        );
    }

    #[test]
    fn slurm_variables() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
        ])
        .unwrap();
        assert_eq!(e.source, EnvSource::Slurm);
        assert_eq!(
            (
                e.rank,
                e.world_size,
                e.local_rank,
                e.local_world_size,
                e.node_rank
            ),
            (5, 7, 1, 2, 2)
        );
        assert_eq!(e.master_addr.as_deref(), Some("10.1.2.3"));
        // The step's task count wins over the allocation's; MASTER_ADDR over the launch node.
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
            ("MASTER_ADDR", "node1"),
        ])
        .unwrap();
        assert_eq!((e.world_size, e.local_world_size), (4, 4));
        assert_eq!(e.master_addr.as_deref(), Some("node1"));
        // One node by default.
        let e = env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]).unwrap();
        assert_eq!((e.local_world_size, e.node_rank), (2, 0));
        assert_eq!(
            err(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_NODEID", "3"),
                ("SLURM_TASKS_PER_NODE", "2(x2)")
            ]),
            "SLURM_TASKS_PER_NODE=2(x2) lists 2 node(s), but SLURM_NODEID is 3"
        );
        assert_eq!(
            err(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_TASKS_PER_NODE", "2(x2")
            ]),
            "SLURM_TASKS_PER_NODE=2(x2 is not a Slurm task list like 2(x3),1"
        );
        assert_eq!(
            err(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")]),
            "SLURM_PROCID=2 is not below SLURM_NTASKS=2"
        );
    }

    #[test]
    fn precedence_torchrun_then_open_mpi_then_slurm() {
        let all = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
        ];
        assert_eq!(env(&all).unwrap().source, EnvSource::Torchrun);
        assert_eq!(env(&all[2..]).unwrap().source, EnvSource::OpenMpi);
        assert_eq!(env(&all[4..]).unwrap().source, EnvSource::Slurm);
        // Empty values count as unset.
        assert_eq!(
            env(&[("RANK", ""), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])
                .unwrap()
                .source,
            EnvSource::Slurm
        );
    }
}
