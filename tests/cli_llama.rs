//! `eval` and `generate` on Hugging Face `LlamaForCausalLM` folders written by transformers
//! (`nn/tests/fixtures/hf_llama`): transformers' loss and greedy ids, as
//! `nn/tests/hf_llama_reference.py` and `nn/tests/hf_llama_eval_reference.py` computed them.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("nn/tests/fixtures/hf_llama")
}

/// The fixture's token ids written to `dir/ids.bin` as raw little-endian u16 (a .bin file
/// without a shard header), for `eval --data`.
fn write_ids(dir: &Path, ids: &serde_json::Value) -> PathBuf {
    let ids: Vec<u16> = ids
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u16)
        .collect();
    let data = dir.join("ids.bin");
    std::fs::write(&data, bytemuck_bytes(&ids)).unwrap();
    data
}

/// A JSON list's items as command-line words.
fn json_words(list: &serde_json::Value) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect()
}

#[test]
fn eval_and_generate_give_transformers_loss_and_greedy_ids() {
    let dir = tmpdir("llama-hf");
    let eval_expected = read_json(&fixtures().join("eval_expected.json"));
    let expected = read_json(&fixtures().join("expected.json"));
    let data = write_ids(&dir, &eval_expected["ids"]);
    let prompt = json_words(&expected["prompt"]);
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

/// The same through `eval` and `generate` on the Mixtral folders transformers wrote
/// (`nn/tests/fixtures/hf_mixtral`, `nn/tests/hf_mixtral_reference.py`): the classic expert
/// layout and transformers 5's fused one. `eval` prints the cross-entropy alone, as
/// transformers' logits give it (the router's auxiliary loss is a training term).
#[test]
fn mixtral_eval_and_generate_give_transformers_loss_and_greedy_ids() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("nn/tests/fixtures/hf_mixtral");
    let dir = tmpdir("mixtral-hf");
    let expected = read_json(&fixtures.join("expected.json"));
    let data = write_ids(&dir, &expected["eval_ids"]);
    let prompt = json_words(&expected["prompt"]);
    for case in ["classic_gqa_untied", "fused_tied_defaults"] {
        let folder = fixtures.join(case);
        let want = &expected["cases"][case];
        let o = eval(&folder, &data);
        assert_ok(&o);
        let (got, eval_want) = (loss_line(&o), want["eval"].as_f64().unwrap());
        assert!(
            (got - eval_want).abs() <= 1e-5 * eval_want,
            "{case}: eval {got} vs transformers {eval_want}"
        );
        let o = bin()
            .args(["generate", "--checkpoint", folder.to_str().unwrap()])
            .args(["--prompt-tokens", &prompt.join(",")])
            .args(["--temperature", "0", "--max-new-tokens", "8"])
            .output()
            .unwrap();
        assert_ok(&o);
        let (out, _) = text(&o);
        let greedy: Vec<String> = want["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(
            out.lines().last().unwrap(),
            format!("ids={}", greedy.join(",")),
            "{case}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Little-endian bytes of `ids`.
fn bytemuck_bytes(ids: &[u16]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}

/// The tiny Llama of the training tests: 4 layers, 4 query heads sharing 2 key/value heads,
/// width 32 (MLP 256, Llama's rule), context 16, byte-level vocabulary, untied head unless
/// `extra` ties it; `steps` steps of 8 rows, validation every 2 steps.
fn train_llama(dir: &Path, tag: &str, steps: usize, extra: &[&str]) -> std::process::Output {
    let sets = [
        "model.n_layer=4",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "train.sample_tokens=0",
    ];
    train(
        dir,
        tag,
        steps,
        &sets,
        &[&["--model", "llama"], extra].concat(),
    )
}

/// The layouts of issue 26's acceptance list, each with its extra flags.
const LAYOUTS: [(&str, &[&str]); 10] = [
    ("dp2", &["--layout", "dp=2"]),
    ("fsdp2", &["--layout", "fsdp=2"]),
    ("hsdp2x2", &["--layout", "hsdp=2x2"]),
    ("tp2", &["--layout", "tp=2"]),
    ("tp2sp", &["--layout", "tp=2", "--sequence-parallel"]),
    ("pp2", &["--layout", "pp=2"]),
    ("pp2zb", &["--layout", "pp=2", "--schedule", "zb"]),
    ("dp2tp2pp2", &["--layout", "dp=2,tp=2,pp=2"]),
    // Untied: no stage holds a tied copy, so the shards are reduced during the weight passes.
    (
        "fsdp2pp2zb",
        &["--layout", "fsdp=2,pp=2", "--schedule", "zb"],
    ),
    (
        "tied_pp2",
        &["--layout", "pp=2", "--set", "model.tie_embeddings=true"],
    ),
];

#[test]
fn llama_trains_in_lockstep_with_one_device_under_every_layout() {
    let dir = tmpdir("llama-lockstep");
    for tied in [false, true] {
        let tie = format!("model.tie_embeddings={tied}");
        let single = format!("single_{tied}");
        assert_ok(&train_llama(&dir, &single, 4, &["--set", &tie]));
        let want = metrics(&dir, &single);
        assert!(want.iter().all(|s| s.loss.is_finite() && s.grad_norm > 0.0));
        for (tag, extra) in LAYOUTS {
            // The tied head runs under one layout: the others with the untied one.
            if tag.starts_with("tied") != tied {
                continue;
            }
            let o = train_llama(&dir, tag, 4, &[extra, &["--microbatches", "2"]].concat());
            assert_ok(&o);
            assert_lockstep(tag, &metrics(&dir, tag), &want, true);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama_reference_runs_are_bit_identical_to_one_device() {
    let dir = tmpdir("llama-reference");
    let numbers = |tag: &str| -> Vec<String> {
        std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                format!(
                    "{} {} {} {}",
                    v["step"], v["loss"], v["val_loss"], v["grad_norm"]
                )
            })
            .collect()
    };
    let weights = |tag: &str| std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    let reference = ["--reference", "--set", "train.row_group=2"];
    for tied in [false, true] {
        let tie = format!("model.tie_embeddings={tied}");
        let single = format!("single_{tied}");
        assert_ok(&train_llama(
            &dir,
            &single,
            3,
            &[&reference[..], &["--set", &tie]].concat(),
        ));
        let (want, want_weights) = (numbers(&single), weights(&single));
        for (tag, extra) in LAYOUTS {
            if tag.starts_with("tied") != tied {
                continue;
            }
            assert_ok(&train_llama(
                &dir,
                tag,
                3,
                &[&reference[..], extra].concat(),
            ));
            assert_eq!(numbers(tag), want, "{tag}: metrics");
            assert!(weights(tag) == want_weights, "{tag}: weights differ");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_trained_llama_is_a_hugging_face_folder_that_eval_export_and_resume_take() {
    let dir = tmpdir("llama-folder");
    let extra = ["--save-every", "2"];
    assert_ok(&train_llama(&dir, "run", 4, &extra));
    let run = dir.join("run");
    let config = read_json(&run.join("config.json"));
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["num_key_value_heads"], 2);
    assert_eq!(config["tie_word_embeddings"], false);
    // Evaluated from the final folder and from the last training checkpoint: the same model.
    let data = dir.join("eval.txt");
    std::fs::write(
        &data,
        "The quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let from_folder = loss_line(&eval(&run, &data));
    let from_ckpt = loss_line(&eval(&run.join("checkpoints/step-000004"), &data));
    assert!(
        from_folder.is_finite() && from_folder < 6.0,
        "{from_folder}"
    );
    assert!(
        (from_folder - from_ckpt).abs() < 1e-6,
        "{from_folder} vs {from_ckpt}"
    );
    // Exported from the step-2 checkpoint into a folder of its own.
    let out = dir.join("step2");
    let o = bin()
        .args([
            "export",
            "--checkpoint",
            run.join("checkpoints/step-000002").to_str().unwrap(),
        ])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_ok(&o);
    assert_eq!(read_json(&out.join("config.json"))["model_type"], "llama");
    // Resumed from step 2 to step 4: the same final loss as the run that went straight.
    let o = train_llama(
        &dir,
        "resumed",
        4,
        &[
            "--resume",
            run.join("checkpoints/step-000002").to_str().unwrap(),
        ],
    );
    assert_ok(&o);
    let (a, b) = (metrics(&dir, "run"), metrics(&dir, "resumed"));
    assert_eq!(a.last().unwrap().loss, b.last().unwrap().loss);
    // Resumed under other layouts (the checkpoint resharded): the same final loss to rounding.
    for (tag, layout) in [("resumed_tp2", "tp=2"), ("resumed_fsdp2", "fsdp=2")] {
        let step2 = run.join("checkpoints/step-000002");
        let o = train_llama(
            &dir,
            tag,
            4,
            &["--resume", step2.to_str().unwrap(), "--layout", layout],
        );
        assert_ok(&o);
        let got = metrics(&dir, tag).last().unwrap().loss;
        assert!(rel(got, a.last().unwrap().loss) <= 1e-5, "{tag}: {got}");
    }
    // A kv-head count that does not divide the heads, and heads that do not split over tp.
    let o = train_llama(&dir, "bad_kv", 1, &["--set", "model.n_kv_head=3"]);
    assert_one_line_error(&o, &["model.n_kv_head = 3", "model.n_head = 4"]);
    let o = train_llama(&dir, "bad_tp", 1, &["--layout", "tp=4"]);
    assert_one_line_error(&o, &["n_kv_head"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tiny Mixtral of the training tests: 2 layers of 4 experts (16 wide, top 2), 4 query
/// heads sharing 2 key/value heads, width 32, context 16, byte-level vocabulary; `steps` steps
/// of 8 rows, validation every 2 steps.
fn train_mixtral(dir: &Path, tag: &str, steps: usize, extra: &[&str]) -> std::process::Output {
    let sets = [
        "model.n_layer=2",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "train.sample_tokens=0",
    ];
    train(
        dir,
        tag,
        steps,
        &[&sets[..], &common::TINY_EXPERTS].concat(),
        &[&["--model", "mixtral"], extra].concat(),
    )
}

/// Experts that get no token on a rank have no gradient there: DDP and ZeRO launch their
/// buckets at the end instead of during the backward, and no other collective may come between
/// (the expert load was once reduced there: `mismatched collectives` at the first step). 16
/// experts, one per token, 4 tokens per rank: at least 12 experts idle on each rank.
#[test]
fn mixtral_with_experts_idle_on_a_rank_keeps_lockstep() {
    let dir = tmpdir("mixtral-idle");
    let sets = [&IDLE_EXPERTS[..], &["--set", "train.batch_size=2"]].concat();
    assert_ok(&train_mixtral(&dir, "single", 3, &sets));
    let want = metrics(&dir, "single");
    let single_w = hf_folder_weights(&dir, "single");
    for (tag, layout) in [("dp2", "dp=2"), ("fsdp2", "fsdp=2")] {
        let extra = [&sets[..], &["--layout", layout]].concat();
        assert_ok(&train_mixtral(&dir, tag, 3, &extra));
        assert_lockstep(tag, &metrics(&dir, tag), &want, true);
        assert_weights_close(tag, &hf_folder_weights(&dir, tag), &single_w);
    }
}

#[test]
fn mixtral_trains_and_keeps_lockstep_with_one_device_under_dp_fsdp_and_pp() {
    let dir = tmpdir("mixtral");
    assert_ok(&train_mixtral(&dir, "single", 6, &[]));
    let want = metrics(&dir, "single");
    let (first, last) = (want[0].loss, want.last().unwrap().loss);
    assert!(last < first - 0.3, "the loss falls: {first} -> {last}");
    // Every line: the objective (cross-entropy + 0.05 aux), the aux loss near its uniform value
    // k = 2, and the load: 8 rows x 16 tokens x 2 copies over 4 experts = 64 per expert on
    // average.
    let lines = std::fs::read_to_string(dir.join("single.jsonl")).unwrap();
    for line in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let aux = v["aux_loss"].as_f64().unwrap();
        assert!((1.9..2.5).contains(&aux), "{line}");
        assert_eq!(v["expert_tokens_mean"].as_f64(), Some(64.0), "{line}");
        let max = v["expert_tokens_max"].as_f64().unwrap();
        assert!((64.0..=128.0).contains(&max), "{line}");
        assert_eq!(v["expert_tokens_dropped"].as_f64(), Some(0.0), "{line}");
    }
    let config = read_json(&dir.join("single/config.json"));
    assert_eq!(config["model_type"], "mixtral");
    assert_eq!(config["num_local_experts"], 4);
    assert_eq!(config["num_experts_per_tok"], 2);
    let single_w = hf_folder_weights(&dir, "single");
    // The load-balancing loss of layers on other pipeline stages reaches the backward with the
    // executor's scale, and the load is reduced over the stages.
    let layouts = [
        ("dp2", "dp=2"),
        ("fsdp2", "fsdp=2"),
        ("dp2pp2", "dp=2,pp=2"),
    ];
    for (tag, layout) in layouts {
        let extra = ["--layout", layout, "--microbatches", "2"];
        assert_ok(&train_mixtral(&dir, tag, 6, &extra));
        assert_lockstep(tag, &metrics(&dir, tag), &want, true);
        assert_weights_close(tag, &hf_folder_weights(&dir, tag), &single_w);
    }
    // A capacity factor drops copies per sequence: the same ones under data parallelism.
    let cap = ["--set", "model.expert_capacity_factor=1.0"];
    assert_ok(&train_mixtral(&dir, "cap", 2, &cap));
    let dp_cap = [&cap[..], &["--layout", "dp=2", "--microbatches", "2"]].concat();
    assert_ok(&train_mixtral(&dir, "cap_dp2", 2, &dp_cap));
    assert_lockstep(
        "cap_dp2",
        &metrics(&dir, "cap_dp2"),
        &metrics(&dir, "cap"),
        true,
    );
    let dropped = |tag: &str| -> Vec<f64> {
        let text = std::fs::read_to_string(dir.join(format!("{tag}.jsonl"))).unwrap();
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["expert_tokens_dropped"].as_f64().unwrap()
            })
            .collect()
    };
    assert!(dropped("cap").iter().all(|&d| d > 0.0));
    assert_eq!(dropped("cap"), dropped("cap_dp2"));
    // The folder evaluates (cross-entropy alone) and generates.
    let data = dir.join("eval.txt");
    std::fs::write(
        &data,
        "The quick brown fox jumps over the lazy dog. ".repeat(8),
    )
    .unwrap();
    let loss = loss_line(&eval(&dir.join("single"), &data));
    assert!(loss.is_finite() && loss < 6.0, "{loss}");
    let o = bin()
        .args([
            "generate",
            "--checkpoint",
            dir.join("single").to_str().unwrap(),
        ])
        .args([
            "--prompt",
            "The ",
            "--temperature",
            "0",
            "--max-new-tokens",
            "4",
        ])
        .output()
        .unwrap();
    assert_ok(&o);
    // A one-line refusal: top-k above the experts.
    let o = train_mixtral(&dir, "bad_k", 1, &["--set", "model.experts_per_token=5"]);
    assert_one_line_error(&o, &["model.experts_per_token", "1..=4"]);
    // Fine-tuning from the folder: it fixes the shape, the coefficient is a training setting.
    let single = dir.join("single");
    let o = train_mixtral(
        &dir,
        "tuned",
        1,
        &[
            "--init-from",
            single.to_str().unwrap(),
            "--set",
            "model.router_aux_loss_coef=0.5",
        ],
    );
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("aux coef 0.5"), "{out}");
    let o = train_mixtral(
        &dir,
        "reshaped",
        1,
        &[
            "--init-from",
            single.to_str().unwrap(),
            "--set",
            "model.n_experts=8",
        ],
    );
    assert_one_line_error(&o, &["model.n_experts is 4 in the folder but 8"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
