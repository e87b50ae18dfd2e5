//! Llama against Hugging Face transformers: checkpoints written by transformers (the fixtures of
//! `tests/hf_llama_reference.py`, new and old `config.json` forms, tied and untied heads,
//! grouped-query attention) give transformers' loss and greedy ids; a folder meshgrad writes
//! reads back identically; bad `config.json` files are one-line errors naming the file.
//!
//! The other direction (transformers loading a folder meshgrad wrote) needs Python: the ignored
//! test `export_for_transformers` writes the folders and `tests/hf_llama_check.py` compares (see
//! `tests/fixtures/hf_llama/README.md`).

use std::path::{Path, PathBuf};

use meshgrad_nn::llama::RopeAngles;
use meshgrad_nn::state::{
    llama_config_from_hf_json, load_llama, load_llama_into, read_llama_config, save_llama,
};
use meshgrad_nn::{Llama, LlamaConfig, Module, StageSpec};
use meshgrad_tensor::{DType, Device};
use serde_json::Value;

use crate::hf_fixture;

use hf_fixture::{batch, ints};

fn fixtures() -> PathBuf {
    hf_fixture::folder("hf_llama")
}

fn expected() -> Value {
    hf_fixture::expected("hf_llama")
}

#[test]
fn transformers_checkpoints_give_transformers_loss_and_greedy_ids() {
    let e = expected();
    let (ids, targets) = batch(&e);
    let ignore = e["ignore_index"].as_i64();
    let prompt: Vec<u32> = ints(&e["prompt"]).iter().map(|&x| x as u32).collect();
    for (case, tied, kv, theta) in [
        ("gqa_untied", false, 2, 10_000.0),
        ("tied_old_config", true, 4, 500_000.0),
    ] {
        let dir = fixtures().join(case);
        let want = &e["cases"][case];
        let model = load_llama(&dir, DType::F32, Device::Cpu).unwrap();
        let c = model.config;
        assert_eq!(
            (c.tie_embeddings, c.n_kv_head, c.rope_theta, c.norm_eps),
            (tied, kv, theta, 1e-6),
            "{case}"
        );
        let names: Vec<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names.contains(&"lm_head.weight".to_string()),
            !tied,
            "{case}"
        );
        let loss: f64 = model
            .loss(&ids, &targets, ignore)
            .unwrap()
            .tensor()
            .item()
            .unwrap();
        let (f32_ref, f64_ref) = (
            want["loss_f32"].as_f64().unwrap(),
            want["loss_f64"].as_f64().unwrap(),
        );
        assert!(
            (loss - f32_ref).abs() < 1e-5 && (loss - f64_ref).abs() < 1e-5,
            "{case}: meshgrad loss {loss} vs transformers {f32_ref} (f32), {f64_ref} (f64)"
        );
        let greedy = model
            .generate(&prompt, 8, 0.0, None, 0, |_| Ok(()))
            .unwrap();
        let want_ids: Vec<u32> = ints(&want["greedy"]).iter().map(|&x| x as u32).collect();
        assert_eq!(greedy, want_ids, "{case}: greedy ids");
        // transformers' "f64" model still computes its RoPE tables and its RMSNorm in f32, so
        // the f64 losses agree to f32 rounding; meshgrad's f64 loss with the exact (fused)
        // rotation is as close.
        let m64 = load_llama(&dir, DType::F64, Device::Cpu).unwrap();
        let l64: f64 = m64
            .loss(&ids, &targets, ignore)
            .unwrap()
            .tensor()
            .item()
            .unwrap();
        let fused = Llama::new(
            LlamaConfig {
                rope_angles: RopeAngles::Fused,
                ..c
            },
            0,
            DType::F64,
            Device::Cpu,
        )
        .unwrap();
        load_llama_into(&fused, &dir).unwrap();
        let lf: f64 = fused
            .loss(&ids, &targets, ignore)
            .unwrap()
            .tensor()
            .item()
            .unwrap();
        println!(
            "{case}: loss meshgrad f32 {loss:.9} / f64 {l64:.12} / f64 fused rotation {lf:.12}, \
             transformers f32 {f32_ref:.9} / f64 {f64_ref:.12}; differences {:.2e} (f32), \
             {:.2e} (f64), {:.2e} (f64 fused)",
            (loss - f32_ref).abs(),
            (l64 - f64_ref).abs(),
            (lf - f64_ref).abs()
        );
        assert_eq!(c.rope_angles, RopeAngles::Transformers, "{case}");
        assert!(
            (l64 - f64_ref).abs() < 1e-6,
            "{case}: f64 loss {l64} vs {f64_ref}"
        );
        assert!(
            (lf - f64_ref).abs() < 1e-6,
            "{case}: fused f64 loss {lf} vs {f64_ref}"
        );
    }
}

