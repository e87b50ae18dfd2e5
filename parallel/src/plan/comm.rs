//! The alpha-beta cost of collectives, per topology level.
//!
//! A message of `B` bytes over a link costs `alpha + B / beta` (`alpha` the latency, `beta` the
//! bandwidth each way). A group of ranks uses one level of the topology:
//!
//! * inside one node (the whole group on one node): the devices' links (NVLink), `beta` per
//!   device;
//! * across nodes: the network, where the node's devices share the node's bandwidth: `beta =
//!   node bandwidth / devices per node` per device (every device of a node is busy in a group of
//!   its own at the same time in a layout's collectives).
//!
//! Ranks are numbered node by node, so a group of `n` ranks `stride` apart spans `n * stride`
//! consecutive ranks: it stays inside a node when that span fits in one (and divides it).
//!
//! The collectives, for a group of `n` ranks (textbook forms, e.g. Thakur, Rabenseifner and
//! Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):
//!
//! | collective | cost |
//! |---|---|
//! | ring all-reduce of `B` bytes | `2 (n-1) alpha + 2 (n-1)/n B / beta` |
//! | tree all-reduce (pipelined reduce then broadcast) | `2 ceil(log2 n) alpha + 2 B / beta` |
//! | all-reduce | the cheaper of the two |
//! | all-gather to `B` bytes on every rank (ring) | `(n-1) alpha + (n-1)/n B / beta` |
//! | reduce-scatter of `B` bytes per rank (ring) | `(n-1) alpha + (n-1)/n B / beta` |
//! | all-to-all of `B` bytes per rank (pairwise) | `(n-1) alpha + (n-1)/n B / beta` |
//! | point-to-point of `B` bytes | `alpha + B / beta` |
//!
//! A group of one rank costs nothing.

use super::device::{DeviceKind, Link};

/// Where a group's messages travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Inside one node (NVLink).
    IntraNode,
    /// Across nodes (the network).
    InterNode,
}

/// A group of ranks and the link each of them has for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Group {
    /// Ranks.
    pub size: usize,
    /// The topology level.
    pub level: Level,
    /// Latency of one message, seconds.
    pub alpha: f64,
    /// Bandwidth per rank each way, bytes per second.
    pub beta: f64,
}

/// The two levels of a cluster.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Topology {
    /// Inside a node, per device.
    pub intra: Link,
    /// Between nodes, per node.
    pub inter: Link,
    /// Devices per node.
    pub devices_per_node: usize,
}

impl Topology {
    /// The topology of nodes of `devices_per_node` devices of `kind`.
    pub fn new(kind: &DeviceKind, devices_per_node: usize) -> Topology {
        Topology {
            intra: kind.intra_node,
            inter: kind.inter_node,
            devices_per_node: devices_per_node.max(1),
        }
    }

    /// The group of `size` ranks `stride` apart (see the [module docs](self)).
    pub fn group(&self, size: usize, stride: usize) -> Group {
        let g = self.devices_per_node;
        let span = size.saturating_mul(stride.max(1));
        if span <= g && g.is_multiple_of(span.max(1)) {
            Group {
                size,
                level: Level::IntraNode,
                alpha: self.intra.latency_s(),
                beta: self.intra.bytes_per_s(),
            }
        } else {
            Group {
                size,
                level: Level::InterNode,
                alpha: self.inter.latency_s(),
                beta: self.inter.bytes_per_s() / g as f64,
            }
        }
    }
}

fn steps(g: &Group) -> f64 {
    g.size.saturating_sub(1) as f64
}

/// Ring all-reduce of `bytes` per rank.
pub fn ring_all_reduce(g: &Group, bytes: f64) -> f64 {
    if g.size <= 1 {
        return 0.0;
    }
    let n = g.size as f64;
    2.0 * steps(g) * g.alpha + 2.0 * (n - 1.0) / n * bytes / g.beta
}

/// Tree all-reduce (pipelined reduce then broadcast) of `bytes` per rank.
pub fn tree_all_reduce(g: &Group, bytes: f64) -> f64 {
    if g.size <= 1 {
        return 0.0;
    }
    let depth = (g.size as f64).log2().ceil();
    2.0 * depth * g.alpha + 2.0 * bytes / g.beta
}

