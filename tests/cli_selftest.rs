//! `meshgrad selftest`: on the CPU every check runs (f32 and bf16 against the CPU in f64, bf16
//! training against f32 training) and passes; a CUDA device that is not available here is
//! skipped with its reason and exit 0 (an error with `MESHGRAD_REQUIRE_CUDA=1`, as the GPU
//! session runs it); a filter matching nothing is an error.

use crate::common;

use common::{assert_ok, assert_one_line_error, bin, text};

#[test]
fn selftest_on_cpu_runs_every_check_and_passes() {
    let out = bin()
        .args(["selftest", "--device", "cpu", "--steps", "2"])
        .output()
        .unwrap();
    assert_ok(&out);
    let (stdout, _) = text(&out);
    let lines: Vec<&str> = stdout.lines().collect();
    let last = lines.last().expect("a summary line");
    assert!(last.starts_with("selftest: device=cpu checks="), "{last}");
    assert!(last.ends_with(" failed=0"), "{last}");
    let checks: usize = last
        .split("checks=")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("checks=N");
    // One line per check before the summary, each passing, with a measured error.
    assert_eq!(lines.len() - 1, checks, "{stdout}");
    for l in &lines[..lines.len() - 1] {
        assert!(l.ends_with(" ok"), "{l}");
        assert!(l.contains("max_err="), "{l}");
    }
    for case in [
        "attention_causal_d64 bf16",
        "layer_norm f32",
        "matmul bf16",
        "tiny_gpt_2_steps bf16",
    ] {
        assert!(stdout.contains(case), "missing {case}: {stdout}");
    }
}

#[test]
fn selftest_skips_an_unavailable_cuda_device() {
    // This machine has no GPU (CI never has one); a build without `--features cuda` says so too.
    let out = bin()
        .args(["selftest", "--device", "cuda"])
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    if stdout.contains("skipped") {
        assert_ok(&out);
        assert!(
            stdout.starts_with("selftest: device=cuda:0 skipped: "),
            "{stdout}"
        );
    } else {
        // A GPU is present: the selftest ran there.
        assert!(
            stdout.contains("selftest: device=cuda:0 checks="),
            "{stdout}"
        );
    }
}

#[test]
fn selftest_requiring_cuda_fails_where_it_would_skip() {
    let out = bin()
        .args(["selftest", "--device", "cuda"])
        .env("MESHGRAD_REQUIRE_CUDA", "1")
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    if !stdout.contains("checks=") {
        // No usable GPU here: what would be a skip is an error.
        assert_one_line_error(
            &out,
            &["selftest: device=cuda:0: ", "MESHGRAD_REQUIRE_CUDA=1"],
        );
    }
}

#[test]
fn selftest_filter_matching_nothing_is_an_error() {
    let out = bin()
        .args(["selftest", "--device", "cpu", "--filter", "no-such-op"])
        .output()
        .unwrap();
    assert_one_line_error(&out, &["no case matches the filter"]);
}
