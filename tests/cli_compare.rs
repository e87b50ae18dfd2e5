//! `meshgrad compare`: metrics files written by the test (the expected differences are computed
//! here by hand from the values written), exit codes of `--max-relative-difference`, the PNG of
//! `--plot`, and errors for bad files.

use crate::common;

use common::{assert_ok, bin, text, tmpdir};

fn write(dir: &std::path::Path, name: &str, lines: &[&str]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

#[test]
fn compare_reports_first_difference_largest_and_identical_runs() {
    let dir = tmpdir("compare");
    let a = write(
        &dir,
        "a.jsonl",
        &[
            r#"{"step":1,"loss":5.5,"grad_norm":2.0}"#,
            r#"{"step":2,"loss":5.0,"grad_norm":1.5,"val_loss":5.25}"#,
            r#"{"step":3,"loss":4.0,"grad_norm":1.0}"#,
        ],
    );
    let same = write(
        &dir,
        "same.jsonl",
        &[
            r#"{"step":1,"loss":5.5,"grad_norm":2.0}"#,
            r#"{"step":2,"loss":5.0,"grad_norm":1.5,"val_loss":5.25}"#,
            r#"{"step":3,"loss":4.0,"grad_norm":1.0}"#,
        ],
    );
    // Step 2 differs by 0.5 / 5.0 = 1e-1, step 3 by 0.1 / 4.0 = 2.5e-2.
    let off = write(
        &dir,
        "off.jsonl",
        &[
            r#"{"step":1,"loss":5.5,"grad_norm":2.0}"#,
            r#"{"step":2,"loss":5.5,"grad_norm":1.5,"val_loss":5.25}"#,
            r#"{"step":3,"loss":4.1,"grad_norm":1.0}"#,
        ],
    );
    let png = dir.join("curves.png");
    let o = bin()
        .arg("compare")
        .args([&a, &same, &off])
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(
        out.contains("loss: identical at all 3 common steps"),
        "{out}"
    );
    assert!(
        out.contains("loss: first differs at step 2 (5 vs 5.5), largest relative difference 1.000e-1 at step 2"),
        "{out}"
    );
    assert!(
        out.lines()
            .last()
            .unwrap()
            .contains("compare: runs=3 identical=1 largest_relative_loss_difference=1.000e-1"),
        "{out}"
    );
    // A PNG of the configured size: the signature, then the IHDR chunk's width and height.
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((w, h), (1100, 820));

    // --max-relative-difference: 0 demands identical losses.
    let o = bin()
        .arg("compare")
        .args([&a, &same])
        .args(["--max-relative-difference", "0"])
        .output()
        .unwrap();
    assert_ok(&o);
    let o = bin()
        .arg("compare")
        .args([&a, &off])
        .args(["--max-relative-difference", "0.05"])
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("off.jsonl: largest relative loss difference 1.000e-1"),
        "{err}"
    );
    let o = bin()
        .arg("compare")
        .args([&a, &off])
        .args(["--max-relative-difference", "0.2"])
        .output()
        .unwrap();
    assert_ok(&o);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compare_rejects_bad_files_and_missing_steps() {
    let dir = tmpdir("compare-bad");
    let a = write(
        &dir,
        "a.jsonl",
        &[r#"{"step":1,"loss":5.5}"#, r#"{"step":2,"loss":5.0}"#],
    );
    let short = write(&dir, "short.jsonl", &[r#"{"step":1,"loss":5.5}"#]);
    let o = bin()
        .arg("compare")
        .args([&a, &short])
        .args(["--max-relative-difference", "0"])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(!o.status.success());
    assert!(out.contains("1 step in only one of the runs"), "{out}");
    assert!(err.contains("steps missing from one of the runs"), "{err}");

    let broken = write(
        &dir,
        "broken.jsonl",
        &[r#"{"step":1,"loss":5.5}"#, "not json"],
    );
    let o = bin().arg("compare").args([&a, &broken]).output().unwrap();
    common::assert_one_line_error(&o, &["broken.jsonl line 2", "not JSON"]);
    let o = bin()
        .arg("compare")
        .arg(&a)
        .arg(dir.join("missing.jsonl"))
        .output()
        .unwrap();
    common::assert_one_line_error(&o, &["missing.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
