//! `meshgrad tokenizer train` and `meshgrad tokenize`: a BPE and a WordPiece tokenizer trained
//! by the CLI load in Hugging Face's Python `tokenizers` and give the same ids; errors are one
//! line naming the file.
//!
//! The Python comparison needs `python3` with the `tokenizers` module. Without them the test
//! prints `skipped: <reason>` (on stderr, also when the harness captures output) and passes, unless `MESHGRAD_REQUIRE_PY_TOKENIZERS=1` is set (CI
//! sets it when it could install the module), in which case it fails.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{assert_ok, assert_one_line_error, bin, text, tmpdir};

/// Strings that exercise the pre-tokenizers: whitespace runs, newlines, punctuation, digits,
/// contractions, accents, CJK, emoji, special tokens written out, and the empty string.
const SAMPLES: [&str; 10] = [
    "It is a truth universally acknowledged.",
    "Mr. Darcy's   pride,\nand Elizabeth's prejudice!",
    "  leading and trailing spaces  ",
    "Numbers: 1813, 3.14159 and 42nd.",
    "Café naïve résumé — “quoted” ‘text’…",
    "東京 and 北京, ☕ and 🎉🎉",
    "line one\n\n\tline two\r\nline three",
    "<|endoftext|>Next document [CLS] with [MASK] tokens [SEP]",
    "don't won't they'll we've I'm you'd",
    "",
];

/// The training text: the start of the built-in corpus plus the samples' characters.
fn training_file(dir: &Path) -> PathBuf {
    let corpus = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/corpus.txt"))
        .expect("assets/corpus.txt");
    let mut text = String::from_utf8_lossy(&corpus[..120_000]).into_owned();
    text.push('\n');
    text.push_str(&SAMPLES.join("\n"));
    let path = dir.join("train.txt");
    std::fs::write(&path, text).unwrap();
    path
}

