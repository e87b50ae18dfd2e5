//! The integration tests of meshgrad-autograd, one module per file under `tests/`, built as one
//! test binary: the crate links once instead of once per file (CI time and disk). One file's tests:
//! `cargo test --release -p meshgrad-autograd --test integration <file>::`.

mod common;

mod checkpoint;
mod display;
mod engine;
mod gradcheck_fused;
mod gradcheck_ops;
mod overload;
mod split_backward;
