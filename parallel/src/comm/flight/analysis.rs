//! Reading every rank's dump together: where each rank is, the first call where the ranks
//! disagree, and the ranks that are behind.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use super::dump::{Dump, Entry};

/// The first call where the ranks disagree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disagreement {
    /// The group's key.
    pub group: String,
    /// The group's members (global ranks).
    pub ranks: Vec<usize>,
    /// The call's kind: the one the ranks that launched it made (for point-to-point, the call
    /// the rank behind did not make: `send` for a receive left waiting).
    pub kind: String,
    /// Its sequence number on the group (per peer for point-to-point).
    pub seq: u64,
    /// Why, in words.
    pub why: String,
}

/// What [`analyse`] found in a set of dumps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Analysis {
    /// The job's number of ranks (from the dumps).
    pub world_size: usize,
    /// Ranks with a dump.
    pub dumped: Vec<usize>,
    /// Ranks without one (a stopped, killed or hung rank cannot write one).
    pub missing: Vec<usize>,
    /// The ranks behind: at the first disagreement, the members that did not launch the call
    /// (or launched a different one); ranks without a dump when nothing else is known.
    pub behind: Vec<usize>,
    /// The first call where the ranks disagree, if any.
    pub call: Option<Disagreement>,
    /// The report: one line per rank (its last completed and its open calls), then the finding.
    pub lines: Vec<String>,
}

impl Analysis {
    /// The last line: `flight: behind=<ranks> call=<kind>#<seq>`, with `none` for either when
    /// there is nothing to name (`flight: behind=none call=none`: every rank agrees).
    pub fn summary(&self) -> String {
        let behind = if self.behind.is_empty() {
            "none".to_string()
        } else {
            join(&self.behind)
        };
        let call = self
            .call
            .as_ref()
            .map_or("none".to_string(), |c| format!("{}#{}", c.kind, c.seq));
        format!("flight: behind={behind} call={call}")
    }
}

fn join(ranks: &[usize]) -> String {
    let v: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    v.join(",")
}

fn join_set(ranks: &BTreeSet<usize>) -> String {
    join(&ranks.iter().copied().collect::<Vec<_>>())
}

fn is_p2p(e: &Entry) -> bool {
    e.kind == "send" || e.kind == "recv"
}

/// What makes two ranks' calls at one position the same call. An all-to-all's splits and
/// leading dimension differ from rank to rank by design: its signature is the dtype and the
/// rows' trailing shape.
fn signature(e: &Entry) -> String {
    if e.kind == "all_to_all" {
        let trailing: Vec<String> = e
            .shape
            .iter()
            .flat_map(|s| s.iter().skip(1))
            .map(|d| d.to_string())
            .collect();
        return format!(
            "all_to_all({} [*{}])",
            e.dtype.as_deref().unwrap_or("?"),
            trailing
                .iter()
                .map(|d| format!(", {d}"))
                .collect::<String>()
        );
    }
    if e.call.is_empty() {
        format!(
            "{}({:?} {:?} {:?} {:?})",
            e.kind, e.op, e.root, e.dtype, e.shape
        )
    } else {
        e.call.clone()
    }
}

/// A possible first disagreement, with when it began (the earliest launch among its entries).
struct Candidate {
    at_ms: u64,
    found: Disagreement,
    behind: BTreeSet<usize>,
}

/// One group's collectives as the dumps show them: members, and per dumped member its entries
/// by sequence number.
struct GroupView<'a> {
    ranks: Vec<usize>,
    per_rank: BTreeMap<usize, BTreeMap<u64, &'a Entry>>,
}