/// A scratch folder of this test process.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-llama-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn small(tied: bool) -> LlamaConfig {
    let mut c = LlamaConfig::new(40, 16, 16, 3, 4);
    c.n_kv_head = 2;
    c.intermediate_size = 24;
    c.tie_embeddings = tied;
    c
}

#[test]
fn saved_folders_read_back_identically_whole_and_by_stage() {
    for tied in [false, true] {
        let model = Llama::new(small(tied), 3, DType::F32, Device::Cpu).unwrap();
        let dir = scratch(&format!("save-{tied}"));
        save_llama(&model, &dir).unwrap();
        // Read from a folder, a config rounds its rotation as transformers does.
        let read = read_llama_config(&dir).unwrap();
        assert_eq!(read.rope_angles, RopeAngles::Transformers);
        assert_eq!(
            LlamaConfig {
                rope_angles: RopeAngles::Fused,
                ..read
            },
            model.config
        );
        let back = load_llama(&dir, DType::F32, Device::Cpu).unwrap();
        for ((n, p), (m, q)) in model.named_parameters().iter().zip(back.named_parameters()) {
            assert_eq!(n, &m);
            assert_eq!(
                p.tensor().to_vec_f64().unwrap(),
                q.tensor().to_vec_f64().unwrap(),
                "{n}"
            );
        }
        // A stage takes its own tensors of the whole model's folder.
        let spec = StageSpec::new(1..3, false, true);
        let stage = Llama::new_stage(small(tied), spec, 99, DType::F32, Device::Cpu).unwrap();
        load_llama_into(&stage, &dir).unwrap();
        let whole: std::collections::HashMap<String, Vec<f64>> = model
            .named_parameters()
            .into_iter()
            .map(|(n, p)| (n, p.tensor().to_vec_f64().unwrap()))
            .collect();
        for (n, p) in stage.named_parameters() {
            assert_eq!(p.tensor().to_vec_f64().unwrap(), whole[&n], "stage {n}");
        }
        // A stage is not a Hugging Face folder.
        let e = save_llama(&stage, scratch("stage"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage") && !e.contains('\n'), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

const GOOD: &str = r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-6,
  "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": false}"#;

/// `GOOD` with `key` set to `value` (JSON text), or removed when `value` is `None`.
fn with(key: &str, value: Option<&str>) -> String {
    let mut v: Value = serde_json::from_str(GOOD).unwrap();
    let obj = v.as_object_mut().unwrap();
    match value {
        Some(x) => {
            obj.insert(key.into(), serde_json::from_str(x).unwrap());
        }
        None => {
            obj.remove(key);
        }
    }
    v.to_string()
}

#[test]
fn config_json_in_both_forms_and_its_defaults() {
    let old = llama_config_from_hf_json(GOOD).unwrap();
    let new = llama_config_from_hf_json(&with(
        "rope_parameters",
        Some(r#"{"rope_type": "default", "rope_theta": 10000.0}"#),
    ))
    .unwrap();
    assert_eq!(old, new);
    let moved = with("rope_theta", None);
    let mut v: Value = serde_json::from_str(&moved).unwrap();
    v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    assert_eq!(
        llama_config_from_hf_json(&v.to_string())
            .unwrap()
            .rope_theta,
        500_000.0
    );
    let mha = llama_config_from_hf_json(&with("num_key_value_heads", None)).unwrap();
    assert_eq!(mha.n_kv_head, mha.n_head);
    let untied = llama_config_from_hf_json(&with("tie_word_embeddings", None)).unwrap();
    assert!(!untied.tie_embeddings);
}

#[test]
fn bad_config_json_files_are_one_line_errors_naming_the_file() {
    let cases: Vec<(String, &str)> = vec![
        (with("hidden_size", None), "missing key hidden_size"),
        (
            with("rope_scaling", Some(r#"{"type": "linear", "factor": 2.0}"#)),
            "rope_scaling",
        ),
        (
            with(
                "rope_parameters",
                Some(r#"{"rope_type": "llama3", "rope_theta": 1.0}"#),
            ),
            "rope_type \"llama3\"",
        ),
        (with("attention_bias", Some("true")), "attention_bias"),
        (with("mlp_bias", Some("true")), "mlp_bias"),
        (
            with("num_key_value_heads", Some("3")),
            "n_kv_head 3 does not divide n_head 4",
        ),
        (with("hidden_act", Some("\"gelu\"")), "hidden_act"),
        (with("model_type", Some("\"mistral\"")), "model_type"),
        (with("head_dim", Some("16")), "head_dim 16"),
        (
            with("vocab_size", Some("-1")),
            "vocab_size must be a non-negative integer",
        ),
        ("{not json".to_string(), "invalid JSON"),
    ];
    for (i, (text, key)) in cases.iter().enumerate() {
        let dir = scratch(&format!("bad-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), text).unwrap();
        let e = load_llama(&dir, DType::F32, Device::Cpu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!e.contains('\n'), "{e}");
        assert!(e.contains(key), "{e:?} should say {key:?}");
        assert!(e.contains("config.json"), "{e:?} should name the file");
        let _ = std::fs::remove_dir_all(&dir);
    }
    // Weights that do not fit the config name the tensor and both shapes.
    let dir = scratch("shape");
    let model = Llama::new(small(false), 3, DType::F32, Device::Cpu).unwrap();
    save_llama(&model, &dir).unwrap();
    let mut other = small(false);
    other.intermediate_size = 32;
    let cfg = meshgrad_nn::state::llama_hf_config_json(&other, DType::F32).unwrap();
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = load_llama(&dir, DType::F32, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("[24, 16]"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    // No weights at all.
    let dir = scratch("noweights");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), GOOD).unwrap();
    let e = load_llama(&dir, DType::F32, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("model.safetensors") && !e.contains('\n'), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes meshgrad Llama folders for transformers to load, with meshgrad's loss on the fixture
/// ids beside them (`meshgrad_expected.json`). Run it, then the check script:
///
/// ```text
/// cargo test --release -p meshgrad-nn --test integration -- --ignored llama_hf::export_for_transformers
/// python nn/tests/hf_llama_check.py target/llama_export
/// ```
#[test]
#[ignore = "writes folders for tests/hf_llama_check.py (needs Python with transformers)"]
fn export_for_transformers() {
    let out = std::env::var("MESHGRAD_LLAMA_EXPORT").map_or_else(
        |_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/llama_export"),
        PathBuf::from,
    );
    let e = expected();
    let (ids, targets) = batch(&e);
    let ignore = e["ignore_index"].as_i64();
    let mut report = serde_json::Map::new();
    for (case, tied) in [("meshgrad_untied", false), ("meshgrad_tied", true)] {
        let mut c = LlamaConfig::new(64, 32, 32, 2, 4);
        c.n_kv_head = 2;
        c.intermediate_size = 48;
        // A base other than the default, so a reader that missed it would differ.
        c.rope_theta = if tied { 500_000.0 } else { 10_000.0 };
        c.tie_embeddings = tied;
        let model = Llama::new(c, 11, DType::F32, Device::Cpu).unwrap();
        // Larger weights than the N(0, 0.02) start (N(0, 0.3), norms left at one), so the
        // logits differ clearly.
        for (n, p) in model.named_parameters() {
            if n.ends_with("norm.weight") {
                continue;
            }
            let t = p.tensor();
            t.copy_from(&t.mul_scalar(15.0).unwrap()).unwrap();
        }
        let loss: f64 = model
            .loss(&ids, &targets, ignore)
            .unwrap()
            .tensor()
            .item()
            .unwrap();
        let prompt: Vec<u32> = ints(&e["prompt"]).iter().map(|&x| x as u32).collect();
        let greedy = model
            .generate(&prompt, 8, 0.0, None, 0, |_| Ok(()))
            .unwrap();
        save_llama(&model, out.join(case)).unwrap();
        report.insert(
            case.into(),
            serde_json::json!({"loss": loss, "greedy": greedy}),
        );
        println!("{case}: meshgrad loss {loss:.8}, greedy {greedy:?}");
    }
    let doc = serde_json::json!({
        "ids": e["ids"], "targets": e["targets"], "ignore_index": e["ignore_index"],
        "prompt": e["prompt"], "cases": report,
    });
    std::fs::write(
        out.join("meshgrad_expected.json"),
        serde_json::to_string_pretty(&doc).unwrap(),
    )
    .unwrap();
    println!("wrote {}", out.display());
}

/// A folder whose weights are shards listed in `model.safetensors.index.json` (how large
/// checkpoints come) loads like a single file; an index that misplaces a tensor is an error
/// naming the index.
#[test]
fn sharded_folders_load_through_their_index() {
    let model = Llama::new(small(true), 3, DType::F32, Device::Cpu).unwrap();
    let dir = scratch("sharded");
    save_llama(&model, &dir).unwrap();
    let all = meshgrad_nn::state::load_safetensors(dir.join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let (a, b) = all.split_at(all.len() / 2);
    let files = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut map = serde_json::Map::new();
    for (file, part) in files.iter().zip([a, b]) {
        meshgrad_nn::state::save_safetensors(dir.join(file), part, None).unwrap();
        for (n, _) in part {
            map.insert(n.clone(), Value::String(file.to_string()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let back = load_llama(&dir, DType::F32, Device::Cpu).unwrap();
    for ((n, p), (_, q)) in model.named_parameters().iter().zip(back.named_parameters()) {
        assert_eq!(
            p.tensor().to_vec_f64().unwrap(),
            q.tensor().to_vec_f64().unwrap(),
            "{n}"
        );
    }
    map.insert("model.norm.weight".into(), Value::String(files[0].into()));
    // The tied model's last tensor, in the second shard.
    assert!(b.iter().any(|(n, _)| n == "model.norm.weight"));
    let index = serde_json::json!({"weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let e = load_llama(&dir, DType::F32, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("model.norm.weight"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Llama-2-style `tokenizer.json` (SentencePiece-converted BPE with byte fallback, `<s>`
/// prepended; `tests/hf_llama_tokenizer_reference.py`) encodes and decodes as transformers'
/// fast tokenizer does.
#[test]
fn llama_tokenizer_json_gives_transformers_ids() {
    let dir = fixtures().join("tokenizer");
    let tok = meshgrad_nn::tokenizer::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let e: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    assert_eq!(tok.vocab_size() as u64, e["vocab_size"].as_u64().unwrap());
    let ids = |v: &Value| -> Vec<u32> { ints(v).iter().map(|&x| x as u32).collect() };
    for case in e["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        let plain = ids(&case["ids_without_special"]);
        assert_eq!(tok.encode(text, false).unwrap(), plain, "{text:?}");
        assert_eq!(
            tok.decode(&plain, true).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
}
