//! Text data and tokenizers: JSONL documents byte-level and through small trained BPE and
//! WordPiece tokenizers; tokenizer.json round trips; errors that name the file (and line).

use std::path::{Path, PathBuf};

use meshgrad_nn::data::{load_split, DataError, LoadOptions, TokenDataset, TokenSource};
use meshgrad_nn::tokenizer::{Tokenizer, TokenizerError, TokenizerKind, END_OF_TEXT};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-text-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const DOCS: [&str; 4] = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood...",
    "\"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park is let at last?\"",
    "Mr. Bennet replied that he had not. Café, naïve, 東京 and ☕ too.",
];

/// A JSONL file of `DOCS` (with an extra field and a blank line, both ignored).
fn jsonl(dir: &Path) -> PathBuf {
    let path = dir.join("docs.jsonl");
    let mut text = String::new();
    for (i, d) in DOCS.iter().enumerate() {
        text.push_str(&serde_json::json!({"id": i, "text": d}).to_string());
        text.push('\n');
        if i == 1 {
            text.push_str("   \n");
        }
    }
    std::fs::write(&path, text).unwrap();
    path
}

fn trained(kind: TokenizerKind, vocab: usize) -> Tokenizer {
    let corpus = DOCS.repeat(20);
    Tokenizer::train_on(kind, vocab, corpus.iter(), "test corpus").unwrap()
}

#[test]
fn byte_level_jsonl_is_the_bytes_of_each_document_and_a_newline() {
    let dir = tmpdir("bytes");
    let ds = TokenDataset::from_jsonl(jsonl(&dir), None).unwrap();
    let expected: Vec<u32> = DOCS
        .iter()
        .flat_map(|d| d.bytes().chain([b'\n']).map(u32::from))
        .collect();
    assert_eq!(ds.tokens, expected);
    assert_eq!(ds.vocab_size, 256);
}

