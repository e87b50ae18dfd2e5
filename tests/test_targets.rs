//! With `autotests = false`, a new file under a crate's `tests/` builds only when it is listed:
//! as a module of that crate's `tests/integration.rs`, or as its own `[[test]]` in `Cargo.toml`.
//! This check fails for a file that is neither, so no test file is silently left out.

use std::path::Path;

const CRATES: [&str; 6] = [".", "kernels", "tensor", "autograd", "nn", "parallel"];

#[test]
fn every_test_file_is_built() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for krate in CRATES {
        let dir = root.join(krate);
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        if !manifest.contains("autotests = false") {
            continue; // cargo finds every tests/*.rs by itself
        }
        let suite = std::fs::read_to_string(dir.join("tests/integration.rs")).unwrap_or_default();
        let mut files: Vec<_> = std::fs::read_dir(dir.join("tests"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "rs"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{krate}/tests has no .rs file");
        for f in files {
            let stem = f.file_stem().unwrap().to_string_lossy().into_owned();
            let own_target = manifest.contains(&format!("path = \"tests/{stem}.rs\""));
            let module = suite.lines().any(|l| l.trim() == format!("mod {stem};"));
            if !own_target && !module {
                missing.push(format!("{krate}/tests/{stem}.rs"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "test files built by no target (add `mod <file>;` to the crate's tests/integration.rs): {missing:?}"
    );
}
