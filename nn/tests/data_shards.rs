//! llm.c token shards: windows read through the memory maps equal the tokens written, across
//! shard boundaries; the train/validation split (validation shards, or a held-out tail); a
//! layout split of the batch sees the same rows as the whole batch; bad shards are errors that
//! name the file.

use std::path::{Path, PathBuf};

use meshgrad_nn::data::{
    is_validation_shard, load_dataset, load_split, write_shard, DataError, DataFormat, Dataset,
    LoadOptions, Shard, ShardFolder, ShardedDataset, TokenDataset, TokenSource, SHARD_HEADER_BYTES,
    SHARD_MAGIC,
};

/// A fresh, empty folder in the temp dir for one test.
fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-shards-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `n` pseudo-random tokens below `vocab`, different for each `salt`.
fn tokens(n: usize, vocab: u16, salt: u64) -> Vec<u16> {
    (0..n as u64)
        .map(|i| (meshgrad_nn::data::splitmix64(i ^ (salt << 32)) % u64::from(vocab)) as u16)
        .collect()
}

fn as_u32(t: &[u16]) -> Vec<u32> {
    t.iter().map(|&v| u32::from(v)).collect()
}

/// Train shards of uneven sizes (one empty) and one validation shard; returns the folder, the
/// concatenated train tokens and the validation tokens.
fn folder_with_val(name: &str) -> (PathBuf, Vec<u32>, Vec<u32>) {
    let dir = tmpdir(name);
    let sizes = [37usize, 0, 50, 23, 101];
    let mut train = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let t = tokens(n, 500, i as u64 + 1);
        write_shard(dir.join(format!("tiny_train_{i:06}.bin")), &t).unwrap();
        train.extend(as_u32(&t));
    }
    let val = tokens(60, 500, 99);
    write_shard(dir.join("tiny_val_000000.bin"), &val).unwrap();
    // Not a shard: ignored.
    std::fs::write(dir.join("README.txt"), "not a shard").unwrap();
    (dir, train, as_u32(&val))
}

#[test]
fn windows_equal_the_tokens_written_across_shard_boundaries() {
    let (dir, train, _) = folder_with_val("windows");
    let folder = ShardFolder::open(&dir, 500).unwrap();
    let ds = &folder.train;
    assert_eq!(ds.len(), train.len());
    assert_eq!(ds.shards().len(), 5);
    assert_eq!(ds.vocab_size(), 500);
    // Every read, at every start and of lengths that cross one or more boundaries.
    for len in [1usize, 7, 40, 120] {
        for start in 0..=train.len() - len {
            let mut out = vec![0u32; len];
            ds.read(start, &mut out).unwrap();
            assert_eq!(out, train[start..start + len], "start {start} len {len}");
        }
    }
    // A read past the end is an error.
    let mut out = vec![0u32; 5];
    assert!(matches!(
        ds.read(train.len() - 4, &mut out),
        Err(DataError::ReadOutOfRange { .. })
    ));
    // Sampled windows: the tokens at the sampled start, targets shifted by one.
    let t = 16;
    for step in 0..50 {
        let b = ds.batch(7, step, 0..4, t).unwrap();
        for r in 0..4 {
            let start = ds.window_start(7, step, r as u64, t).unwrap();
            let (x, y) = b.row(r).unwrap();
            assert_eq!(x, &train[start..start + t]);
            assert_eq!(y, &train[start + 1..start + t + 1]);
        }
    }
    // The same tokens in memory give the same batches: the sampler depends on the token stream
    // only, not on what holds it.
    let mem = TokenDataset::from_tokens("mem", train.clone(), 500).unwrap();
    for step in 0..20 {
        assert_eq!(
            ds.batch(3, step, 0..8, t).unwrap(),
            mem.batch(3, step, 0..8, t).unwrap()
        );
    }
    let starts: Vec<usize> = ds.eval_windows(t).unwrap().collect();
    assert_eq!(starts, mem.eval_windows(t).unwrap().collect::<Vec<_>>());
    assert_eq!(
        ds.batch_at(&starts, t).unwrap(),
        mem.batch_at(&starts, t).unwrap()
    );
}

#[test]
fn layout_split_of_the_batch_sees_the_same_rows() {
    let (dir, _, _) = folder_with_val("layout");
    let ds = ShardFolder::open(&dir, 500).unwrap().train;
    for step in 0..10 {
        let whole = ds.batch(1234, step, 0..8, 12).unwrap();
        for k in 1..8u64 {
            // Rows 0..k on one rank, k..8 on another.
            let lo = ds.batch(1234, step, 0..k, 12).unwrap();
            let hi = ds.batch(1234, step, k..8, 12).unwrap();
            assert_eq!(whole.inputs, [lo.inputs, hi.inputs].concat());
            assert_eq!(whole.targets, [lo.targets, hi.targets].concat());
        }
        // Four ranks of two rows, through the Dataset enum as the trainer holds it.
        let d: Dataset = ds.clone().into();
        let parts: Vec<u32> = (0..4u64)
            .flat_map(|r| d.batch(1234, step, 2 * r..2 * r + 2, 12).unwrap().inputs)
            .collect();
        assert_eq!(parts, whole.inputs);
    }
}

