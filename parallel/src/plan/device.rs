//! Device kinds as data: what the planner needs to know of an accelerator and of the nodes that
//! hold it. Each preset is a TOML file in `parallel/devices/` (`h100`, `h200`, `a100-80gb`,
//! `a100-40gb`), built into the binary; a user passes their own file the same way
//! ([`DeviceKind::resolve`]). Every figure says in a comment of its file where it comes from.
//!
//! ```toml
//! name = "h100"
//! memory_gib = 80.0               # device memory
//! memory_bandwidth_gbps = 3350.0  # device memory bandwidth, GB/s
//! devices_per_node = 8            # the default of --devices-per-node
//! [peak_tflops]                   # dense peak per precision (fp8 optional)
//! f32 = 67.0
//! bf16 = 989.0
//! fp8 = 1979.0
//! [matmul]                        # the GEMM efficiency curve (see plan::cost)
//! peak_fraction = 0.75
//! half_dim = 64.0
//! [intra_node]                    # per device, each way
//! bandwidth_gbps = 450.0
//! latency_us = 3.0
//! [inter_node]                    # per node, each way
//! bandwidth_gbps = 400.0
//! latency_us = 10.0
//! # [tcp]: optional, processes over loopback TCP (what --device-kind cpu measures)
//! ```
//!
//! Unknown keys are refused (a misspelt key would otherwise be silently ignored), and every
//! error is one line naming the file and the key.

use std::fmt;
use std::path::Path;

use serde::Deserialize;

use super::memory::Precision;

/// The presets: (name, TOML text).
const PRESETS: [(&str, &str); 4] = [
    ("h100", include_str!("../../devices/h100.toml")),
    ("h200", include_str!("../../devices/h200.toml")),
    ("a100-80gb", include_str!("../../devices/a100-80gb.toml")),
    ("a100-40gb", include_str!("../../devices/a100-40gb.toml")),
];

/// The names of the built-in device kinds.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

/// A one-line error about a device kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError(pub String);

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceError {}

/// Dense peak FLOP/s per precision, in TFLOP/s.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTflops {
    /// f32 (without tensor cores).
    pub f32: f64,
    /// bf16 tensor cores, dense.
    pub bf16: f64,
    /// fp8 tensor cores, dense (absent on devices without fp8).
    pub fp8: Option<f64>,
}

/// How large matrix multiplications fall short of the peak (see `plan::cost`).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatmulCurve {
    /// The fraction of the peak a large GEMM reaches.
    pub peak_fraction: f64,
    /// Each dimension `d` of a GEMM keeps `d / (d + half_dim)` of `peak_fraction`.
    pub half_dim: f64,
}

/// A link: bandwidth each way and the latency of one message.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// GB/s (1e9 bytes per second), each way.
    pub bandwidth_gbps: f64,
    /// Microseconds.
    pub latency_us: f64,
}

impl Link {
    /// Bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bandwidth_gbps * 1e9
    }

    /// Seconds.
    pub fn latency_s(&self) -> f64 {
        self.latency_us * 1e-6
    }
}

/// A kind of device and the nodes that hold it (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceKind {
    /// The name (`h100`, ...).
    pub name: String,
    /// Device memory, GiB.
    pub memory_gib: f64,
    /// Device memory bandwidth, GB/s.
    pub memory_bandwidth_gbps: f64,
    /// Devices in one node (the default of `--devices-per-node`).
    pub devices_per_node: usize,
    /// Dense peaks.
    pub peak_tflops: PeakTflops,
    /// The GEMM efficiency curve.
    pub matmul: MatmulCurve,
    /// Between two devices of one node, per device.
    pub intra_node: Link,
    /// Between nodes, per node (its devices share it).
    pub inter_node: Link,
    /// Between processes of one machine over loopback TCP (`--device-kind cpu` measures it;
    /// the link of a run of processes under `meshgrad launch`, see [`DeviceKind::over_tcp`]).
    #[serde(default)]
    pub tcp: Option<Link>,
}

