//! Compiles every CUDA source (`kernels/cuda/*.cu`) with NVRTC for sm_80 and sm_90 and checks
//! that the PTX defines exactly the entry points `meshgrad_kernels::cuda::SOURCES` lists.
//!
//! Needs no GPU, only the NVRTC library and the CUDA headers (see `.ci/cuda_compile.sh`:
//! `LD_LIBRARY_PATH` and `CUDA_INCLUDE_DIRS`). When NVRTC cannot be loaded the test prints why
//! and passes, unless `MESHGRAD_REQUIRE_NVRTC=1`, in which case it fails with the reason.
#![cfg(feature = "cuda")]

use meshgrad_kernels::cuda::{self, ARCHS, SOURCES};

/// Whether the environment demands that NVRTC be present.
fn required() -> bool {
    std::env::var("MESHGRAD_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn every_source_compiles_for_sm80_and_sm90_with_its_listed_entry_points() {
    if let Err(why) = cuda::nvrtc_available() {
        assert!(
            !required(),
            "MESHGRAD_REQUIRE_NVRTC=1 but NVRTC cannot be used: {why}"
        );
        eprintln!("skipping the NVRTC compile check: {why} (set MESHGRAD_REQUIRE_NVRTC=1 to fail)");
        return;
    }
    let dump = std::env::var("MESHGRAD_DUMP_ENTRIES").is_ok();
    let mut failures = Vec::new();
    for src in SOURCES {
        for arch in ARCHS {
            let ptx = match cuda::compile(src, arch) {
                Ok(p) => p,
                Err(e) => {
                    failures.push(e.to_string());
                    continue;
                }
            };
            let found = cuda::ptx_entries(&ptx);
            if dump && arch == ARCHS[0] {
                println!("{} {:?}", src.name, found);
            }
            for want in src.entries {
                if !found.contains(want) {
                    failures.push(format!(
                        "{} (sm_{arch}): entry point `{want}` missing from the PTX",
                        src.name
                    ));
                }
            }
            for got in &found {
                if !src.entries.contains(got) {
                    failures.push(format!(
                        "{} (sm_{arch}): PTX entry `{got}` is not listed in SOURCES",
                        src.name
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn sources_are_unique_and_nonempty() {
    let mut names: Vec<_> = SOURCES.iter().map(|s| s.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), SOURCES.len(), "duplicate source names");
    for s in SOURCES {
        assert!(!s.entries.is_empty(), "{} lists no entry points", s.name);
        assert!(
            s.source.contains("CPU reference"),
            "{} names no CPU reference",
            s.name
        );
    }
}
