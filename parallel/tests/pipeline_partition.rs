//! Automatic pipeline partitioning: the dynamic program against brute force on random costs,
//! speed and memory objectives against `even`, explicit boundaries and the one-line errors.

use meshgrad_nn::StageSpec;
use meshgrad_parallel::pipeline::partition::{
    even, explicit, optimize, LayerCost, MemoryModel, ModelCosts, Objective, Partition,
    PartitionMethod,
};

/// SplitMix64: deterministic test randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_layer(rng: &mut Rng, name: String, integer_times: bool) -> LayerCost {
    let time = if integer_times {
        // Small integers: many exact ties, to exercise the tie-breaking.
        (1 + rng.below(6)) as f64
    } else {
        0.1 + rng.below(10_000) as f64 / 1000.0
    };
    let scale = if integer_times { 4 } else { 1000 };
    LayerCost::new(name, time).with_memory(
        rng.below(scale) * 4,
        rng.below(scale) * 4,
        rng.below(scale) * 8,
        rng.below(scale) * 2,
    )
}

fn random_costs(rng: &mut Rng, integer_times: bool) -> ModelCosts {
    let embedding = rng.below(2) == 0;
    let head = rng.below(2) == 0;
    let extra = usize::from(embedding) + usize::from(head);
    // At most 10 layers in all.
    let n = 1 + rng.below((10 - extra) as u64) as usize;
    let blocks = (0..n)
        .map(|i| random_layer(rng, format!("h.{i}"), integer_times))
        .collect();
    ModelCosts::new(
        embedding.then(|| random_layer(rng, "embedding".into(), integer_times)),
        blocks,
        head.then(|| random_layer(rng, "head".into(), integer_times)),
    )
    .unwrap()
}

/// Every list of first blocks splitting `n` blocks into `p` non-empty stages.
fn all_boundaries(n: usize, p: usize) -> Vec<Vec<usize>> {
    fn rec(start: usize, n: usize, left: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        cur.push(start);
        if left == 1 {
            out.push(cur.clone());
        } else {
            for next in start + 1..=n - (left - 1) {
                rec(next, n, left - 1, cur, out);
            }
        }
        cur.pop();
    }
    let mut out = Vec::new();
    rec(0, n, p, &mut Vec::new(), &mut out);
    out
}

/// Each stage's (time, memory), computed directly from the layer list (embedding with the first
/// stage, head with the last, summed in layer order).
fn brute_stage_costs(costs: &ModelCosts, mem: &MemoryModel, b: &[usize]) -> Vec<(f64, u64)> {
    let n = costs.n_blocks();
    let layers = costs.layers();
    let e = usize::from(costs.has_embedding());
    (0..b.len())
        .map(|s| {
            let i = b[s];
            let j = b.get(s + 1).copied().unwrap_or(n);
            let mut idx: Vec<usize> = Vec::new();
            if s == 0 && costs.has_embedding() {
                idx.push(0);
            }
            idx.extend((i..j).map(|k| k + e));
            if s + 1 == b.len() && costs.has_head() {
                idx.push(layers.len() - 1);
            }
            let mut t = 0.0;
            let (mut state, mut act) = (0u64, 0u64);
            for &l in &idx {
                t += layers[l].time_ms;
                state += layers[l].param_bytes + layers[l].grad_bytes + layers[l].optimizer_bytes;
                act += layers[l].activation_bytes_per_microbatch;
            }
            (t, state + act * mem.in_flight[s] as u64)
        })
        .collect()
}

