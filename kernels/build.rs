//! Generates the table of CUDA kernel sources and their entry points (`SOURCES` in
//! `src/cuda/entries.rs`) from `cuda/*.cu`, so that an entry point is written once: in its `.cu`
//! file. Reads text only (no CUDA needed); the reader is `src/cuda/parse.rs`, shared with the
//! crate. A declaration it cannot read fails the build with the file and line. A `.cu` file may
//! `#include "<name>.cuh"` headers of `cuda/` that a few kernel files share (as `norm.cuh`, the
//! norms' row kernels); the table lists them with the file.

use std::fmt::Write as _;
use std::path::Path;

// The crate's reader of entry-point declarations. Its parameter lists and locations serve the
// crate's users (launch checks), not this script.
#[allow(dead_code)]
#[path = "src/cuda/parse.rs"]
mod parse;

/// The header prepended to every source; its macros are defined for every file.
const HEADER: &str = "common.cuh";

fn main() {
    let dir = Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo")).join("cuda");
    // The directory, so that an added or removed `.cu` reruns this script too.
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=cuda/{HEADER}");
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .unwrap_or_else(|e| fail(&format!("cannot read kernels/cuda/{name}: {e}")))
    };
    let header = read(HEADER);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| fail(&format!("cannot list kernels/cuda: {e}")))
        .map(|e| {
            e.unwrap_or_else(|e| fail(&format!("cannot list kernels/cuda: {e}")))
                .file_name()
                .into_string()
                .unwrap_or_else(|n| fail(&format!("kernels/cuda/{n:?}: not a UTF-8 name")))
        })
        .filter(|n| n.ends_with(".cu"))
        .collect();
    names.sort();
    if names.is_empty() {
        fail("no kernels/cuda/*.cu file");
    }

    let mut out = String::from(
        "/// Every `kernels/cuda/*.cu` file (except the prepended `common.cuh`), by name, with its\n\
         /// `extern \"C\" __global__` entry points in the order of the expanded source. Generated\n\
         /// by `kernels/build.rs` from the sources.\n\
         pub const SOURCES: &[KernelSource] = &[\n",
    );
    for name in &names {
        println!("cargo:rerun-if-changed=cuda/{name}");
        let text = read(name);
        let included = local_includes(name, &text);
        let mut parts = vec![(HEADER.to_owned(), header.clone())];
        for h in &included {
            println!("cargo:rerun-if-changed=cuda/{h}");
            parts.push((h.clone(), read(h)));
        }
        parts.push((name.clone(), text));
        let parts: Vec<(&str, &str)> = parts
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect();
        let entries = parse::entry_points(&parts).unwrap_or_else(|e| fail(&e.to_string()));
        if entries.is_empty() {
            fail(&format!(
                "kernels/cuda/{name}: no `extern \"C\" __global__ void name(...)` entry point"
            ));
        }
        if let Some(e) = entries.iter().find(|e| e.file != *name) {
            fail(&format!(
                "kernels/cuda/{}:{}: entry point `{}` is declared in a header; \
                 declare entry points in a .cu file",
                e.file, e.line, e.name
            ));
        }
        let src =
            |n: &str| format!("include_str!(concat!(env!(\"CARGO_MANIFEST_DIR\"), \"/cuda/{n}\"))");
        let headers: Vec<String> = included
            .iter()
            .map(|h| format!("({h:?}, {})", src(h)))
            .collect();
        writeln!(
            out,
            "    KernelSource {{\n        name: {name:?},\n        source: {},\n        headers: &[{}],\n        entries: &[",
            src(name),
            headers.join(", ")
        )
        .expect("write to a String");
        for e in &entries {
            writeln!(out, "            {:?},", e.name).expect("write to a String");
        }
        out.push_str("        ],\n    },\n");
    }
    out.push_str("];\n");

    let dest =
        Path::new(&std::env::var("OUT_DIR").expect("set by cargo")).join("kernel_sources.rs");
    std::fs::write(&dest, out)
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", dest.display())));
}

/// The headers `text` (the file `name`) includes with `#include "<header>.cuh"`, in order: each a
/// file of `cuda/` other than the common header, which every source gets anyway.
fn local_includes(name: &str, text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("#include \""))
        .filter_map(|rest| rest.strip_suffix('"'))
        .map(|h| {
            if h == HEADER || !h.ends_with(".cuh") || h.contains('/') {
                fail(&format!(
                    "kernels/cuda/{name}: `#include \"{h}\"`: a .cu file includes only shared \
                     headers of kernels/cuda/ (<name>.cuh), not {HEADER}"
                ));
            }
            h.to_owned()
        })
        .collect()
}

/// Stops the build with `message` (cargo shows it under "failed to run custom build command").
fn fail(message: &str) -> ! {
    eprintln!("error: reading the CUDA kernel entry points: {message}");
    std::process::exit(1);
}