#[test]
fn jsonl_through_a_tokenizer_is_each_document_encoded() {
    let dir = tmpdir("tok");
    let path = jsonl(&dir);
    for kind in [TokenizerKind::Bpe, TokenizerKind::WordPiece] {
        let tok = trained(kind, 300);
        let ds = TokenDataset::from_jsonl(&path, Some(&tok)).unwrap();
        let expected: Vec<u32> = DOCS
            .iter()
            .flat_map(|d| tok.encode_document(d).unwrap())
            .collect();
        assert_eq!(ds.tokens, expected, "{kind}");
        assert_eq!(ds.vocab_size, tok.vocab_size());
        match kind {
            // Byte-level BPE: <|endoftext|> (id 0) before each document, nothing after.
            TokenizerKind::Bpe => {
                assert_eq!(tok.token_to_id(END_OF_TEXT), Some(0));
                let first = tok.encode(DOCS[0], true).unwrap();
                assert_eq!(ds.tokens[0], 0);
                assert_eq!(ds.tokens[1..1 + first.len()], first[..]);
                assert_eq!(ds.tokens.iter().filter(|&&t| t == 0).count(), DOCS.len());
            }
            // WordPiece: [CLS] ... [SEP] around each document.
            TokenizerKind::WordPiece => {
                let (cls, sep) = (tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"));
                assert_eq!((cls, sep), (Some(2), Some(3)));
                assert_eq!(ds.tokens[0], 2);
                assert_eq!(*ds.tokens.last().unwrap(), 3);
                assert_eq!(ds.tokens.iter().filter(|&&t| t == 2).count(), DOCS.len());
            }
        }
        // Through load_split, as the trainer loads it.
        let opts = LoadOptions {
            tokenizer: Some(&tok),
            shard_vocab_size: 0,
        };
        let split = load_split(&path, &opts, 0.25, 5).unwrap();
        assert_eq!(split.train.len() + split.val.len(), expected.len());
        assert_eq!(split.train.vocab_size(), tok.vocab_size());
    }
}

#[test]
fn bad_jsonl_lines_are_named_by_file_and_line() {
    let dir = tmpdir("badjsonl");
    let cases = [
        (
            "notjson",
            "{\"text\": \"ok\"}\n{\"text\": oops}\n",
            2,
            "invalid JSON",
        ),
        (
            "notext",
            "{\"text\": \"ok\"}\n\n{\"body\": \"x\"}\n",
            3,
            "no \"text\" field",
        ),
        ("number", "{\"text\": 5}\n", 1, "is a number, not a string"),
        ("array", "{\"text\": \"a\"}\n[1, 2]\n", 2, "got an array"),
        (
            "truncated",
            "{\"text\": \"a\"}\n{\"text\": \"b\"",
            2,
            "invalid JSON",
        ),
    ];
    for (name, text, line, needle) in cases {
        let path = dir.join(format!("{name}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let err = TokenDataset::from_jsonl(&path, None).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, DataError::Jsonl { line: l, .. } if l == line),
            "{name}: {msg}"
        );
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains(&format!("line {line}")), "{msg}");
        assert!(msg.contains(needle), "{name}: {msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }
    let path = dir.join("blank.jsonl");
    std::fs::write(&path, "\n \n").unwrap();
    let msg = TokenDataset::from_jsonl(&path, None)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("blank.jsonl") && msg.contains("no documents"),
        "{msg}"
    );
    let path = dir.join("utf8.jsonl");
    std::fs::write(&path, b"{\"text\": \"a\"}\n{\"text\": \"\xff\"}\n").unwrap();
    let msg = TokenDataset::from_jsonl(&path, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("line 2") && msg.contains("UTF-8"), "{msg}");
}

#[test]
fn tokenizer_json_round_trip_and_decode() {
    let dir = tmpdir("roundtrip");
    for kind in [TokenizerKind::Bpe, TokenizerKind::WordPiece] {
        let tok = trained(kind, 320);
        assert!(tok.vocab_size() <= 320, "{kind}: {}", tok.vocab_size());
        let path = dir.join(format!("{kind}.json"));
        tok.save(&path).unwrap();
        let back = Tokenizer::from_file(&path).unwrap();
        assert_eq!(back.vocab_size(), tok.vocab_size());
        assert_eq!(back.name(), path.display().to_string());
        for d in DOCS {
            assert_eq!(back.encode(d, true).unwrap(), tok.encode(d, true).unwrap());
        }
        let text = "Mr. Bennet said: café!";
        let ids = tok.encode(text, false).unwrap();
        let decoded = tok.decode(&ids, true).unwrap();
        match kind {
            // Byte-level BPE is lossless.
            TokenizerKind::Bpe => assert_eq!(decoded, text),
            // Uncased WordPiece lowercases.
            TokenizerKind::WordPiece => {
                assert!(decoded.starts_with("mr. bennet said"), "{decoded}")
            }
        }
        assert!(tok.decode(&[tok.vocab_size() as u32], true).is_err());
    }
}

#[test]
fn training_from_files_and_errors_naming_them() {
    let dir = tmpdir("train");
    let txt = dir.join("a.txt");
    std::fs::write(&txt, DOCS.join("\n").repeat(5)).unwrap();
    let js = jsonl(&dir);
    let tok = Tokenizer::train(TokenizerKind::Bpe, 300, &[txt.clone(), js.clone()]).unwrap();
    assert_eq!(tok.vocab_size(), 300);
    let wp = Tokenizer::train(TokenizerKind::WordPiece, 200, std::slice::from_ref(&txt)).unwrap();
    for (i, t) in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .iter()
        .enumerate()
    {
        assert_eq!(wp.token_to_id(t), Some(i as u32));
    }

    let missing = dir.join("missing.txt");
    let err =
        Tokenizer::train(TokenizerKind::Bpe, 300, &[txt.clone(), missing.clone()]).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );

    let bad = dir.join("bad.txt");
    std::fs::write(&bad, b"abc\xffdef").unwrap();
    let msg = Tokenizer::train(TokenizerKind::WordPiece, 100, std::slice::from_ref(&bad))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("bad.txt") && msg.contains("UTF-8") && msg.contains("offset 3"),
        "{msg}"
    );

    let badjs = dir.join("bad.jsonl");
    std::fs::write(&badjs, "{\"text\": \"a\"}\n{}\n").unwrap();
    let msg = Tokenizer::train(TokenizerKind::Bpe, 300, &[badjs])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("bad.jsonl, line 2"), "{msg}");

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "  \n").unwrap();
    let msg = Tokenizer::train(TokenizerKind::Bpe, 300, &[empty])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("no text") && msg.contains("empty.txt"),
        "{msg}"
    );

    let err = Tokenizer::train(TokenizerKind::Bpe, 100, &[txt]).unwrap_err();
    assert!(
        matches!(err, TokenizerError::VocabTooSmall { min: 257, .. }),
        "{err}"
    );
    assert!("BPE".parse::<TokenizerKind>().is_ok());
    assert!("unigram".parse::<TokenizerKind>().is_err());
}

#[test]
fn loading_bad_tokenizer_files_names_them() {
    let dir = tmpdir("badtok");
    let missing = dir.join("nope.json");
    let msg = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(
        msg.contains(&missing.display().to_string()) && msg.contains("os error"),
        "{msg}"
    );
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let msg = Tokenizer::from_file(&bad).unwrap_err().to_string();
    assert!(
        msg.contains("cannot load tokenizer") && msg.contains("bad.json"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");
}

#[test]
fn text_file_through_a_tokenizer_is_one_document() {
    let dir = tmpdir("textfile");
    let path = dir.join("t.txt");
    let text = DOCS.join("\n");
    std::fs::write(&path, &text).unwrap();
    let tok = trained(TokenizerKind::Bpe, 300);
    let ds = TokenDataset::from_text_file_with(&path, Some(&tok)).unwrap();
    assert_eq!(ds.tokens, tok.encode_document(&text).unwrap());
    // Byte-level without one.
    let ds = TokenDataset::from_text_file_with(&path, None).unwrap();
    assert_eq!(ds.len(), text.len());
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, b"\xfe\xff").unwrap();
    let msg = TokenDataset::from_text_file_with(&bad, Some(&tok))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("bad.txt") && msg.contains("UTF-8"), "{msg}");
}