fn train_tokenizer(dir: &Path, kind: &str, vocab: usize, data: &Path) -> PathBuf {
    let out = dir.join(format!("{kind}/tokenizer.json"));
    let o = bin()
        .args(["tokenizer", "train", "--kind", kind])
        .args(["--vocab-size", &vocab.to_string()])
        .args(["--data", data.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(
        stdout.contains(&format!("vocab_size={vocab} (target {vocab})")),
        "{stdout}"
    );
    assert!(out.exists());
    out
}

/// `meshgrad tokenize`: the ids of its last line, which must be `ids=1,2,3` exactly.
fn meshgrad_ids(tokenizer: &Path, s: &str) -> Vec<u32> {
    let o = bin()
        .args(["tokenize", "--tokenizer", tokenizer.to_str().unwrap()])
        .args(["--text", s])
        .output()
        .unwrap();
    assert_ok(&o);
    let (stdout, _) = text(&o);
    let last = stdout.lines().last().expect("output");
    let list = last
        .strip_prefix("ids=")
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(!list.contains(' '), "{last}");
    if list.is_empty() {
        return Vec::new();
    }
    list.split(',').map(|p| p.parse().unwrap()).collect()
}

/// Why the Python comparison cannot run here, if it cannot.
fn python_missing() -> Option<String> {
    match Command::new("python3")
        .args(["-c", "import tokenizers; print(tokenizers.__version__)"])
        .output()
    {
        Err(e) => Some(format!("python3 cannot be run ({e})")),
        Ok(o) if !o.status.success() => Some(format!(
            "the Python module `tokenizers` is missing (python3 -m pip install tokenizers): {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Ok(_) => None,
    }
}

/// Python's ids for each sample: `Tokenizer.from_file(path).encode(s).ids`.
fn python_ids(dir: &Path, tokenizer: &Path) -> Vec<Vec<u32>> {
    let samples = dir.join("samples.json");
    std::fs::write(&samples, serde_json::to_string(&SAMPLES).unwrap()).unwrap();
    let script = "import json, sys\n\
                  from tokenizers import Tokenizer\n\
                  tok = Tokenizer.from_file(sys.argv[1])\n\
                  samples = json.load(open(sys.argv[2], encoding='utf-8'))\n\
                  print(json.dumps([tok.encode(s).ids for s in samples]))\n";
    let o = Command::new("python3")
        .args(["-c", script])
        .arg(tokenizer)
        .arg(&samples)
        .output()
        .unwrap();
    assert_ok(&o);
    serde_json::from_str(text(&o).0.trim()).unwrap()
}

#[test]
fn tokenizers_match_hugging_face_python() {
    let dir = tmpdir("tok-python");
    let data = training_file(&dir);
    let bpe = train_tokenizer(&dir, "bpe", 600, &data);
    let wordpiece = train_tokenizer(&dir, "wordpiece", 500, &data);

    // What meshgrad says, and a few facts that hold without Python.
    let ours: Vec<(PathBuf, Vec<Vec<u32>>)> = [bpe, wordpiece]
        .into_iter()
        .map(|t| {
            let ids = SAMPLES.iter().map(|s| meshgrad_ids(&t, s)).collect();
            (t, ids)
        })
        .collect();
    // BPE: <|endoftext|> is id 0 and is matched as a special token; nothing is added around.
    assert_eq!(ours[0].1[7][0], 0);
    assert!(ours[0].1[9].is_empty());
    // WordPiece: [CLS] (2) ... [SEP] (3) around every encoding; [MASK] is 4.
    for ids in &ours[1].1 {
        assert_eq!((ids[0], *ids.last().unwrap()), (2, 3), "{ids:?}");
    }
    assert!(ours[1].1[7].contains(&4));

    if let Some(reason) = python_missing() {
        if std::env::var("MESHGRAD_REQUIRE_PY_TOKENIZERS").as_deref() == Ok("1") {
            panic!("MESHGRAD_REQUIRE_PY_TOKENIZERS=1 but {reason}");
        }
        // Straight to stderr, past the test harness's capture, so that the reason shows.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: Python comparison of tokenizer ids: {reason}"
        );
        return;
    }
    for (tokenizer, ids) in &ours {
        let theirs = python_ids(&dir, tokenizer);
        for (i, s) in SAMPLES.iter().enumerate() {
            assert_eq!(
                ids[i],
                theirs[i],
                "{}: ids differ for {s:?}",
                tokenizer.display()
            );
        }
    }
}

#[test]
fn tokenize_prints_tokens_then_ids() {
    let dir = tmpdir("tok-format");
    let data = training_file(&dir);
    let wp = train_tokenizer(&dir, "wordpiece", 300, &data);
    let o = bin()
        .args(["tokenize", "--tokenizer", wp.to_str().unwrap()])
        .args(["--text", "Elizabeth smiled."])
        .output()
        .unwrap();
    assert_ok(&o);
    let (stdout, _) = text(&o);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let tokens: Vec<String> =
        serde_json::from_str(lines[0].strip_prefix("tokens=").unwrap()).unwrap();
    assert_eq!(tokens.first().map(String::as_str), Some("[CLS]"));
    assert_eq!(tokens.last().map(String::as_str), Some("[SEP]"));
    let ids = meshgrad_ids(&wp, "Elizabeth smiled.");
    assert_eq!(ids.len(), tokens.len());
    // Without special tokens.
    let o = bin()
        .args(["tokenize", "--tokenizer", wp.to_str().unwrap()])
        .args(["--text", "Elizabeth smiled.", "--no-special-tokens"])
        .output()
        .unwrap();
    assert_ok(&o);
    let last = text(&o).0.lines().last().unwrap().to_string();
    let expected: Vec<String> = ids[1..ids.len() - 1]
        .iter()
        .map(|i| i.to_string())
        .collect();
    assert_eq!(last, format!("ids={}", expected.join(",")));
}

#[test]
fn tokenizer_errors_are_one_line_naming_the_file() {
    let dir = tmpdir("tok-errors");
    let missing = dir.join("missing.txt");
    let out = dir.join("t.json");
    let o = bin()
        .args(["tokenizer", "train", "--kind", "bpe", "--vocab-size", "300"])
        .args([
            "--data",
            missing.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &[missing.to_str().unwrap()]);
    let data = dir.join("d.txt");
    std::fs::write(&data, "some text").unwrap();
    let o = bin()
        .args(["tokenizer", "train", "--kind", "bpe", "--vocab-size", "50"])
        .args([
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["vocab size 50", "at least 257"]);
    let o = bin()
        .args([
            "tokenize",
            "--tokenizer",
            missing.to_str().unwrap(),
            "--text",
            "x",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &[missing.to_str().unwrap()]);
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "not json").unwrap();
    let o = bin()
        .args([
            "tokenize",
            "--tokenizer",
            bad.to_str().unwrap(),
            "--text",
            "x",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["cannot load tokenizer", bad.to_str().unwrap()]);
    let o = bin()
        .args(["train", "--tokenizer", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &[bad.to_str().unwrap()]);
}
