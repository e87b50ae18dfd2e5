//! Tests of the flight recorder: recording through [`Recorded`] on the in-process backend, the
//! dump's file handling, and the analysis on hand-written dumps.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use meshgrad_tensor::{Device, Tensor};

use super::*;
use crate::comm::{run_ranks_each, RunOptions};
use crate::ReduceOp;

/// A hand-written entry of a collective on the world of `n` ranks.
fn coll(kind: &str, seq: u64, state: EntryState, n: usize) -> Entry {
    Entry {
        id: seq,
        group: "world".into(),
        ranks: (0..n).collect(),
        seq,
        kind: kind.into(),
        call: format!("{kind}(f32 [4])"),
        dtype: Some("f32".into()),
        shape: Some(vec![4]),
        op: None,
        root: None,
        peer: None,
        state,
        error: None,
        waiting_for: vec![],
        launched_ms: 1000 + seq,
        ended_ms: None,
    }
}

fn dump(rank: usize, n: usize, entries: Vec<Entry>) -> (PathBuf, Dump) {
    (
        PathBuf::from(file_name(rank)),
        Dump {
            version: Dump::VERSION,
            rank,
            world_size: n,
            pid: 1,
            capacity: 1024,
            recorded: entries.len() as u64,
            started_ms: 0,
            dumped_ms: 5000,
            reasons: vec!["test".into()],
            entries,
        },
    )
}

/// `count` completed all-reduces, then (when `open`) one more launched.
fn at(count: u64, open: Option<EntryState>, n: usize) -> Vec<Entry> {
    let mut v: Vec<Entry> = (0..count)
        .map(|s| coll("all_reduce", s, EntryState::Completed, n))
        .collect();
    if let Some(state) = open {
        v.push(coll("all_reduce", count, state, n));
    }
    v
}

fn timed_out(mut entries: Vec<Entry>, waiting: &[usize]) -> Vec<Entry> {
    let e = entries.last_mut().unwrap();
    e.state = EntryState::Failed;
    e.error = Some("timed out".into());
    e.waiting_for = waiting.to_vec();
    entries
}

#[test]
fn a_rank_behind_is_named_with_the_call_it_did_not_join() {
    let dumps = vec![
        dump(0, 4, timed_out(at(17, Some(EntryState::Launched), 4), &[2])),
        dump(1, 4, timed_out(at(17, Some(EntryState::Launched), 4), &[2])),
        dump(2, 4, at(17, None, 4)),
        dump(3, 4, at(17, Some(EntryState::Launched), 4)),
    ];
    let a = analyse(&dumps);
    assert_eq!(a.summary(), "flight: behind=2 call=all_reduce#17");
    assert_eq!(a.missing, Vec::<usize>::new());
    assert!(a.lines[0].starts_with("rank 0: 18 calls recorded; last completed all_reduce#16"));
    assert!(
        a.lines.last().unwrap().contains("not launched by 2"),
        "{:?}",
        a.lines
    );
}

#[test]
fn a_rank_without_a_dump_is_named_from_the_watchdogs_of_the_others() {
    // The SIGSTOP case: rank 2 cannot dump; the others time out waiting for it.
    let dumps = vec![
        dump(0, 4, timed_out(at(5, Some(EntryState::Launched), 4), &[2])),
        dump(1, 4, timed_out(at(5, Some(EntryState::Launched), 4), &[2])),
        dump(3, 4, timed_out(at(5, Some(EntryState::Launched), 4), &[2])),
    ];
    let a = analyse(&dumps);
    assert_eq!(a.summary(), "flight: behind=2 call=all_reduce#5");
    assert_eq!(a.missing, vec![2]);
    assert!(a.lines[2].starts_with("rank 2: no dump"), "{:?}", a.lines);
    // Without the watchdog's word, the open call still names the rank without a dump.
    let dumps = vec![dump(0, 2, at(3, Some(EntryState::Launched), 2))];
    assert_eq!(
        analyse(&dumps).summary(),
        "flight: behind=1 call=all_reduce#3"
    );
    // Nothing open: the rank without a dump is named, with no call.
    let dumps = vec![dump(0, 2, at(3, None, 2))];
    assert_eq!(analyse(&dumps).summary(), "flight: behind=1 call=none");
}

