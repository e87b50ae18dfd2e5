//! CUDA C kernels (`kernels/cuda/*.cu`), compiled by NVRTC at run time (first use) and cached.
//!
//! Every source is compiled with the shared header `kernels/cuda/common.cuh` prepended, and the
//! headers it includes (`#include "<name>.cuh"`, shared by a few kernel files, as `norm.cuh` by
//! the two norms) inlined before it; each part after a `#line 1 "<file>"` directive, so NVRTC's
//! messages name the right file and line. Each
//! [`KernelSource`] lists its `extern "C"` entry points, read from the source at build time
//! (`kernels/build.rs` with [`parse`]: an entry point is written once, in its `.cu` file);
//! `kernels/tests/nvrtc_compile.rs` compiles every source for sm_80 and sm_90 and checks that
//! exactly those entry points appear in the PTX.
//!
//! These kernels are compiled by NVRTC in CI (no GPU there; what ran on a GPU: README's Status).
//! `kernels/cuda/emu/run.sh` runs the kernel
//! sources on the CPU under a host emulation of the CUDA execution model and compares them with
//! naive references: evidence about their indexing, masking and synchronisation logic, not about
//! device behaviour. Each file's header comment names the CPU
//! reference (`kernels/src/cpu/*`, `kernels/src/rng.rs`) whose semantics it follows and where it
//! differs (order of sums, f32 accumulation for half types).
//!
//! NVRTC needs the CUDA headers `cuda_bf16.h` / `cuda_fp16.h` (not built into NVRTC 13.0): their
//! directories are taken from the environment variable `CUDA_INCLUDE_DIRS`, split on `:`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

/// The header prepended to every source: load/store through f32, block reductions, type lists.
pub const COMMON_HEADER: &str = include_str!("../../cuda/common.cuh");

/// One `.cu` file: its name, its text and its `extern "C"` entry points.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/`, e.g. `"softmax.cu"`.
    pub name: &'static str,
    /// The file's text (without [`COMMON_HEADER`]).
    pub source: &'static str,
    /// The headers of `kernels/cuda/` the file includes (`#include "<name>.cuh"`), by name with
    /// their text, in order.
    pub headers: &'static [(&'static str, &'static str)],
    /// Every `extern "C" __global__` function the file defines, in the order of the expanded
    /// source (read by `kernels/build.rs`).
    pub entries: &'static [&'static str],
}

impl KernelSource {
    /// The parts of the translation unit, by name with their text, in order: [`COMMON_HEADER`],
    /// the included headers, the file (what the entry-point reader [`parse`] reads).
    pub fn files(&self) -> Vec<(&'static str, &'static str)> {
        let mut files = vec![("common.cuh", COMMON_HEADER)];
        files.extend_from_slice(self.headers);
        files.push((self.name, self.source));
        files
    }

    /// The text handed to NVRTC: the [`files`](Self::files), each after a `#line 1` directive
    /// naming it (so NVRTC's messages point at the right file and line), the file's
    /// `#include` lines of its headers blanked (their text is already in front).
    pub fn full_source(&self) -> String {
        let mut text = String::new();
        for (name, part) in self.files() {
            let mut part = part.to_owned();
            for (h, _) in self.headers {
                part = part.replace(&format!("#include \"{h}\""), "");
            }
            text.push_str(&format!("#line 1 \"{name}\"\n{part}\n"));
        }
        text
    }
}

/// Looks up a source by file name.
pub fn source(name: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.name == name)
}

/// Architectures the kernels are compiled (and compile-checked) for: A100 and H100.
pub const ARCHS: [u32; 2] = [80, 90];

/// A failure to compile one source with NVRTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaCompileError {
    /// The `.cu` file.
    pub file: String,
    /// The target architecture (`sm_XX`).
    pub arch: u32,
    /// What went wrong: NVRTC's status and log, or why NVRTC could not be used.
    pub message: String,
}

impl std::fmt::Display for CudaCompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVRTC failed on kernels/cuda/{} for sm_{}: {}",
            self.file, self.arch, self.message
        )
    }
}

impl std::error::Error for CudaCompileError {}

/// Whether the NVRTC library can be loaded; `Err` says why not. cudarc (with `dynamic-loading`)
/// panics on first use when the library is missing, so call this first.
pub fn nvrtc_available() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names (and drops the
    // handles); it calls no function from them.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(format!(
            "the NVRTC library (libnvrtc.so, libnvrtc.so.13, ...) cannot be loaded; \
             LD_LIBRARY_PATH={:?}",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        ))
    }
}

/// The NVRTC options used for `arch`: `--gpu-architecture=sm_XX -std=c++17 -default-device`
/// and one `--include-path` per entry of `CUDA_INCLUDE_DIRS` (split on `:`, empty entries
/// skipped). No fast math: IEEE division and square root, fused multiply-add where the compiler
/// contracts (kernels that must match the CPU bit for bit use explicit `__fmul_rn`/`__fadd_rn`).
pub fn compile_options(arch: u32) -> CompileOptions {
    let include_paths = std::env::var("CUDA_INCLUDE_DIRS")
        .unwrap_or_default()
        .split(':')
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect();
    CompileOptions {
        include_paths,
        options: vec![
            format!("--gpu-architecture=sm_{arch}"),
            "-std=c++17".to_owned(),
            "-default-device".to_owned(),
        ],
        ..Default::default()
    }
}