impl DeviceKind {
    /// The preset called `name`.
    pub fn preset(name: &str) -> Result<DeviceKind, DeviceError> {
        let Some((_, text)) = PRESETS.iter().find(|(n, _)| *n == name) else {
            return Err(DeviceError(format!(
                "unknown device kind '{name}' (expected {}, cpu or a FILE.toml)",
                preset_names().join(", ")
            )));
        };
        DeviceKind::parse(text, &format!("devices/{name}.toml"))
    }

    /// A preset by name, or a TOML file when `spec` ends in `.toml` or names an existing file.
    pub fn resolve(spec: &str) -> Result<DeviceKind, DeviceError> {
        let path = Path::new(spec);
        if spec.ends_with(".toml") || path.is_file() {
            let text = std::fs::read_to_string(path)
                .map_err(|e| DeviceError(format!("device file {spec}: cannot read it ({e})")))?;
            return DeviceKind::parse(&text, spec);
        }
        DeviceKind::preset(spec)
    }

    /// Parses a device file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<DeviceKind, DeviceError> {
        let d: DeviceKind = toml::from_str(text).map_err(|e| {
            // toml's message spans several lines (the offending source line, a caret): keep
            // its first line and the key it names.
            let msg = e.message().lines().next().unwrap_or("").to_string();
            let at = e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].lines().count().max(1);
                    format!(" (line {line})")
                })
                .unwrap_or_default();
            DeviceError(format!("device file {origin}: {msg}{at}"))
        })?;
        d.validate(origin)?;
        Ok(d)
    }

    fn validate(&self, origin: &str) -> Result<(), DeviceError> {
        let positive = [
            ("memory_gib", self.memory_gib),
            ("memory_bandwidth_gbps", self.memory_bandwidth_gbps),
            ("peak_tflops.f32", self.peak_tflops.f32),
            ("peak_tflops.bf16", self.peak_tflops.bf16),
            ("peak_tflops.fp8", self.peak_tflops.fp8.unwrap_or(1.0)),
            ("matmul.peak_fraction", self.matmul.peak_fraction),
            ("intra_node.bandwidth_gbps", self.intra_node.bandwidth_gbps),
            ("inter_node.bandwidth_gbps", self.inter_node.bandwidth_gbps),
            (
                "tcp.bandwidth_gbps",
                self.tcp.map_or(1.0, |l| l.bandwidth_gbps),
            ),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(DeviceError(format!(
                    "device file {origin}: {key} must be a positive number, not {v}"
                )));
            }
        }
        let non_negative = [
            ("matmul.half_dim", self.matmul.half_dim),
            ("intra_node.latency_us", self.intra_node.latency_us),
            ("inter_node.latency_us", self.inter_node.latency_us),
            ("tcp.latency_us", self.tcp.map_or(0.0, |l| l.latency_us)),
        ];
        for (key, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(DeviceError(format!(
                    "device file {origin}: {key} must be a number >= 0, not {v}"
                )));
            }
        }
        if self.matmul.peak_fraction > 1.0 {
            return Err(DeviceError(format!(
                "device file {origin}: matmul.peak_fraction must be at most 1, not {}",
                self.matmul.peak_fraction
            )));
        }
        if self.devices_per_node == 0 {
            return Err(DeviceError(format!(
                "device file {origin}: devices_per_node must be at least 1"
            )));
        }
        Ok(())
    }

    /// This device kind for ranks that are processes talking over TCP: its `[tcp]` link
    /// inside and between nodes; an error naming the device kind when it has none.
    pub fn over_tcp(&self) -> Result<DeviceKind, DeviceError> {
        let link = self.tcp.ok_or_else(|| {
            DeviceError(format!(
                "device kind {} has no [tcp] link (measured by --device-kind cpu)",
                self.name
            ))
        })?;
        Ok(DeviceKind {
            intra_node: link,
            inter_node: link,
            ..self.clone()
        })
    }

    /// Device memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_gib * (1u64 << 30) as f64) as u64
    }

    /// Dense peak FLOP/s at `precision`; an error for fp8 on a device without it.
    pub fn peak_flops(&self, precision: Precision) -> Result<f64, DeviceError> {
        let t = match precision {
            Precision::F32 => self.peak_tflops.f32,
            Precision::Bf16 => self.peak_tflops.bf16,
            Precision::Fp8 => self.peak_tflops.fp8.ok_or_else(|| {
                DeviceError(format!(
                    "device kind {} has no fp8 peak (peak_tflops.fp8); use --precision bf16",
                    self.name
                ))
            })?,
        };
        Ok(t * 1e12)
    }

    /// Device memory bandwidth in bytes per second.
    pub fn memory_bytes_per_s(&self) -> f64 {
        self.memory_bandwidth_gbps * 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_carry_the_datasheet_figures() {
        // Dense bf16 peaks and NVLink bandwidth each way, from NVIDIA's datasheets.
        let h100 = DeviceKind::preset("h100").unwrap();
        assert_eq!(h100.peak_flops(Precision::Bf16).unwrap(), 989e12);
        assert_eq!(h100.intra_node.bytes_per_s(), 900e9 / 2.0);
        assert_eq!(h100.memory_bytes(), 80 << 30);
        let a100 = DeviceKind::preset("a100-80gb").unwrap();
        assert_eq!(a100.peak_flops(Precision::Bf16).unwrap(), 312e12);
        assert_eq!(a100.intra_node.bytes_per_s(), 600e9 / 2.0);
        // Eight 200 Gb/s HDR adapters per node.
        assert_eq!(a100.inter_node.bytes_per_s(), 8.0 * 200e9 / 8.0);
        assert!(a100.peak_flops(Precision::Fp8).is_err());
        for name in preset_names() {
            let d = DeviceKind::preset(name).unwrap();
            assert_eq!(d.name, name);
            assert_eq!(d.devices_per_node, 8);
        }
        assert_eq!(
            DeviceKind::preset("a100-40gb").unwrap().memory_bytes(),
            40 << 30
        );
        assert_eq!(DeviceKind::preset("h200").unwrap().memory_gib, 141.0);
    }

    #[test]
    fn a_tcp_link_replaces_both_levels_for_ranks_over_tcp() {
        let good = include_str!("../../devices/h100.toml");
        let h100 = DeviceKind::parse(good, "h100.toml").unwrap();
        let e = h100.over_tcp().unwrap_err().0;
        assert!(e.contains("no [tcp] link"), "{e}");
        let text = format!("{good}\n[tcp]\nbandwidth_gbps = 0.5\nlatency_us = 50.0\n");
        let d = DeviceKind::parse(&text, "x.toml")
            .unwrap()
            .over_tcp()
            .unwrap();
        assert_eq!(d.intra_node.bytes_per_s(), 0.5e9);
        assert_eq!(d.inter_node.latency_us, 50.0);
        assert_eq!(d.peak_tflops, h100.peak_tflops);
    }

    #[test]
    fn bad_files_are_one_line_naming_the_file_and_key() {
        let good = include_str!("../../devices/h100.toml");
        let typo = good.replace("memory_gib", "memory_gb");
        let e = DeviceKind::parse(&typo, "my.toml").unwrap_err().0;
        assert!(e.starts_with("device file my.toml:"), "{e}");
        assert!(e.contains("memory_gb"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let text = good.replace("bandwidth_gbps = 450.0", "bandwidth_gbps = \"fast\"");
        let e = DeviceKind::parse(&text, "x.toml").unwrap_err().0;
        assert!(e.contains("x.toml") && !e.contains('\n'), "{e}");
        let text = good.replace("peak_fraction = 0.75", "peak_fraction = 0.0");
        let e = DeviceKind::parse(&text, "x.toml").unwrap_err().0;
        assert!(e.contains("matmul.peak_fraction"), "{e}");
        let text = format!("{good}\n[tcp]\nbandwidth_gbps = -1.0\nlatency_us = 50.0\n");
        let e = DeviceKind::parse(&text, "x.toml").unwrap_err().0;
        assert!(e.contains("tcp.bandwidth_gbps"), "{e}");
        let e = DeviceKind::resolve("tpu-v9").unwrap_err().0;
        assert!(e.contains("unknown device kind 'tpu-v9'"), "{e}");
        let e = DeviceKind::resolve("/nonexistent/dev.toml").unwrap_err().0;
        assert!(e.contains("cannot read"), "{e}");
    }
}