#[test]
fn ranks_that_launched_different_calls_disagree_there() {
    let mut odd = at(3, None, 3);
    odd.push(coll("all_gather", 3, EntryState::Launched, 3));
    let dumps = vec![
        dump(0, 3, at(3, Some(EntryState::Launched), 3)),
        dump(1, 3, odd),
        dump(2, 3, at(3, Some(EntryState::Launched), 3)),
    ];
    let a = analyse(&dumps);
    assert_eq!(a.summary(), "flight: behind=1 call=all_reduce#3");
    let why = a.lines.last().unwrap();
    assert!(why.contains("all_gather(f32 [4]) on 1"), "{why}");
    // A different shape is a different call too.
    let mut wide = at(2, Some(EntryState::Launched), 2);
    wide[1].call = "all_reduce(f32 [8])".into();
    let dumps = vec![
        dump(0, 2, at(2, Some(EntryState::Launched), 2)),
        dump(1, 2, wide),
    ];
    assert_eq!(
        analyse(&dumps).summary(),
        "flight: behind=1 call=all_reduce#1"
    );
}

#[test]
fn ranks_that_agree_name_nobody() {
    let dumps = vec![dump(0, 2, at(4, None, 2)), dump(1, 2, at(4, None, 2))];
    let a = analyse(&dumps);
    assert_eq!(a.summary(), "flight: behind=none call=none");
    assert_eq!(
        a.lines.last().unwrap(),
        "every rank's calls agree: no rank is behind"
    );
    // Open on every rank (a SIGUSR1 in the middle of a collective) is no disagreement either.
    let dumps = vec![
        dump(0, 2, at(4, Some(EntryState::Launched), 2)),
        dump(1, 2, at(4, Some(EntryState::Launched), 2)),
    ];
    assert_eq!(analyse(&dumps).summary(), "flight: behind=none call=none");
}

#[test]
fn all_to_alls_with_different_splits_agree_but_not_with_different_rows() {
    // Rank r's all-to-all #2: splits and leading dimension differ by rank, as they do.
    let a2a = |rank: usize, rows: usize, trailing: usize| {
        let mut v = at(2, None, 2);
        let mut e = coll("all_to_all", 2, EntryState::Completed, 2);
        e.call =
            format!("all_to_all(send [{rank}, {rows}], recv [1, 1], f32 [{rows}, {trailing}])");
        e.shape = Some(vec![rows, trailing]);
        v.push(e);
        v
    };
    let dumps = vec![dump(0, 2, a2a(0, 3, 4)), dump(1, 2, a2a(1, 5, 4))];
    assert_eq!(analyse(&dumps).summary(), "flight: behind=none call=none");
    let dumps = vec![dump(0, 2, a2a(0, 3, 4)), dump(1, 2, a2a(1, 5, 8))];
    let a = analyse(&dumps);
    assert_eq!(a.summary(), "flight: behind=1 call=all_to_all#2");
    let why = a.lines.last().unwrap();
    assert!(why.contains("all_to_all(f32 [*, 8]) on 1"), "{why}");
}

#[test]
fn a_wrapped_ring_proves_nothing_about_calls_it_dropped() {
    // Rank 1 kept only its last two calls; rank 0 its first ones on another group.
    let mut late = at(10, None, 2);
    late.drain(..8);
    let mut d1 = dump(1, 2, late);
    d1.1.recorded = 10;
    let dumps = vec![dump(0, 2, at(10, None, 2)), d1];
    assert_eq!(analyse(&dumps).summary(), "flight: behind=none call=none");
}

#[test]
fn an_open_receive_names_the_sender_that_did_not_send() {
    let p2p = |kind: &str, seq: u64, peer: usize, state: EntryState| Entry {
        kind: kind.into(),
        call: String::new(),
        peer: Some(peer),
        ..coll(kind, seq, state, 2)
    };
    let dumps = vec![
        dump(
            0,
            2,
            vec![
                p2p("send", 0, 1, EntryState::Completed),
                p2p("send", 1, 1, EntryState::Completed),
            ],
        ),
        dump(
            1,
            2,
            vec![
                p2p("recv", 0, 0, EntryState::Completed),
                p2p("recv", 1, 0, EntryState::Completed),
                p2p("recv", 2, 0, EntryState::Failed),
            ],
        ),
    ];
    let a = analyse(&dumps);
    assert_eq!(a.summary(), "flight: behind=0 call=send#2");
}

