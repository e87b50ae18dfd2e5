//! The integration tests of meshgrad (the CLI and the library), one module per file under `tests/`,
//! built as one test binary: the crate links once instead of once per file (CI time and disk). One
//! file's tests: `cargo test --release --test integration <file>::`.

mod common;

mod cli;
mod cli_bert;
mod cli_checks;
mod cli_compare;
mod cli_cp;
mod cli_data;
mod cli_ep;
mod cli_flight;
mod cli_init_from;
mod cli_llama;
mod cli_parallel;
mod cli_pipeline;
mod cli_plan;
mod cli_precision;
mod cli_reference;
mod cli_resume;
mod cli_run_safety;
mod cli_schedule;
mod cli_selftest;
mod cli_tokenizer;
mod cli_tp;
mod cli_trace;
mod cli_zero;
mod module_api;
mod reference_pipeline;
mod reference_tp;
mod test_targets;
