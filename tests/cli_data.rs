//! `meshgrad train/eval/generate` on real data formats: a folder of llm.c token shards (with a
//! validation shard; the same losses under a data-parallel layout), JSONL through a trained
//! tokenizer (stored in the checkpoint and used by generate and eval), and one-line errors for bad
//! shards and bad JSONL lines.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{
    assert_ok, assert_one_line_error, bin, eval, loss_line, metrics, read_json, text, tmpdir,
};
use meshgrad::nn::data::write_shard;

/// Trains a tiny model for 4 steps into `dir/<tag>` (metrics in `dir/<tag>.jsonl`).
fn train(dir: &Path, tag: &str, extra: &[&str]) -> Output {
    let sets = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=16",
        "train.batch_size=4",
        "train.warmup_steps=2",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=8",
    ];
    common::train(dir, tag, 4, &sets, extra)
}

/// Tokens below 300 with some structure (so a model can learn a little).
fn tokens(n: usize, salt: u16) -> Vec<u16> {
    (0..n as u16).map(|i| (i * 7 + salt) % 300).collect()
}

#[test]
fn shard_folder_trains_evaluates_and_splits_like_one_device() {
    let dir = tmpdir("data-shards");
    let data = dir.join("shards");
    std::fs::create_dir_all(&data).unwrap();
    for i in 0..3 {
        write_shard(data.join(format!("toy_train_{i:06}.bin")), &tokens(700, i)).unwrap();
    }
    write_shard(data.join("toy_val_000000.bin"), &tokens(300, 9)).unwrap();
    let d = data.to_str().unwrap();
    let o = train(&dir, "one", &["--data", d, "--set", "model.vocab_size=300"]);
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(
        out.contains("2100 train / 300 val tokens") && out.contains("1 validation shard"),
        "{out}"
    );
    // Two data-parallel ranks see the same batches: the same losses.
    let o = train(
        &dir,
        "dp",
        &[
            "--data",
            d,
            "--set",
            "model.vocab_size=300",
            "--layout",
            "dp=2",
        ],
    );
    assert_ok(&o);
    let (one, dp) = (metrics(&dir, "one"), metrics(&dir, "dp"));
    assert_eq!(one.len(), 4);
    for (a, b) in one.iter().zip(&dp) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(),
            "{one:?} vs {dp:?}"
        );
        assert_eq!(a.val_loss.is_some(), b.val_loss.is_some());
    }
    // eval on the folder: its validation shard.
    let ckpt = dir.join("one");
    let o = eval(&ckpt, &data);
    assert_ok(&o);
    let loss = loss_line(&o);
    assert!(loss.is_finite() && loss > 0.0, "{loss}");

    // Ids above the model's vocabulary are named with their shard.
    let o = train(
        &dir,
        "small",
        &["--data", d, "--set", "model.vocab_size=200"],
    );
    assert_one_line_error(&o, &["toy_", "out of range for vocab_size 200"]);

    // A bad shard in the folder: one line naming it.
    let bad = data.join("toy_train_000003.bin");
    std::fs::write(&bad, vec![0u8; 2000]).unwrap();
    let o = train(&dir, "bad", &["--data", d, "--set", "model.vocab_size=300"]);
    assert_one_line_error(&o, &[bad.to_str().unwrap(), "magic number is 0"]);
}

#[test]
fn jsonl_through_a_tokenizer_end_to_end() {
    let dir = tmpdir("data-jsonl");
    let corpus =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/corpus.txt"))
            .unwrap();
    // Paragraphs of the corpus as JSONL documents.
    let docs: Vec<&str> = corpus
        .split("\n\n")
        .map(str::trim)
        .filter(|p| p.len() > 40)
        .take(300)
        .collect();
    let jsonl = dir.join("docs.jsonl");
    let lines: Vec<String> = docs
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string())
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let tok = dir.join("tok.json");
    let o = bin()
        .args(["tokenizer", "train", "--kind", "bpe", "--vocab-size", "400"])
        .args([
            "--data",
            jsonl.to_str().unwrap(),
            "--out",
            tok.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_ok(&o);

    let j = jsonl.to_str().unwrap();
    let o = train(
        &dir,
        "tok",
        &["--data", j, "--tokenizer", tok.to_str().unwrap()],
    );
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("tok.json (vocab 400)"), "{out}");
    let ckpt = dir.join("tok");
    // The checkpoint keeps the tokenizer; the model's vocabulary is the tokenizer's.
    let saved = std::fs::read_to_string(ckpt.join("tokenizer.json")).unwrap();
    let given = std::fs::read_to_string(&tok).unwrap();
    assert_eq!(saved, given);
    let cfg = read_json(&ckpt.join("config.json"));
    assert_eq!(cfg["vocab_size"].as_u64(), Some(400));

    // generate encodes the prompt and decodes the output with it.
    let o = bin()
        .args(["generate", "--checkpoint", ckpt.to_str().unwrap()])
        .args([
            "--prompt",
            "Elizabeth",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    let ids = out
        .lines()
        .last()
        .unwrap()
        .strip_prefix("ids=")
        .unwrap()
        .to_string();
    let ids: Vec<u32> = ids.split(',').map(|p| p.parse().unwrap()).collect();
    assert_eq!(ids.len(), 6);
    assert!(ids.iter().all(|&i| i < 400));
    // eval reads the JSONL through the checkpoint's tokenizer.
    let o = eval(&ckpt, &jsonl);
    assert_ok(&o);
    assert!(loss_line(&o) < 7.0);

    // Byte-level JSONL without a tokenizer, into the same folder (starting over: the folder
    // holds a run): the stale tokenizer goes.
    let o = train(&dir, "tok", &["--data", j]);
    assert_one_line_error(&o, &["already holds a run", "--resume", "--overwrite"]);
    let o = train(&dir, "tok", &["--data", j, "--overwrite"]);
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("byte-level text"), "{out}");
    assert!(!ckpt.join("tokenizer.json").exists());

    // A bad line: one line naming the file and the line number.
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, format!("{}\n{{\"title\": \"x\"}}\n", lines[0])).unwrap();
    let o = train(&dir, "bad", &["--data", bad.to_str().unwrap()]);
    assert_one_line_error(&o, &[bad.to_str().unwrap(), "line 2", "no \"text\" field"]);
}