#[test]
fn validation_shards_are_the_validation_split() {
    let (dir, train, val) = folder_with_val("split");
    let folder = ShardFolder::open(&dir, 500).unwrap();
    let v = folder.val.as_ref().expect("a validation set");
    assert_eq!(v.shards().len(), 1);
    assert!(v.shards()[0].path().ends_with("tiny_val_000000.bin"));
    let names: Vec<_> = folder
        .train
        .shards()
        .iter()
        .map(|s| s.path().file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        [0, 1, 2, 3, 4].map(|i| format!("tiny_train_{i:06}.bin"))
    );

    let opts = LoadOptions {
        tokenizer: None,
        shard_vocab_size: 500,
    };
    let split = load_split(&dir, &opts, 0.1, 17).unwrap();
    assert_eq!(split.validation, "1 validation shard");
    let read_all = |d: &Dataset| {
        let mut out = vec![0u32; d.len()];
        d.read(0, &mut out).unwrap();
        out
    };
    assert_eq!(read_all(&split.train), train);
    assert_eq!(read_all(&split.val), val);
    // eval on the folder: its validation shards.
    assert_eq!(read_all(&load_dataset(&dir, &opts).unwrap()), val);
    // A validation set shorter than one window is refused, naming it.
    let err = load_split(&dir, &opts, 0.1, 61).unwrap_err().to_string();
    assert!(err.contains("val") && err.contains("60 tokens"), "{err}");
}

#[test]
fn without_validation_shards_the_tail_is_held_out() {
    let dir = tmpdir("tail");
    let a = tokens(300, 1000, 1);
    let b = tokens(200, 1000, 2);
    write_shard(dir.join("data_000000.bin"), &a).unwrap();
    write_shard(dir.join("data_000001.bin"), &b).unwrap();
    let all: Vec<u32> = as_u32(&[a, b].concat());
    let opts = LoadOptions {
        tokenizer: None,
        shard_vocab_size: 1000,
    };
    let split = load_split(&dir, &opts, 0.1, 9).unwrap();
    assert_eq!(split.validation, "last 10% of the tokens");
    assert_eq!(split.train.len(), 450);
    assert_eq!(split.val.len(), 50);
    let mut v = vec![0u32; 50];
    split.val.read(0, &mut v).unwrap();
    assert_eq!(v, all[450..]);
    let mut t = vec![0u32; 450];
    split.train.read(0, &mut t).unwrap();
    assert_eq!(t, all[..450]);
    // The parts sample within themselves: a validation window is a window of the tail.
    let b = split.val.batch(5, 0, 0..3, 8).unwrap();
    for r in 0..3 {
        let s = split.val.window_start(5, 0, r as u64, 8).unwrap();
        assert_eq!(b.row(r).unwrap().0, &all[450 + s..450 + s + 8]);
    }
    assert!(
        split.train.source().ends_with("[train]"),
        "{}",
        split.train.source()
    );
    // With no validation shards, eval uses all shards.
    assert_eq!(load_dataset(&dir, &opts).unwrap().len(), 500);
}

#[test]
fn a_single_shard_file_is_detected_by_its_header() {
    let dir = tmpdir("single");
    let t = tokens(100, 300, 4);
    let shard = dir.join("one.bin");
    write_shard(&shard, &t).unwrap();
    assert_eq!(DataFormat::of(&shard).unwrap(), DataFormat::Shard);
    // A raw u16 file stays a raw u16 file.
    let raw = dir.join("raw.bin");
    std::fs::write(&raw, [1u8, 0, 2, 0]).unwrap();
    assert_eq!(DataFormat::of(&raw).unwrap(), DataFormat::U16Bin);
    assert_eq!(DataFormat::of(&dir).unwrap(), DataFormat::ShardFolder);
    assert_eq!(
        DataFormat::of(&dir.join("x.JSONL"))
            .err()
            .map(|e| e.to_string().contains("x.JSONL")),
        Some(true)
    );
    let opts = LoadOptions {
        tokenizer: None,
        shard_vocab_size: 300,
    };
    let d = load_dataset(&shard, &opts).unwrap();
    assert!(matches!(d, Dataset::Shards(_)));
    let mut out = vec![0u32; 100];
    d.read(0, &mut out).unwrap();
    assert_eq!(out, as_u32(&t));
    let split = load_split(&shard, &opts, 0.2, 5).unwrap();
    assert_eq!((split.train.len(), split.val.len()), (80, 20));
    let d = load_dataset(&raw, &opts).unwrap();
    assert!(matches!(d, Dataset::Memory(_)));
}