/// The brute-force optimum: (objective value, other objective, boundaries) minimised
/// lexicographically over the splits within the limit; `None` when none fits.
fn brute_force(
    costs: &ModelCosts,
    mem: &MemoryModel,
    objective: Objective,
) -> Option<(f64, f64, Vec<usize>)> {
    let limit = mem.limit_bytes.unwrap_or(u64::MAX);
    let mut best: Option<(f64, f64, Vec<usize>)> = None;
    for b in all_boundaries(costs.n_blocks(), mem.stages()) {
        let sc = brute_stage_costs(costs, mem, &b);
        if sc.iter().any(|&(_, m)| m > limit) {
            continue;
        }
        let t = sc.iter().map(|c| c.0).fold(0.0, f64::max);
        let m = sc.iter().map(|c| c.1).max().unwrap() as f64;
        let key = match objective {
            Objective::Speed => (t, m, b),
            Objective::Memory => (m, t, b),
        };
        let better = match &best {
            None => true,
            Some(cur) => {
                (key.0, key.1)
                    .partial_cmp(&(cur.0, cur.1))
                    .unwrap()
                    .then_with(|| key.2.cmp(&cur.2))
                    == std::cmp::Ordering::Less
            }
        };
        if better {
            best = Some(key);
        }
    }
    best
}

