//! The integration tests of meshgrad-nn, one module per file under `tests/`, built as one test
//! binary: the crate links once instead of once per file (CI time and disk). One file's tests:
//! `cargo test --release -p meshgrad-nn --test integration <file>::`.

mod bert_ref;
mod hf_fixture;

mod bert;
mod bert_stages;
mod data_shards;
mod data_text;
mod gpt;
mod gpt_stages;
mod llama;
mod llama_hf;
mod mixtral_hf;
mod moe;
mod optim;
mod state;
