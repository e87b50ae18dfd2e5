//! Devices a tensor can live on.

/// Where a tensor's storage lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory, computed with the CPU kernels.
    Cpu,
    /// CUDA device with the given ordinal (requires the `cuda` feature).
    Cuda(usize),
}

impl Device {
    /// Checks that this device can be used in this build: `Cuda(n)` without the `cuda` feature is
    /// an error that says so.
    pub fn check_available(self) -> crate::Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => crate::cuda_backend::context(n).map(|_| ()),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(crate::Error::CudaNotBuilt(self)),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            if let Ok(n) = n.parse() {
                return Ok(Device::Cuda(n));
            }
        }
        crate::bail!("unknown device '{s}' (expected cpu, cuda or cuda:N)")
    }
}