/// Analyses the dumps of one job (each rank's at most once; see [`super::read_all`]): for each
/// group, the lowest sequence number where the members' records disagree: a member with a dump
/// did not launch it (its last call on the group has a lower number, or it never used the group
/// and its ring did not wrap), members launched different calls there (kind, reduce op, root,
/// dtype or shape), or it is still open on some member while a member has no dump or the
/// watchdog was waiting for one. The ranks behind are the members that did not launch it (or
/// launched the minority's call), the members without a dump (those the watchdog was waiting
/// for, when it says), or else those the watchdog names. Point-to-point: a receive still open
/// whose sender has no dump or sent fewer messages (and the converse for sends). Of the groups'
/// findings, the one launched first is reported. With no finding but ranks without a dump,
/// those are named as behind, with no call.
pub fn analyse(dumps: &[(PathBuf, Dump)]) -> Analysis {
    let by_rank: BTreeMap<usize, &Dump> = dumps.iter().map(|(_, d)| (d.rank, d)).collect();
    let world_size = dumps
        .iter()
        .flat_map(|(_, d)| {
            std::iter::once(d.world_size)
                .chain(d.entries.iter().flat_map(|e| e.ranks.iter().map(|r| r + 1)))
        })
        .max()
        .unwrap_or(0);
    let missing: Vec<usize> = (0..world_size)
        .filter(|r| !by_rank.contains_key(r))
        .collect();
    let mut lines: Vec<String> = Vec::new();
    let newest = dumps.iter().map(|(_, d)| d.dumped_ms).max().unwrap_or(0);
    for r in 0..world_size {
        match by_rank.get(&r) {
            Some(d) => lines.push(rank_line(d, newest)),
            None => lines.push(format!(
                "rank {r}: no dump (a stopped, killed or hung rank cannot write one)"
            )),
        }
    }

    let mut groups: BTreeMap<&str, GroupView<'_>> = BTreeMap::new();
    for (_, d) in dumps {
        for e in d.entries.iter().filter(|e| !is_p2p(e)) {
            let g = groups.entry(&e.group).or_insert_with(|| GroupView {
                ranks: e.ranks.clone(),
                per_rank: BTreeMap::new(),
            });
            g.per_rank.entry(d.rank).or_default().insert(e.seq, e);
        }
    }
    let mut candidates: Vec<Candidate> = groups
        .iter()
        .filter_map(|(key, g)| group_disagreement(key, g, &by_rank))
        .collect();
    candidates.extend(p2p_disagreements(&by_rank));
    let first = candidates.into_iter().min_by(|a, b| {
        (a.at_ms, &a.found.group, a.found.seq).cmp(&(b.at_ms, &b.found.group, b.found.seq))
    });

    let (behind, call) = match first {
        Some(c) => {
            lines.push(format!("first disagreement: {}", c.found.why));
            (c.behind.into_iter().collect(), Some(c.found))
        }
        None if !missing.is_empty() => {
            lines.push(format!(
                "no call where the dumped ranks disagree; ranks {} wrote no dump",
                join(&missing)
            ));
            (missing.clone(), None)
        }
        None => {
            lines.push("every rank's calls agree: no rank is behind".to_string());
            (Vec::new(), None)
        }
    };
    Analysis {
        world_size,
        dumped: by_rank.keys().copied().collect(),
        missing,
        behind,
        call,
        lines,
    }
}

/// `rank 0: last completed all_reduce#16 on world; open: all_reduce#17 on world (failed: ...;
/// waiting for 2); dumped for: watchdog: ...`.
fn rank_line(d: &Dump, newest: u64) -> String {
    let last = d
        .entries
        .iter()
        .rev()
        .find(|e| e.state == super::EntryState::Completed)
        .map_or("none".to_string(), |e| {
            format!("{} on {}", e.label(), e.group)
        });
    let open: Vec<String> = d
        .entries
        .iter()
        .filter(|e| e.state.is_open())
        .map(|e| {
            let mut s = format!("{} on {} ({:?}", e.label(), e.group, e.state).to_lowercase();
            if !e.waiting_for.is_empty() {
                s += &format!(", waiting for {}", join(&e.waiting_for));
            }
            s + ")"
        })
        .collect();
    let open = match open.len() {
        0 => "none".to_string(),
        n if n > 3 => format!("{} and {} more", open[..3].join(", "), n - 3),
        _ => open.join(", "),
    };
    let mut line = format!(
        "rank {}: {} calls recorded; last completed {last}; open: {open}",
        d.rank, d.recorded
    );
    let age = newest.saturating_sub(d.dumped_ms);
    if age >= 1000 {
        line += &format!(
            "; dump written {:.1}s before the newest",
            age as f64 / 1000.0
        );
    }
    if let Some(r) = d.reasons.last() {
        line += &format!("; dumped for: {r}");
    }
    line
}