fn smallest_max_memory(costs: &ModelCosts, mem: &MemoryModel) -> u64 {
    all_boundaries(costs.n_blocks(), mem.stages())
        .iter()
        .map(|b| {
            brute_stage_costs(costs, mem, b)
                .iter()
                .map(|c| c.1)
                .max()
                .unwrap()
        })
        .min()
        .unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

fn assert_one_line(msg: &str) {
    assert!(!msg.contains('\n'), "error is not one line: {msg}");
}

/// Checks a partition's predictions against the direct computation.
fn check_predictions(costs: &ModelCosts, mem: &MemoryModel, part: &Partition) {
    let sc = brute_stage_costs(costs, mem, &part.boundaries);
    assert_eq!(part.stages.len(), sc.len());
    for (st, &(t, m)) in part.stages.iter().zip(&sc) {
        assert!(close(st.time_ms, t), "{} vs {t}", st.time_ms);
        assert_eq!(st.memory_bytes, m);
    }
    let specs = part.stage_specs().unwrap();
    StageSpec::check_partition(&specs, costs.n_blocks()).unwrap();
    for (spec, st) in specs.iter().zip(&part.stages) {
        assert_eq!(spec.blocks, st.blocks);
    }
}

#[test]
fn dp_matches_brute_force_on_random_costs() {
    let mut rng = Rng(0x5eed_0001);
    let mut cases = 0;
    let mut infeasible = 0;
    for case in 0..600 {
        let integer_times = case % 2 == 0;
        let costs = random_costs(&mut rng, integer_times);
        let n = costs.n_blocks();
        let p = 1 + rng.below(n.min(4) as u64) as usize;
        let base = if rng.below(2) == 0 {
            MemoryModel::one_f_one_b(p, 1 + rng.below(6) as usize)
        } else {
            MemoryModel::new((0..p).map(|_| rng.below(5) as usize).collect())
        };
        let smallest = smallest_max_memory(&costs, &base);
        let limits = [
            None,
            Some(smallest),
            Some(smallest + rng.below(smallest / 2 + 2)),
            smallest.checked_sub(1),
        ];
        for limit in limits {
            let mem = match limit {
                Some(l) => base.clone().with_limit(l),
                None => base.clone(),
            };
            for objective in [Objective::Speed, Objective::Memory] {
                cases += 1;
                let got = optimize(&costs, &mem, objective);
                match brute_force(&costs, &mem, objective) {
                    Some((value, other, b)) => {
                        let part = got.unwrap_or_else(|e| {
                            panic!(
                                "case {case}: {objective} failed but brute force found {b:?}: {e}"
                            )
                        });
                        assert!(
                            close(part.objective_value(objective), value),
                            "case {case} {objective}: dp {} vs brute force {value}",
                            part.objective_value(objective)
                        );
                        let other_obj = match objective {
                            Objective::Speed => Objective::Memory,
                            Objective::Memory => Objective::Speed,
                        };
                        assert!(close(part.objective_value(other_obj), other));
                        if integer_times {
                            // Exact sums: the tie-breaking must pick the same split.
                            assert_eq!(part.boundaries, b, "case {case} {objective}");
                        }
                        check_predictions(&costs, &mem, &part);
                        if let Some(l) = limit {
                            assert!(part.max_memory_bytes() <= l);
                        }
                    }
                    None => {
                        infeasible += 1;
                        let msg = got.unwrap_err().to_string();
                        assert_one_line(&msg);
                        assert!(
                            msg.contains(&format!("{smallest} bytes"))
                                && msg.contains(&format!("{} bytes", limit.unwrap())),
                            "case {case}: {msg}"
                        );
                    }
                }
            }
        }
    }
    assert!(infeasible > 0, "no infeasible case was drawn");
    println!("{cases} cases checked against brute force ({infeasible} infeasible)");
}

/// A GPT-like model with a large vocabulary: the embedding costs 5 blocks and the head 8 (time),
/// and both hold large tables.
fn gpt_like(n_blocks: usize) -> ModelCosts {
    let block = |i: usize| {
        LayerCost::new(format!("h.{i}"), 1.0).with_memory(12 << 20, 12 << 20, 24 << 20, 8 << 20)
    };
    ModelCosts::new(
        Some(LayerCost::new("embedding", 5.0).with_memory(50 << 20, 50 << 20, 100 << 20, 2 << 20)),
        (0..n_blocks).map(block).collect(),
        Some(LayerCost::new("head", 8.0).with_memory(50 << 20, 50 << 20, 100 << 20, 40 << 20)),
    )
    .unwrap()
}

#[test]
fn speed_beats_even_on_gpt_like_costs() {
    let costs = gpt_like(16);
    let mem = MemoryModel::one_f_one_b(4, 8);
    let even_p = even(&costs, &mem).unwrap();
    let speed_p = optimize(&costs, &mem, Objective::Speed).unwrap();
    let auto_p = "auto"
        .parse::<PartitionMethod>()
        .unwrap()
        .partition(&costs, &mem)
        .unwrap();
    assert_eq!(auto_p, speed_p);
    println!(
        "even  {}: slowest stage {:.2} ms",
        even_p.fragment(),
        even_p.max_time_ms()
    );
    println!("{even_p}");
    println!(
        "speed {}: slowest stage {:.2} ms",
        speed_p.fragment(),
        speed_p.max_time_ms()
    );
    println!("{speed_p}");
    assert_eq!(even_p.boundaries, vec![0, 4, 8, 12]);
    assert!(
        speed_p.max_time_ms() <= 0.8 * even_p.max_time_ms(),
        "speed {} ms is not 20% faster than even {} ms",
        speed_p.max_time_ms(),
        even_p.max_time_ms()
    );
    // The head stage gets a single block: 1 + 8 ms.
    assert_eq!(speed_p.max_time_ms(), 9.0);
    assert_eq!(speed_p.stages[3].blocks, 15..16);
    check_predictions(&costs, &mem, &speed_p);
    check_predictions(&costs, &mem, &even_p);
    // The summary names the layers.
    let lines = speed_p.summary_lines();
    assert_eq!(lines.len(), 4);
    assert!(lines[0].starts_with("stage 0: blocks 0..") && lines[0].contains("(embedding..h."));
    assert!(lines[3].contains("(h.15..head, 2 layers)"), "{}", lines[3]);
    assert_eq!(speed_p.stages[0].layers.start, 0);
    assert_eq!(speed_p.stages[3].layers, 16..18);
}

#[test]
fn memory_objective_beats_even_on_skewed_costs() {
    // 1F1B keeps 4 microbatches on stage 0 but 1 on stage 3, and the embedding is large: even
    // overloads the first stage.
    let costs = gpt_like(12);
    let mem = MemoryModel::one_f_one_b(4, 8);
    let even_p = even(&costs, &mem).unwrap();
    let mem_p = optimize(&costs, &mem, Objective::Memory).unwrap();
    println!(
        "even   {}: largest stage {} bytes",
        even_p.fragment(),
        even_p.max_memory_bytes()
    );
    println!("{even_p}");
    println!(
        "memory {}: largest stage {} bytes",
        mem_p.fragment(),
        mem_p.max_memory_bytes()
    );
    println!("{mem_p}");
    assert!(mem_p.max_memory_bytes() < even_p.max_memory_bytes());
    assert_eq!(
        mem_p.max_memory_bytes() as f64,
        brute_force(&costs, &mem, Objective::Memory).unwrap().0
    );
    check_predictions(&costs, &mem, &mem_p);

    // A limit between the two: even is refused (one line, naming the stage), memory fits.
    let limit = (mem_p.max_memory_bytes() + even_p.max_memory_bytes()) / 2;
    let limited = mem.clone().with_limit(limit);
    let msg = even(&costs, &limited).unwrap_err().to_string();
    assert_one_line(&msg);
    assert!(msg.contains("over the per-stage memory limit") && msg.contains(&limit.to_string()));
    let speed_limited = optimize(&costs, &limited, Objective::Speed).unwrap();
    assert!(speed_limited.max_memory_bytes() <= limit);
}

#[test]
fn explicit_boundaries_and_spec_parsing() {
    let costs = gpt_like(12);
    let mem = MemoryModel::one_f_one_b(4, 4);
    let m: PartitionMethod = "0,3,6,9".parse().unwrap();
    assert_eq!(m, PartitionMethod::Explicit(vec![0, 3, 6, 9]));
    assert_eq!(m.to_string(), "0,3,6,9");
    let p = m.partition(&costs, &mem).unwrap();
    assert_eq!(p, explicit(&costs, &mem, &[0, 3, 6, 9]).unwrap());
    assert_eq!(p, even(&costs, &mem).unwrap());
    assert_eq!(p.fragment(), "partition=0,3,6,9");
    assert_eq!(
        p.stage_specs().unwrap(),
        StageSpec::split(12, &[3, 3, 3, 3]).unwrap()
    );
    assert_eq!(p.stage_specs().unwrap(), StageSpec::even(12, 4).unwrap());
    check_predictions(&costs, &mem, &p);

    assert_eq!(
        "auto".parse::<PartitionMethod>().unwrap(),
        PartitionMethod::Speed
    );
    assert_eq!(
        " speed ".parse::<PartitionMethod>().unwrap(),
        PartitionMethod::Speed
    );
    assert_eq!(
        "memory".parse::<PartitionMethod>().unwrap(),
        PartitionMethod::Memory
    );
    assert_eq!(
        "even".parse::<PartitionMethod>().unwrap(),
        PartitionMethod::Even
    );
    assert_eq!(PartitionMethod::Memory.objective(), Some(Objective::Memory));
    assert_eq!(PartitionMethod::Even.objective(), None);
    for s in ["speed", "memory", "even", "0,5,7"] {
        assert_eq!(s.parse::<PartitionMethod>().unwrap().to_string(), s);
    }

    // Even with a remainder: the first stages get one more block.
    let p10 = even(&gpt_like(10), &mem).unwrap();
    assert_eq!(p10.boundaries, vec![0, 3, 6, 8]);
    assert_eq!(p10.block_counts(), vec![3, 3, 2, 2]);

    // Bad specs: one-line errors naming the numbers.
    let bad_parse = [
        ("1,3,6,9", &["block 0", "not 1"][..]),
        ("0,3,3,9", &["3 then 3"][..]),
        ("0,6,3,9", &["6 then 3"][..]),
        ("0,3,x,9", &["`x`"][..]),
        ("0,,3", &["``"][..]),
        ("fast", &["`fast`"][..]),
        ("", &["``"][..]),
    ];
    for (spec, needles) in bad_parse {
        let msg = spec.parse::<PartitionMethod>().unwrap_err().to_string();
        assert_one_line(&msg);
        for n in needles {
            assert!(msg.contains(n), "{spec}: {msg}");
        }
    }
    let bad_validate = [
        ("0,3,6", 4, 12, &["3 boundaries for 4 stages"][..]),
        ("0,3,6,9,11", 4, 12, &["5 boundaries for 4 stages"][..]),
        ("0,3,6,12", 4, 12, &["boundary 12", "12 blocks"][..]),
        ("0,3,6,13", 4, 12, &["boundary 13"][..]),
        ("speed", 5, 4, &["5 stages", "4 blocks"][..]),
        ("even", 0, 4, &["0 stages"][..]),
    ];
    for (spec, stages, n, needles) in bad_validate {
        let msg = PartitionMethod::parse_for(spec, stages, n)
            .unwrap_err()
            .to_string();
        assert_one_line(&msg);
        for nd in needles {
            assert!(msg.contains(nd), "{spec}: {msg}");
        }
    }
    // The same checks when partitioning.
    let msg = explicit(&costs, &mem, &[0, 3, 6]).unwrap_err().to_string();
    assert!(msg.contains("3 boundaries for 4 stages"), "{msg}");
    let msg = explicit(&costs, &mem, &[0, 3, 6, 12])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("boundary 12"), "{msg}");
}