/// Compiles `src` for `sm_{arch}` and returns the PTX text. The error names the file and carries
/// NVRTC's log.
pub fn compile(src: &KernelSource, arch: u32) -> Result<String, CudaCompileError> {
    let err = |message: String| CudaCompileError {
        file: src.name.to_owned(),
        arch,
        message,
    };
    nvrtc_available().map_err(err)?;
    let mut opts = compile_options(arch);
    opts.name = Some(src.name.to_owned());
    match compile_ptx_with_opts(src.full_source(), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError {
            nvrtc,
            options,
            log,
        }) => {
            let log = log.to_string_lossy();
            let hint = if log.contains("could not open source file") {
                "\n(hint: CUDA_INCLUDE_DIRS must list the directories of cuda_bf16.h and \
                 cuda_fp16.h, separated by ':')"
            } else {
                ""
            };
            Err(err(format!(
                "{nvrtc:?} with options {options:?}; log:\n{log}{hint}"
            )))
        }
        Err(e) => Err(err(format!("{e:?}"))),
    }
}

/// PTX compiled so far, by (file, arch).
type PtxCache = Mutex<HashMap<(&'static str, u32), Arc<String>>>;

/// The PTX of source `name` for `sm_{arch}`: compiled at the first request and cached for the
/// life of the process (a failure is not cached; the next call retries).
pub fn ptx(name: &str, arch: u32) -> Result<Arc<String>, CudaCompileError> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    let src = source(name).ok_or_else(|| CudaCompileError {
        file: name.to_owned(),
        arch,
        message: "no such kernel source".to_owned(),
    })?;
    let cache = CACHE.get_or_init(Default::default);
    if let Some(p) = cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(src.name, arch))
    {
        return Ok(p.clone());
    }
    // Compiled outside the lock: two threads may both compile a source once; either result is
    // the same PTX.
    let p = Arc::new(compile(src, arch)?);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((src.name, arch), p.clone());
    Ok(p)
}

/// The names of the `.entry` functions in a PTX text, in order of appearance.
pub fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start();
            let rest = rest
                .strip_prefix(".visible .entry ")
                .or_else(|| rest.strip_prefix(".entry "))?;
            let end = rest.find(['(', ' ']).unwrap_or(rest.len());
            Some(&rest[..end])
        })
        .collect()
}

mod abi;
mod entries;
pub mod parse;

pub use abi::*;
pub use entries::SOURCES;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_entry_names_are_parsed() {
        let ptx = "//\n.version 9.0\n.visible .entry softmax_fwd_f32(\n\t.param .u64 a\n)\n\
                   .entry local_one (\n.visible .func helper(\n";
        assert_eq!(ptx_entries(ptx), vec!["softmax_fwd_f32", "local_one"]);
    }

    #[test]
    fn options_name_the_arch_and_split_include_dirs() {
        // Only reads the variable; the value set by the environment (if any) is not assumed.
        let o = compile_options(90);
        assert!(o.options.contains(&"--gpu-architecture=sm_90".to_owned()));
        assert!(o.options.contains(&"-std=c++17".to_owned()));
        assert!(o.options.contains(&"-default-device".to_owned()));
        assert!(o
            .include_paths
            .iter()
            .all(|p| !p.is_empty() && !p.contains(':')));
    }

    #[test]
    fn full_source_starts_with_the_header_and_renames_the_file() {
        let s = source("softmax.cu").expect("softmax.cu is listed");
        let text = s.full_source();
        assert!(text.starts_with("#line 1 \"common.cuh\"\n"));
        assert!(text.contains("\n#line 1 \"softmax.cu\"\n"));
        assert!(text.ends_with(&format!("{}\n", s.source)));
        assert!(s.headers.is_empty());
        assert!(source("nope.cu").is_none());
    }

    #[test]
    fn included_headers_come_inlined_before_the_file() {
        for name in ["layer_norm.cu", "rms_norm.cu"] {
            let s = source(name).expect("listed");
            assert_eq!(s.headers.len(), 1, "{name}");
            assert_eq!(s.headers[0].0, "norm.cuh");
            let text = s.full_source();
            let (h, f) = (
                text.find("\n#line 1 \"norm.cuh\"\n").expect("header part"),
                text.find(&format!("\n#line 1 \"{name}\"\n"))
                    .expect("file part"),
            );
            assert!(h < f, "{name}: the header comes first");
            assert!(
                !text.contains("#include \"norm.cuh\""),
                "{name}: include blanked"
            );
            assert!(text.contains("__device__ void norm_fwd_impl"));
        }
    }
}
