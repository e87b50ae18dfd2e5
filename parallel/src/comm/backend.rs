//! Which communication backend a run uses: [`Backend`], the default from the device and the
//! environment ([`default_backend`]), and whether NCCL can run here ([`nccl_unavailable`]).

use meshgrad_tensor::{Device, Error, Result};

use super::env::{EnvSource, RankEnv};

/// A communication backend a run can choose (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Ranks as threads of one process ([`super::InProcessComm`]).
    Threads,
    /// One rank per process over TCP ([`super::tcp::TcpCommunicator`]): the processes that
    /// `meshgrad launch` or torchrun start, on the CPU.
    Tcp,
    /// One rank per MPI process (`comm::mpi`, feature `mpi`).
    Mpi,
    /// One rank per process and GPU over NCCL (`comm::nccl`, feature `nccl`).
    Nccl,
}

impl Backend {
    /// The name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Threads => "threads",
            Backend::Tcp => "tcp",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "threads" => Ok(Backend::Threads),
            "tcp" => Ok(Backend::Tcp),
            "mpi" => Ok(Backend::Mpi),
            "nccl" => Ok(Backend::Nccl),
            _ => Err(format!(
                "unknown backend {s:?} (expected threads, tcp, mpi or nccl)"
            )),
        }
    }
}

/// Whether this build has the NCCL backend (cargo feature `nccl`).
pub const NCCL_BUILT: bool = cfg!(feature = "nccl");

/// The backend a run uses when `--backend` is not given: NCCL for a CUDA device when this build
/// has it ([`NCCL_BUILT`]); MPI when the process was started by `mpirun` as one rank of several;
/// TCP when it is one of several processes with torchrun's variables (`meshgrad launch`,
/// torchrun); else ranks as threads (a single process). See [`default_backend_with`].
pub fn default_backend(device: Device, env: &RankEnv) -> Backend {
    default_backend_with(device, env, NCCL_BUILT)
}

/// [`default_backend`] with whether NCCL is built in given explicitly (a pure function).
pub fn default_backend_with(device: Device, env: &RankEnv, nccl_built: bool) -> Backend {
    match device {
        Device::Cuda(_) if nccl_built => Backend::Nccl,
        _ if env.source == EnvSource::OpenMpi && env.world_size > 1 => Backend::Mpi,
        _ if env.source == EnvSource::Torchrun && env.world_size > 1 => Backend::Tcp,
        _ => Backend::Threads,
    }
}

/// Why NCCL cannot run `needed` ranks on this machine, in one line, or `None` when it can:
/// not built with the `nccl` feature, or fewer CUDA devices than ranks (NCCL refuses two
/// ranks of one communicator on one GPU). `cuda_devices` is the number of visible devices.
pub fn nccl_unavailable_with(
    nccl_built: bool,
    cuda_devices: usize,
    needed: usize,
) -> Option<String> {
    if !nccl_built {
        return Some(
            "--backend nccl: meshgrad was built without NCCL support: rebuild with \
             `cargo build --release --features nccl`"
                .to_string(),
        );
    }
    if cuda_devices == 0 {
        return Some(
            "--backend nccl: no CUDA device is visible to this process (no NVIDIA driver, or \
             CUDA_VISIBLE_DEVICES hides them)"
                .to_string(),
        );
    }
    if cuda_devices < needed {
        return Some(format!(
            "--backend nccl: {needed} ranks on this node need {needed} GPUs (NCCL runs one rank \
             per GPU), but {cuda_devices} CUDA device(s) are visible"
        ));
    }
    None
}

/// [`nccl_unavailable_with`] for this build and this machine.
pub fn nccl_unavailable(needed: usize) -> Option<String> {
    #[cfg(feature = "nccl")]
    let devices = meshgrad_tensor::cuda_device_count();
    #[cfg(not(feature = "nccl"))]
    let devices = 0;
    nccl_unavailable_with(NCCL_BUILT, devices, needed)
}

/// `Ok` when NCCL can run `needed` ranks on this node, else the one-line reason as an error.
pub fn check_nccl(needed: usize) -> Result<()> {
    match nccl_unavailable(needed) {
        None => Ok(()),
        Some(why) => Err(Error::msg(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> RankEnv {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_vars(&|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())).unwrap()
    }

    #[test]
    fn default_backend_from_device_and_environment() {
        let single = env(&[]);
        let torchrun = env(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
        let mpirun = env(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        let mpi1 = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]);
        let gpu = Device::Cuda(0);
        // CPU runs: threads in one process, tcp between torchrun's processes, mpi under mpirun.
        for e in [&single, &mpi1] {
            assert_eq!(default_backend_with(Device::Cpu, e, true), Backend::Threads);
            assert_eq!(
                default_backend_with(Device::Cpu, e, false),
                Backend::Threads
            );
        }
        assert_eq!(
            default_backend_with(Device::Cpu, &mpirun, true),
            Backend::Mpi
        );
        assert_eq!(
            default_backend_with(Device::Cpu, &torchrun, true),
            Backend::Tcp
        );
        // A CUDA device: NCCL when built in, whatever launched the process.
        for e in [&single, &torchrun, &mpirun] {
            assert_eq!(default_backend_with(gpu, e, true), Backend::Nccl);
        }
        assert_eq!(default_backend_with(gpu, &mpirun, false), Backend::Mpi);
        assert_eq!(default_backend_with(gpu, &torchrun, false), Backend::Tcp);
        assert_eq!(
            default_backend(Device::Cpu, &single),
            Backend::Threads,
            "the real build's default for a CPU run"
        );
    }

    #[test]
    fn backend_names_round_trip() {
        for b in [Backend::Threads, Backend::Tcp, Backend::Mpi, Backend::Nccl] {
            assert_eq!(b.as_str().parse::<Backend>().unwrap(), b);
            assert_eq!(b.to_string(), b.as_str());
        }
        assert_eq!(
            "gloo".parse::<Backend>().unwrap_err(),
            "unknown backend \"gloo\" (expected threads, tcp, mpi or nccl)"
        );
    }

    #[test]
    fn nccl_unavailable_says_why_in_one_line() {
        let not_built = nccl_unavailable_with(false, 8, 1).unwrap();
        assert!(
            not_built.contains("built without NCCL support"),
            "{not_built}"
        );
        assert!(not_built.contains("--features nccl"), "{not_built}");
        let no_gpu = nccl_unavailable_with(true, 0, 1).unwrap();
        assert!(no_gpu.contains("no CUDA device"), "{no_gpu}");
        let few = nccl_unavailable_with(true, 1, 2).unwrap();
        assert!(few.contains("2 ranks on this node need 2 GPUs"), "{few}");
        assert!(few.contains("1 CUDA device(s)"), "{few}");
        assert_eq!(nccl_unavailable_with(true, 1, 1), None);
        for m in [not_built, no_gpu, few] {
            assert!(!m.contains('\n'), "{m}");
        }
        // This machine: without the feature, or without a GPU, NCCL is refused with a reason.
        if !NCCL_BUILT {
            assert!(nccl_unavailable(1).unwrap().contains("built without NCCL"));
            assert!(check_nccl(1).is_err());
        }
    }
}