#[test]
fn validation_shard_names() {
    for yes in [
        "fineweb_val_000000.bin",
        "tiny_shakespeare_val.bin",
        "val.bin",
        "data-VAL-1.bin",
    ] {
        assert!(is_validation_shard(Path::new(yes)), "{yes}");
    }
    for no in [
        "fineweb_train_000001.bin",
        "interval_000.bin",
        "evaluation.bin",
        "valid.bin",
    ] {
        assert!(!is_validation_shard(Path::new(no)), "{no}");
    }
}

/// Writes a shard with a custom header and `n_tokens` tokens after it.
fn raw_shard(path: &Path, magic: i32, version: i32, count: i32, n_tokens: usize) {
    let mut bytes = Vec::new();
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    bytes.extend(header.iter().flat_map(|v| v.to_le_bytes()));
    bytes.extend((0..n_tokens).flat_map(|i| (i as u16).to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

/// Asserts that opening `path` (alone, and in a folder of good shards) fails with a one-line
/// message that names the file and contains `needle`.
fn assert_bad_shard(path: &Path, needle: &str) {
    let err = Shard::open(path).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, DataError::BadShard { .. }), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains(needle), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    let dir = path.parent().unwrap();
    let msg = ShardFolder::open(dir, 65536).unwrap_err().to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
}

#[test]
fn bad_shards_are_errors_naming_the_file() {
    let cases: [(&str, i32, i32, i32, usize, &str); 6] = [
        (
            "magic",
            12345,
            1,
            10,
            10,
            "magic number is 12345, expected 20240520",
        ),
        (
            "version",
            SHARD_MAGIC,
            7,
            10,
            10,
            "version is 7, expected 1",
        ),
        ("negative", SHARD_MAGIC, 1, -3, 0, "negative"),
        ("truncated", SHARD_MAGIC, 1, 100, 60, "says 100 tokens"),
        ("trailing", SHARD_MAGIC, 1, 10, 11, "1046 bytes"),
        (
            "count_zero_with_data",
            SHARD_MAGIC,
            1,
            0,
            5,
            "says 0 tokens",
        ),
    ];
    for (name, magic, version, count, n, needle) in cases {
        let dir = tmpdir(&format!("bad-{name}"));
        write_shard(dir.join("good_000000.bin"), &tokens(50, 100, 1)).unwrap();
        let path = dir.join(format!("bad_{name}.bin"));
        raw_shard(&path, magic, version, count, n);
        assert_bad_shard(&path, needle);
    }
    // Shorter than the header.
    let dir = tmpdir("bad-short");
    let path = dir.join("short.bin");
    std::fs::write(&path, vec![0u8; 100]).unwrap();
    assert_bad_shard(&path, "shorter than the 1024-byte header");
    // An empty shard (count 0, header only) is valid.
    let dir = tmpdir("empty-ok");
    let path = dir.join("empty.bin");
    write_shard(&path, &[]).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        SHARD_HEADER_BYTES as u64
    );
    assert!(Shard::open(&path).unwrap().is_empty());
}

#[test]
fn out_of_range_ids_are_named_when_the_shards_are_opened() {
    let dir = tmpdir("vocab");
    write_shard(dir.join("a_000000.bin"), &[1, 2, 3, 4]).unwrap();
    write_shard(dir.join("a_000001.bin"), &[5, 6, 700, 8]).unwrap();
    // Found when the folder is opened, before any batch is drawn.
    let err = ShardFolder::open(&dir, 100).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                id: 700,
                position: 2,
                vocab_size: 100,
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("a_000001.bin"), "{msg}");
    // The same shards with a vocabulary that holds every id read fine.
    let ds = ShardFolder::open(&dir, 701).unwrap().train;
    let mut out = vec![0u32; 6];
    ds.read(1, &mut out).unwrap();
    assert_eq!(out, [2, 3, 4, 5, 6, 700]);
    assert!(ShardedDataset::open(&[dir.join("a_000000.bin")], 0, "x").is_err());
}

#[test]
fn folders_without_usable_shards_are_errors() {
    let dir = tmpdir("none");
    std::fs::write(dir.join("notes.txt"), "x").unwrap();
    let err = ShardFolder::open(&dir, 10).unwrap_err();
    assert!(matches!(err, DataError::NoShards { .. }), "{err}");
    assert!(err.to_string().contains(&dir.display().to_string()));
    write_shard(dir.join("x_val_000000.bin"), &[1, 2, 3]).unwrap();
    let err = ShardFolder::open(&dir, 10).unwrap_err();
    assert!(
        matches!(err, DataError::NoTrainShards { count: 1, .. }),
        "{err}"
    );
    let missing = dir.join("missing");
    let err = load_split(&missing, &LoadOptions::default(), 0.1, 2).unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
}
