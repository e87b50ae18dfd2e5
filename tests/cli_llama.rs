//! `eval` and `generate` on Hugging Face `LlamaForCausalLM` folders written by transformers
//! (`nn/tests/fixtures/hf_llama`): transformers' loss and greedy ids, as
//! `nn/tests/hf_llama_reference.py` and `nn/tests/hf_llama_eval_reference.py` computed them.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("nn/tests/fixtures/hf_llama")
}

#[test]
fn eval_and_generate_give_transformers_loss_and_greedy_ids() {
    let dir = tmpdir("llama-hf");
    let eval_expected = read_json(&fixtures().join("eval_expected.json"));
    let expected = read_json(&fixtures().join("expected.json"));
    // The ids as raw little-endian u16 (a .bin file without a shard header).
    let ids: Vec<u16> = eval_expected["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u16)
        .collect();
    let data = dir.join("ids.bin");
    std::fs::write(&data, bytemuck_bytes(&ids)).unwrap();
    let prompt: Vec<String> = expected["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    for case in ["gqa_untied", "tied_old_config"] {
        let folder = fixtures().join(case);
        let o = eval(&folder, &data);
        assert_ok(&o);
        let want = eval_expected[case].as_f64().unwrap();
        let got = loss_line(&o);
        assert!(
            (got - want).abs() < 1e-5,
            "{case}: eval {got} vs transformers {want}"
        );
        let o = bin()
            .args(["generate", "--checkpoint", folder.to_str().unwrap()])
            .args(["--prompt-tokens", &prompt.join(",")])
            .args(["--temperature", "0", "--max-new-tokens", "8"])
            .output()
            .unwrap();
        assert_ok(&o);
        let (out, _) = text(&o);
        let want: Vec<String> = expected["cases"][case]["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(
            out.lines().last().unwrap(),
            format!("ids={}", want.join(",")),
            "{case}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Little-endian bytes of `ids`.
fn bytemuck_bytes(ids: &[u16]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}
