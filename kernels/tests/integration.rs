//! The integration tests of meshgrad-kernels, one module per file under `tests/`, built as one test
//! binary: the crate links once instead of once per file (CI time and disk). One file's tests:
//! `cargo test --release -p meshgrad-kernels --test integration <file>::`.

mod edge_cases;
mod simd_paths;