#[test]
fn more_stages_than_blocks_and_infeasible_limits() {
    let costs = gpt_like(3);
    let mem = MemoryModel::one_f_one_b(4, 4);
    for r in [
        optimize(&costs, &mem, Objective::Speed),
        optimize(&costs, &mem, Objective::Memory),
        even(&costs, &mem),
    ] {
        let msg = r.unwrap_err().to_string();
        assert_one_line(&msg);
        assert!(msg.contains("4 stages but only 3 blocks"), "{msg}");
    }
    // P == n: one block per stage.
    let p = optimize(&costs, &MemoryModel::one_f_one_b(3, 4), Objective::Speed).unwrap();
    assert_eq!(p.boundaries, vec![0, 1, 2]);
    // One stage: everything.
    let p = optimize(&costs, &MemoryModel::one_f_one_b(1, 4), Objective::Memory).unwrap();
    assert_eq!(p.boundaries, vec![0]);
    assert_eq!(p.stages[0].layers, 0..5);
    assert_eq!(p.stages[0].first_layer, "embedding");
    assert_eq!(p.stages[0].last_layer, "head");

    // A limit no split meets: names the smallest achievable largest stage and the limit.
    let costs = gpt_like(8);
    let mem = MemoryModel::one_f_one_b(2, 4);
    let smallest = optimize(&costs, &mem, Objective::Memory)
        .unwrap()
        .max_memory_bytes();
    let limited = mem.clone().with_limit(smallest - 1);
    for objective in [Objective::Speed, Objective::Memory] {
        let msg = optimize(&costs, &limited, objective)
            .unwrap_err()
            .to_string();
        println!("{msg}");
        assert_one_line(&msg);
        assert!(msg.contains(&format!("{smallest} bytes")), "{msg}");
        assert!(msg.contains(&format!("{} bytes", smallest - 1)), "{msg}");
    }
    // At the limit exactly it fits.
    let p = optimize(&costs, &mem.clone().with_limit(smallest), Objective::Speed).unwrap();
    assert!(p.max_memory_bytes() <= smallest);

    // Models without embedding or head: the layer list is the blocks.
    let costs = ModelCosts::new(
        None,
        (0..5)
            .map(|i| LayerCost::new(format!("b{i}"), 1.0 + i as f64))
            .collect(),
        None,
    )
    .unwrap();
    let p = optimize(&costs, &MemoryModel::new(vec![1, 1]), Objective::Speed).unwrap();
    assert_eq!(p.max_time_ms(), 9.0); // Times 1..=5: {1,2,3} + {4,5} = 6 + 9 beats 10 + 5.
    assert_eq!(p.boundaries, vec![0, 3]);
    assert_eq!(p.stages[1].layers, 3..5);
    assert!(ModelCosts::new(None, vec![], None).is_err());
    let msg = ModelCosts::new(None, vec![LayerCost::new("x", f64::NAN)], None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("layer x"), "{msg}");
}
