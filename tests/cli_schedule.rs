//! `meshgrad schedule`: the last line for GPipe with P = 4, M = 8 is
//! `bubble=0.2727 peak_activations=8 deadlock=no` (3/11 with 4 decimals), the grid has one row
//! per time step; bad arguments end in one `error:` line.

use crate::common;

use common::{assert_ok, assert_one_line_error, bin, text};

fn schedule(args: &[&str]) -> std::process::Output {
    bin().arg("schedule").args(args).output().unwrap()
}

#[test]
fn gpipe_last_line() {
    let o = schedule(&["--kind", "gpipe", "--stages", "4", "--microbatches", "8"]);
    assert_ok(&o);
    let (out, _) = text(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        *lines.last().unwrap(),
        "bubble=0.2727 peak_activations=8 deadlock=no"
    );
    // Header row, then 3 * (8 + 4 - 1) = 33 time steps; rank 3 starts at step 3.
    let head = lines
        .iter()
        .position(|l| l.trim_start().starts_with("t "))
        .unwrap();
    assert_eq!(
        lines[head].split_whitespace().collect::<Vec<_>>(),
        ["t", "rank0", "rank1", "rank2", "rank3"]
    );
    assert_eq!(
        lines[head + 4].split_whitespace().collect::<Vec<_>>(),
        ["3", "F3", "F2", "F1", "F0"]
    );
    assert!(lines[head + 33].trim_start().starts_with("32 "));
}

#[test]
fn other_kinds_last_lines() {
    let last = |args: &[&str]| {
        let o = schedule(args);
        assert_ok(&o);
        text(&o).0.lines().last().unwrap().to_string()
    };
    assert_eq!(
        last(&["--kind", "1f1b", "--stages", "4", "--microbatches", "8"]),
        "bubble=0.2727 peak_activations=4 deadlock=no"
    );
    assert_eq!(
        last(&["--kind", "zb", "--stages", "4", "--microbatches", "8"]),
        "bubble=0.1111 peak_activations=4 deadlock=no"
    );
    assert_eq!(
        last(&[
            "--kind",
            "interleaved",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--chunks",
            "2"
        ]),
        "bubble=0.1579 peak_activations=11 deadlock=no"
    );
}

#[test]
fn bad_arguments() {
    let o = schedule(&["--kind", "1f1b", "--stages", "0", "--microbatches", "8"]);
    assert_one_line_error(&o, &["stage"]);
    let o = schedule(&[
        "--kind",
        "interleaved",
        "--stages",
        "4",
        "--microbatches",
        "6",
    ]);
    assert_one_line_error(&o, &["divisible"]);
    let o = schedule(&[
        "--kind",
        "gpipe",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--chunks",
        "2",
    ]);
    assert_one_line_error(&o, &["--chunks", "interleaved"]);
}
