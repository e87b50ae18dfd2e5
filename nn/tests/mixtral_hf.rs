//! Mixtral against Hugging Face transformers: `MixtralForCausalLM` folders written by
//! transformers (the fixtures of `tests/hf_mixtral_reference.py`: the classic expert layout with
//! grouped-query attention and an untied head; transformers 5's fused expert layout with a tied
//! head and a `config.json` that leaves `rms_norm_eps` and `rope_theta` to `MixtralConfig`'s
//! defaults) give transformers' cross-entropy and greedy ids.
//!
//! The other direction (transformers loading a folder meshgrad wrote) needs Python: the ignored
//! test `export_for_transformers` writes the folders and `tests/hf_mixtral_check.py` compares
//! (see `tests/fixtures/hf_mixtral/README.md`).

use std::path::{Path, PathBuf};

use meshgrad_nn::moe::MoeSettings;
use meshgrad_nn::state::hf_mixtral::{load_mixtral, save_mixtral};
use meshgrad_nn::{Llama, LlamaConfig, Module};
use meshgrad_tensor::{DType, Device, Tensor};
use serde_json::Value;

use crate::hf_fixture;

use hf_fixture::{batch, ints};

fn fixtures() -> PathBuf {
    hf_fixture::folder("hf_mixtral")
}

fn expected() -> Value {
    hf_fixture::expected("hf_mixtral")
}

fn loss(model: &Llama, e: &Value) -> f64 {
    let (ids, targets) = batch(e);
    model
        .loss(&ids, &targets, e["ignore_index"].as_i64())
        .unwrap()
        .tensor()
        .item()
        .unwrap()
}

fn prompt(e: &Value) -> Vec<u32> {
    ints(&e["prompt"]).iter().map(|&x| x as u32).collect()
}

#[test]
fn transformers_checkpoints_give_transformers_loss_and_greedy_ids() {
    let e = expected();
    // case, tied, kv heads, rope_theta, rms eps (the fused case's from MixtralConfig's defaults)
    for (case, tied, kv, theta, eps) in [
        ("classic_gqa_untied", false, 2, 10_000.0, 1e-6),
        ("fused_tied_defaults", true, 4, 1e6, 1e-5),
    ] {
        let dir = fixtures().join(case);
        let want = &e["cases"][case];
        let model = load_mixtral(&dir, DType::F32, Device::Cpu).unwrap();
        let c = model.config;
        assert_eq!(
            (c.tie_embeddings, c.n_kv_head, c.rope_theta, c.norm_eps),
            (tied, kv, theta, eps),
            "{case}"
        );
        let moe = c.moe.unwrap();
        assert_eq!(
            (
                moe.n_experts,
                moe.experts_per_token,
                moe.router_aux_loss_coef
            ),
            (4, 2, 0.02),
            "{case}"
        );
        // The cross-entropy alone (transformers' from its logits, without the router's loss).
        let l32 = loss(&model, &e);
        let (f32_ref, f64_ref) = (
            want["loss_f32"].as_f64().unwrap(),
            want["loss_f64"].as_f64().unwrap(),
        );
        let greedy = model
            .generate(&prompt(&e), 8, 0.0, None, 0, |_| Ok(()))
            .unwrap();
        let want_ids: Vec<u32> = ints(&want["greedy"]).iter().map(|&x| x as u32).collect();
        // transformers' "f64" model routes in f32 (`softmax(router_logits.float())`) and
        // normalises in f32; meshgrad's f64 model routes in f64.
        let m64 = load_mixtral(&dir, DType::F64, Device::Cpu).unwrap();
        let l64 = loss(&m64, &e);
        println!(
            "{case}: loss meshgrad f32 {l32:.9} / f64 {l64:.12}, transformers f32 {f32_ref:.9} / \
             f64 {f64_ref:.12}; relative differences {:.2e} (f32), {:.2e} (f64); greedy \
             {greedy:?}",
            (l32 - f32_ref).abs() / f32_ref,
            (l64 - f64_ref).abs() / f64_ref
        );
        assert!(
            (l32 - f32_ref).abs() <= 1e-5 * f32_ref,
            "{case}: meshgrad loss {l32} vs transformers {f32_ref} (f32)"
        );
        assert!(
            (l64 - f64_ref).abs() <= 1e-6 * f64_ref,
            "{case}: meshgrad f64 loss {l64} vs transformers {f64_ref}"
        );
        assert_eq!(greedy, want_ids, "{case}: greedy ids");
    }
}