fn group_disagreement(
    key: &str,
    g: &GroupView<'_>,
    by_rank: &BTreeMap<usize, &Dump>,
) -> Option<Candidate> {
    let absent: BTreeSet<usize> = g
        .ranks
        .iter()
        .copied()
        .filter(|r| !by_rank.contains_key(r))
        .collect();
    let dumped: Vec<usize> = g
        .ranks
        .iter()
        .copied()
        .filter(|r| by_rank.contains_key(r))
        .collect();
    let empty = BTreeMap::new();
    let seqs: BTreeSet<u64> = g
        .per_rank
        .values()
        .flat_map(|m| m.keys().copied())
        .collect();
    for s in seqs {
        let at: Vec<(usize, &Entry)> = dumped
            .iter()
            .filter_map(|r| g.per_rank.get(r)?.get(&s).map(|e| (*r, *e)))
            .collect();
        let not_launched: BTreeSet<usize> = dumped
            .iter()
            .copied()
            .filter(|r| {
                let m = g.per_rank.get(r).unwrap_or(&empty);
                match m.keys().next_back() {
                    Some(&max) => s > max,
                    None => !by_rank[r].wrapped(),
                }
            })
            .collect();
        let mut by_sig: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (r, e) in &at {
            by_sig.entry(signature(e)).or_default().push(*r);
        }
        let open = at.iter().any(|(_, e)| e.state.is_open());
        let waiting: BTreeSet<usize> = at
            .iter()
            .flat_map(|(_, e)| e.waiting_for.iter().copied())
            .collect();
        let differ = by_sig.len() > 1;
        if !(differ
            || !not_launched.is_empty()
            || (open && !(absent.is_empty() && waiting.is_empty())))
        {
            continue;
        }
        // The majority's call: most holders, then the one the lowest rank made.
        let majority = by_sig
            .iter()
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.1[0].cmp(&a.1[0])))
            .map(|(sig, _)| sig.clone())?;
        let mut behind: BTreeSet<usize> = not_launched.clone();
        for (sig, holders) in &by_sig {
            if *sig != majority {
                behind.extend(holders);
            }
        }
        let absent_behind: BTreeSet<usize> = if open {
            absent
                .iter()
                .copied()
                .filter(|r| waiting.is_empty() || waiting.contains(r))
                .collect()
        } else {
            BTreeSet::new()
        };
        behind.extend(&absent_behind);
        if behind.is_empty() {
            behind.extend(&waiting);
        }
        if behind.is_empty() {
            continue;
        }
        let first = at
            .iter()
            .find(|(_, e)| signature(e) == majority)
            .map(|(_, e)| *e)?;
        let launched_by: Vec<usize> = at.iter().map(|(r, _)| *r).collect();
        let mut why = format!(
            "{} on group {} (ranks {}): launched by {}",
            first.label(),
            key,
            join(&g.ranks),
            join(&launched_by)
        );
        if differ {
            let calls: Vec<String> = by_sig
                .iter()
                .map(|(sig, holders)| format!("{sig} on {}", join(holders)))
                .collect();
            why += &format!(" as different calls: {}", calls.join(" vs "));
        } else {
            why += &format!(" as {}", first.call);
        }
        if !not_launched.is_empty() {
            why += &format!("; not launched by {}", join_set(&not_launched));
        }
        if !absent_behind.is_empty() {
            why += &format!("; no dump from {}", join_set(&absent_behind));
        }
        if !waiting.is_empty() {
            why += &format!("; the watchdog was waiting for {}", join_set(&waiting));
        }
        return Some(Candidate {
            at_ms: at.iter().map(|(_, e)| e.launched_ms).min().unwrap_or(0),
            found: Disagreement {
                group: key.to_string(),
                ranks: g.ranks.clone(),
                kind: first.kind.clone(),
                seq: s,
                why,
            },
            behind,
        });
    }
    None
}

/// Open receives (sends) whose peer has no dump or sent (received) fewer messages on the group.
fn p2p_disagreements(by_rank: &BTreeMap<usize, &Dump>) -> Vec<Candidate> {
    // (group, kind, from rank, to peer) -> the highest sequence number recorded.
    let mut max_seq: BTreeMap<(&str, &str, usize, usize), u64> = BTreeMap::new();
    for d in by_rank.values() {
        for e in d.entries.iter().filter(|e| is_p2p(e)) {
            if let Some(p) = e.peer {
                let m = max_seq
                    .entry((e.group.as_str(), e.kind.as_str(), d.rank, p))
                    .or_insert(0);
                *m = (*m).max(e.seq);
            }
        }
    }
    let mut out = Vec::new();
    for d in by_rank.values() {
        for e in d.entries.iter().filter(|e| is_p2p(e) && e.state.is_open()) {
            let Some(p) = e.peer else { continue };
            let other = if e.kind == "recv" { "send" } else { "recv" };
            let behind = match by_rank.get(&p) {
                None => true,
                Some(pd) => match max_seq.get(&(e.group.as_str(), other, p, d.rank)) {
                    Some(&m) => m < e.seq,
                    None => !pd.wrapped(),
                },
            };
            if !behind {
                continue;
            }
            let why = format!(
                "rank {} waits in {} {} {p} on group {} (ranks {}); rank {p} {} its {other}#{}",
                d.rank,
                e.label(),
                if e.kind == "recv" { "from" } else { "to" },
                e.group,
                join(&e.ranks),
                if by_rank.contains_key(&p) {
                    "did not make"
                } else {
                    "wrote no dump: it may not have made"
                },
                e.seq
            );
            out.push(Candidate {
                at_ms: e.launched_ms,
                found: Disagreement {
                    group: e.group.clone(),
                    ranks: e.ranks.clone(),
                    kind: other.to_string(),
                    seq: e.seq,
                    why,
                },
                behind: BTreeSet::from([p]),
            });
        }
    }
    out
}