#[test]
fn dumps_are_written_atomically_and_read_back_with_one_line_errors() {
    let dir = std::env::temp_dir().join(format!("meshgrad-flight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let missing = read_all(&dir).unwrap_err().to_string();
    assert!(missing.contains("is not a folder"), "{missing}");
    let flight = dir.join("flight");
    std::fs::create_dir_all(&flight).unwrap();
    let none = read_all(&dir).unwrap_err().to_string();
    assert!(none.contains("no rank-R.json dumps in"), "{none}");
    let (_, d) = dump(1, 2, at(2, None, 2));
    let path = write(&flight, &d).unwrap();
    assert_eq!(path, flight.join("rank-1.json"));
    let names: Vec<String> = std::fs::read_dir(&flight)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["rank-1.json"], "no temporary file left");
    // The run's folder and its flight/ folder both work.
    for d2 in [&dir, &flight] {
        let read = read_all(d2).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].1, d);
    }
    std::fs::write(flight.join("rank-0.json"), "{\"rank\": 0,").unwrap();
    let bad = read_all(&dir).unwrap_err().to_string();
    assert!(
        bad.contains("rank-0.json") && bad.contains("malformed JSON"),
        "{bad}"
    );
    assert_eq!(bad.lines().count(), 1, "{bad}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn recorded_calls_on_threads_show_where_a_rank_stopped() {
    let recorders: Vec<Arc<Recorder>> = (0..2).map(|r| Arc::new(Recorder::new(r, 2, 16))).collect();
    let results = run_ranks_each(
        2,
        &RunOptions::with_timeout(Duration::from_millis(300)),
        |ctx| {
            let comm = Recorded::wrap(ctx.comm.clone(), recorders[ctx.rank].clone());
            let t = Tensor::from_vec(vec![1.0f32; 4], 4, Device::Cpu)?;
            comm.all_reduce(&t, ReduceOp::Sum)?.wait()?;
            let sub = comm.new_group(&[0, 1], "tp")?;
            sub.barrier()?.wait()?;
            if ctx.rank == 1 {
                // Rank 1 is late for the second all-reduce: rank 0's watchdog gives up first.
                std::thread::sleep(Duration::from_millis(900));
                return Ok(());
            }
            comm.all_reduce(&t, ReduceOp::Sum)?.wait()?;
            Ok(())
        },
    )
    .unwrap();
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("all_reduce #1"), "{err}");
    let d0 = recorders[0].snapshot();
    let labels: Vec<(String, String, EntryState)> = d0
        .entries
        .iter()
        .map(|e| (e.label(), e.group.clone(), e.state))
        .collect();
    assert_eq!(
        labels,
        vec![
            ("all_reduce#0".into(), "world".into(), EntryState::Completed),
            (
                "barrier#0".into(),
                "world/tp[0,1]#0".into(),
                EntryState::Completed
            ),
            ("all_reduce#1".into(), "world".into(), EntryState::Failed),
        ]
    );
    assert_eq!(d0.entries[2].waiting_for, vec![1]);
    assert_eq!(d0.entries[0].call, "all_reduce(sum, f32 [4])");
    let dumps = vec![
        (PathBuf::from("rank-0.json"), d0),
        (PathBuf::from("rank-1.json"), recorders[1].snapshot()),
    ];
    assert_eq!(
        analyse(&dumps).summary(),
        "flight: behind=1 call=all_reduce#1"
    );
}

#[test]
fn a_recorded_all_to_all_shows_its_splits() {
    let recorders: Vec<Arc<Recorder>> = (0..2).map(|r| Arc::new(Recorder::new(r, 2, 16))).collect();
    let results = run_ranks_each(
        2,
        &RunOptions::with_timeout(Duration::from_secs(5)),
        |ctx| {
            let comm = Recorded::wrap(ctx.comm.clone(), recorders[ctx.rank].clone());
            // Each rank keeps its own rows: rank 0 one, rank 1 two.
            let rows = 1 + ctx.rank;
            let t = Tensor::from_vec(vec![ctx.rank as f32; rows * 2], (rows, 2), Device::Cpu)?;
            let splits = if ctx.rank == 0 { [1, 0] } else { [0, 2] };
            let out = comm.all_to_all(&t, &splits, &splits)?.wait()?;
            assert_eq!(out.dims(), &[rows, 2]);
            Ok(())
        },
    )
    .unwrap();
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    let entries: Vec<Entry> = recorders
        .iter()
        .flat_map(|r| r.snapshot().entries)
        .collect();
    assert_eq!(entries[0].kind, "all_to_all");
    assert_eq!(entries[0].label(), "all_to_all#0");
    assert_eq!(
        entries[0].call,
        "all_to_all(send [1, 0], recv [1, 0], f32 [1, 2])"
    );
    assert_eq!(
        entries[1].call,
        "all_to_all(send [0, 2], recv [0, 2], f32 [2, 2])"
    );
    assert!(entries.iter().all(|e| e.state == EntryState::Completed));
}
