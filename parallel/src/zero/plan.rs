//! The sharding plan: which slice of which flat buffer each rank owns.
//!
//! Parameters are grouped into *units* (FSDP's wrap units; one per transformer block plus a root
//! unit by default). Each unit's parameters are laid end to end, in registration order, in a
//! flat index space of `numel` elements, padded with zeros to `padded = shard_len * world`, a
//! multiple of the shard-group size `world`. Rank `r` owns the contiguous slice
//! `[r * shard_len, (r + 1) * shard_len)`.
//!
//! A parameter may straddle shards. The intersection of a rank's slice with one parameter is a
//! [`Segment`]; the sharded optimizer updates each segment with its parameter's group
//! hyper-parameters, so the update is exactly the unsharded one, element by element.

use std::ops::Range;

use meshgrad_tensor::Result;

/// One parameter's place in the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanParam {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// The unit it belongs to.
    pub unit: usize,
    /// Its optimizer parameter group.
    pub group: usize,
    /// Its first element's offset in its unit's flat space.
    pub offset: usize,
}

/// One unit's flat space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanUnit {
    /// The unit's name (`root`, `h.0`, ...).
    pub name: String,
    /// Indices (into [`ShardPlan::params`]) of its parameters, in flat order.
    pub params: Vec<usize>,
    /// Elements of its parameters.
    pub numel: usize,
    /// Elements of each rank's shard: `ceil(numel / world)`.
    pub shard_len: usize,
}

impl PlanUnit {
    /// The padded flat length, `shard_len * world`.
    pub fn padded(&self, world: usize) -> usize {
        self.shard_len * world
    }
}

/// The intersection of one rank's shard of a unit with one parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the parameter (into [`ShardPlan::params`]).
    pub param: usize,
    /// Elements of the (flattened) parameter this segment covers.
    pub param_range: Range<usize>,
    /// Where the segment starts in the rank's shard of the unit.
    pub shard_offset: usize,
}

impl Segment {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.param_range.len()
    }

    /// Whether the segment is empty (never, for segments the plan returns).
    pub fn is_empty(&self) -> bool {
        self.param_range.is_empty()
    }
}

/// The sharding plan of a list of parameters over a shard group of `world` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    /// The parameters, in registration order.
    pub params: Vec<PlanParam>,
    /// The units.
    pub units: Vec<PlanUnit>,
    /// Shard-group size.
    pub world: usize,
}

/// What [`ShardPlan::new`] needs to know about a parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Unit index (into the unit names).
    pub unit: usize,
    /// Optimizer group.
    pub group: usize,
}

impl ShardPlan {
    /// Lays out `params` (in registration order) in the units named `unit_names` for a shard
    /// group of `world` ranks. Every unit must get at least one parameter.
    pub fn new(params: Vec<ParamSpec>, unit_names: Vec<String>, world: usize) -> Result<Self> {
        if world == 0 {
            meshgrad_tensor::bail!("shard plan: the shard group must have at least 1 rank");
        }
        let mut units: Vec<PlanUnit> = unit_names
            .into_iter()
            .map(|name| PlanUnit {
                name,
                params: Vec::new(),
                numel: 0,
                shard_len: 0,
            })
            .collect();
        let mut out = Vec::with_capacity(params.len());
        for (i, p) in params.into_iter().enumerate() {
            let Some(unit) = units.get_mut(p.unit) else {
                meshgrad_tensor::bail!(
                    "shard plan: parameter {} is assigned to unit {}, but there are only {} units",
                    p.name,
                    p.unit,
                    units.len()
                );
            };
            let numel: usize = p.shape.iter().product();
            unit.params.push(i);
            out.push(PlanParam {
                offset: unit.numel,
                numel,
                name: p.name,
                shape: p.shape,
                unit: p.unit,
                group: p.group,
            });
            unit.numel += numel;
        }
        for u in &mut units {
            if u.params.is_empty() {
                meshgrad_tensor::bail!("shard plan: unit {} has no parameters", u.name);
            }
            u.shard_len = u.numel.div_ceil(world);
        }
        Ok(ShardPlan {
            params: out,
            units,
            world,
        })
    }

    /// The flat range of unit `unit` that rank `rank` owns.
    pub fn shard_range(&self, unit: usize, rank: usize) -> Range<usize> {
        let s = self.units[unit].shard_len;
        rank * s..(rank + 1) * s
    }

    /// The segments of rank `rank`'s shard of unit `unit`, in flat order.
    pub fn segments(&self, unit: usize, rank: usize) -> Vec<Segment> {
        let shard = self.shard_range(unit, rank);
        let mut out = Vec::new();
        for &pi in &self.units[unit].params {
            let p = &self.params[pi];
            let (lo, hi) = (
                p.offset.max(shard.start),
                (p.offset + p.numel).min(shard.end),
            );
            if lo < hi {
                out.push(Segment {
                    param: pi,
                    param_range: lo - p.offset..hi - p.offset,
                    shard_offset: lo - shard.start,
                });
            }
        }
        out
    }

    /// Total elements of all parameters.
    pub fn numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Total elements of one rank's shards (padding included).
    pub fn shard_numel(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize], unit: usize, group: usize) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            unit,
            group,
        }
    }

    #[test]
    fn segments_tile_every_parameter_exactly_once() {
        let params = vec![
            spec("a", &[3, 5], 0, 0),
            spec("b", &[7], 1, 1),
            spec("c", &[2, 2], 0, 1),
            spec("d", &[1], 1, 0),
        ];
        for world in 1..=6 {
            let plan =
                ShardPlan::new(params.clone(), vec!["u0".into(), "u1".into()], world).unwrap();
            assert_eq!(plan.numel(), 15 + 7 + 4 + 1);
            let mut covered: Vec<Vec<bool>> =
                plan.params.iter().map(|p| vec![false; p.numel]).collect();
            for u in 0..plan.units.len() {
                let unit = &plan.units[u];
                assert!(unit.padded(world) >= unit.numel);
                assert!(unit.padded(world) - unit.numel < world);
                for r in 0..world {
                    let mut last_end = 0;
                    for s in plan.segments(u, r) {
                        assert!(s.shard_offset >= last_end);
                        last_end = s.shard_offset + s.len();
                        assert!(last_end <= unit.shard_len);
                        let p = &plan.params[s.param];
                        // Flat position agrees with the shard position.
                        assert_eq!(
                            p.offset + s.param_range.start,
                            r * unit.shard_len + s.shard_offset
                        );
                        for i in s.param_range.clone() {
                            assert!(!covered[s.param][i], "element covered twice");
                            covered[s.param][i] = true;
                        }
                    }
                }
            }
            assert!(covered.iter().all(|c| c.iter().all(|&x| x)));
        }
    }

    #[test]
    fn bad_plans_are_errors() {
        let e = ShardPlan::new(vec![spec("a", &[2], 1, 0)], vec!["u0".into()], 2).unwrap_err();
        assert!(e.to_string().contains("parameter a"), "{e}");
        let e = ShardPlan::new(
            vec![spec("a", &[2], 0, 0)],
            vec!["u0".into(), "u1".into()],
            2,
        )
        .unwrap_err();
        assert!(e.to_string().contains("unit u1 has no parameters"), "{e}");
        assert!(ShardPlan::new(vec![], vec![], 0).is_err());
    }
}
