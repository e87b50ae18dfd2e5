//! The integration tests of meshgrad-parallel, one module per file under `tests/`, built as one
//! test binary: the crate links once instead of once per file (CI time and disk). One file's tests:
//! `cargo test --release -p meshgrad-parallel --test integration <file>::`.

mod a2a;
mod common;

mod bert_stages_tp;
mod checkpoint;
mod comm;
mod ddp;
mod delayed_init;
mod expert_zero;
mod gpt_stages_tp;
mod megatron_table1;
mod memory_report;
mod mesh;
mod pipeline_execute;
mod pipeline_partition;
mod pipeline_profile;
mod pipeline_schedule;
mod pipeline_trace;
mod plan_memory;
mod ring_attention;
mod tcp;
mod tensor_parallel;
mod tensor_parallel_bert;
mod zero;
mod zero_any_module;