/// A scratch folder of this test process.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-mixtral-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The fused layout reads as the classic one meshgrad writes back; a fused tensor of the wrong
/// shape is a one-line error naming it.
#[test]
fn fused_expert_layout_reads_as_the_classic_one() {
    let fused = fixtures().join("fused_tied_defaults");
    let model = load_mixtral(&fused, DType::F32, Device::Cpu).unwrap();
    let dir = scratch("resaved");
    save_mixtral(&model, &dir).unwrap();
    let names: Vec<String> = meshgrad_nn::state::load_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.contains(&"model.layers.1.block_sparse_moe.experts.3.w2.weight".into()));
    assert!(!names.iter().any(|n| n.contains(".mlp.")), "{names:?}");
    let back = load_mixtral(&dir, DType::F32, Device::Cpu).unwrap();
    for ((n, p), (_, q)) in model.named_parameters().iter().zip(back.named_parameters()) {
        assert_eq!(
            p.tensor().to_vec_f64().unwrap(),
            q.tensor().to_vec_f64().unwrap(),
            "{n}"
        );
    }
    // Expert 2's w1 is rows 0..16 of gate_up_proj[2], its w3 rows 16..32.
    let file = meshgrad_nn::state::load_safetensors(fused.join("model.safetensors")).unwrap();
    let gate_up = &file
        .iter()
        .find(|(n, _)| n == "model.layers.0.mlp.experts.gate_up_proj")
        .unwrap()
        .1;
    let row = |t: &Tensor, e: usize, r: usize| -> Vec<f64> {
        t.narrow(0, e, 1)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .narrow(0, r, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .to_vec_f64()
            .unwrap()
    };
    let params: std::collections::HashMap<String, Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.tensor().clone()))
        .collect();
    let w1 = &params["model.layers.0.block_sparse_moe.experts.2.w1.weight"];
    let w3 = &params["model.layers.0.block_sparse_moe.experts.2.w3.weight"];
    let as_expert = |t: &Tensor| t.unsqueeze(0).unwrap();
    assert_eq!(row(gate_up, 2, 5), row(&as_expert(w1), 0, 5));
    assert_eq!(row(gate_up, 2, 16 + 5), row(&as_expert(w3), 0, 5));
    // A gate_up_proj of 3 experts in a 4-expert model.
    let bad: Vec<(String, Tensor)> = file
        .into_iter()
        .map(|(n, t)| {
            if n == "model.layers.0.mlp.experts.gate_up_proj" {
                let t = t.narrow(0, 0, 3).unwrap().contiguous().unwrap();
                (n, t)
            } else {
                (n, t)
            }
        })
        .collect();
    let bad_dir = scratch("bad");
    std::fs::create_dir_all(&bad_dir).unwrap();
    std::fs::copy(fused.join("config.json"), bad_dir.join("config.json")).unwrap();
    meshgrad_nn::state::save_safetensors(bad_dir.join("model.safetensors"), &bad, None).unwrap();
    let Err(err) = load_mixtral(&bad_dir, DType::F32, Device::Cpu) else {
        panic!("a gate_up_proj of 3 experts loaded");
    };
    let err = err.to_string();
    assert!(!err.contains('\n'), "{err}");
    assert!(
        err.contains("model.layers.0.mlp.experts.gate_up_proj") && err.contains("[3, 32, 32]"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&bad_dir).unwrap();
}

/// Writes two meshgrad Mixtrals (vocab 64, hidden 32, 2 layers, 4 heads, 4 experts 16 wide, top
/// 2; one untied with 2 kv heads and rope_theta 1e4, one tied with 4 kv heads and rope_theta 5e5;
/// weights N(0, 0.3), norms one) as `MixtralForCausalLM` folders, with meshgrad's cross-entropy on
/// the fixture ids and greedy ids in `meshgrad_expected.json`, for `tests/hf_mixtral_check.py`:
///
/// ```text
/// cargo test --release -p meshgrad-nn --test integration -- --ignored mixtral_hf::export_for_transformers
/// /tmp/hfvenv/bin/python nn/tests/hf_mixtral_check.py target/mixtral_export
/// ```
#[test]
#[ignore = "writes folders for tests/hf_mixtral_check.py (needs Python with transformers)"]
fn export_for_transformers() {
    let out = std::env::var("MESHGRAD_MIXTRAL_EXPORT").map_or_else(
        |_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/mixtral_export"),
        PathBuf::from,
    );
    let e = expected();
    let mut report = serde_json::Map::new();
    for (case, tied) in [("meshgrad_untied", false), ("meshgrad_tied", true)] {
        let mut c = LlamaConfig::new(64, 32, 32, 2, 4);
        c.n_kv_head = if tied { 4 } else { 2 };
        c.intermediate_size = 16;
        // A base other than the default, so a reader that missed it would differ.
        c.rope_theta = if tied { 500_000.0 } else { 10_000.0 };
        c.tie_embeddings = tied;
        c.moe = Some(MoeSettings::new(4, 2));
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
        let loss = loss(&model, &e);
        let greedy = model
            .generate(&prompt(&e), 8, 0.0, None, 0, |_| Ok(()))
            .unwrap();
        save_mixtral(&model, out.join(case)).unwrap();
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