/// All-reduce of `bytes` per rank: the cheaper of ring and tree.
pub fn all_reduce(g: &Group, bytes: f64) -> f64 {
    ring_all_reduce(g, bytes).min(tree_all_reduce(g, bytes))
}

/// Ring all-gather whose result is `bytes` on every rank.
pub fn all_gather(g: &Group, bytes: f64) -> f64 {
    one_pass(g, bytes)
}

/// Ring reduce-scatter of `bytes` per rank (each rank keeps `bytes / n`).
pub fn reduce_scatter(g: &Group, bytes: f64) -> f64 {
    one_pass(g, bytes)
}

/// Pairwise all-to-all of `bytes` per rank (a `1/n` part to every other rank).
pub fn all_to_all(g: &Group, bytes: f64) -> f64 {
    one_pass(g, bytes)
}

fn one_pass(g: &Group, bytes: f64) -> f64 {
    if g.size <= 1 {
        return 0.0;
    }
    let n = g.size as f64;
    steps(g) * g.alpha + (n - 1.0) / n * bytes / g.beta
}

/// One point-to-point message of `bytes` over `g`'s link (0 for no bytes).
pub fn p2p(g: &Group, bytes: f64) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    g.alpha + bytes / g.beta
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo() -> Topology {
        Topology::new(&DeviceKind::preset("a100-80gb").unwrap(), 8)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-30)
    }

    #[test]
    fn levels_follow_the_placement() {
        let t = topo();
        // 8 adjacent ranks: one node, NVLink at 300 GB/s each way.
        let g = t.group(8, 1);
        assert_eq!((g.level, g.beta), (Level::IntraNode, 300e9));
        // 4 ranks 2 apart: span 8, still one node.
        assert_eq!(t.group(4, 2).level, Level::IntraNode);
        // 2 ranks 8 apart: two nodes, 200 GB/s per node shared by 8 GPUs = 25 GB/s each.
        let g = t.group(2, 8);
        assert_eq!(g.level, Level::InterNode);
        assert!(close(g.beta, 25e9));
        assert!(close(g.alpha, 10e-6));
        // 3 ranks 2 apart (span 6 does not divide 8): straddles nodes.
        assert_eq!(t.group(3, 2).level, Level::InterNode);
    }

    #[test]
    fn collectives_match_the_textbook_formulas() {
        let g = Group {
            size: 4,
            level: Level::IntraNode,
            alpha: 5e-6,
            beta: 100e9,
        };
        let b = 1e9;
        // Ring all-reduce: 2 (n-1) alpha + 2 (n-1)/n B/beta = 6 * 5us + 1.5 * 10 ms.
        assert!(close(ring_all_reduce(&g, b), 30e-6 + 15e-3));
        // Tree: 2 log2(4) alpha + 2 B/beta = 20 us + 20 ms.
        assert!(close(tree_all_reduce(&g, b), 20e-6 + 20e-3));
        assert!(close(all_reduce(&g, b), 30e-6 + 15e-3));
        // Small messages: the tree's fewer steps win. 1 KB: ring 30us + 15ns, tree 20us + 20ns.
        assert!(close(all_reduce(&g, 1e3), 20e-6 + 20e-9));
        // All-gather, reduce-scatter, all-to-all: (n-1) alpha + (n-1)/n B/beta.
        for f in [all_gather, reduce_scatter, all_to_all] {
            assert!(close(f(&g, b), 15e-6 + 7.5e-3));
        }
        // Point-to-point: alpha + B/beta.
        assert!(close(p2p(&g, b), 5e-6 + 10e-3));
        assert_eq!(p2p(&g, 0.0), 0.0);
        // A reduce-scatter then an all-gather cost what a ring all-reduce costs.
        assert!(close(
            reduce_scatter(&g, b) + all_gather(&g, b),
            ring_all_reduce(&g, b)
        ));
        // One rank: nothing to do.
        let one = Group { size: 1, ..g };
        assert_eq!(all_reduce(&one, b) + all_gather(&one, b), 0.0);
    }
}
