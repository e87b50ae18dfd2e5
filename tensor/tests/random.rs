//! Random constructors: the values are pinned to those of the previous API, the builder and short
//! forms agree, and `randint` is a range-respecting, deterministic, uniform counter-based draw.

use half::{bf16, f16};
use meshgrad_tensor::{test_device, DType, Device, Random, Result, Tensor};

fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F64 => t
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        d => panic!("bits: {d} is not a float dtype"),
    }
}

/// The expected bit patterns below were recorded by running the constructors this API replaced
/// (`Tensor::randn(seed, start, mean, std, shape, dtype, device)` and
/// `Tensor::rand_uniform(seed, start, low, high, shape, dtype, device)`, in commit eb7ed38) with
/// the arguments named in each comment, printing `to_bits()` of every element. The new API must
/// reproduce them exactly: initial weights and dropout masks are keyed by global element index,
/// and changing a single bit would change every training run.
fn values_are_bit_identical_to_the_previous_api(device: Device) -> Result<()> {
    // randn(7, 0, 0.0, 1.0, 6, F64, Cpu)
    let t = Random::new(7)
        .device(device)
        .dtype(DType::F64)
        .normal(6, 0.0, 1.0)
        .unwrap();
    assert_eq!(
        bits(&t),
        [
            0x3f331bb0857ca169,
            0x3fd816fec01267b3,
            0x400985d695a78535,
            0xbf52250362195c52,
            0x3ff91fb92e205b72,
            0xbfe84990364c4663
        ]
    );
    // randn(123456789, 1000, 0.5, 2.0, (2, 3), F32, Cpu)
    let t = Random::new(123456789)
        .device(device)
        .offset(1000)
        .normal((2, 3), 0.5, 2.0)
        .unwrap();
    assert_eq!(
        bits(&t),
        [0xbed9535f, 0x40880c62, 0x409a4fdb, 0x406d11e1, 0xbfc15144, 0xbfba2009]
    );
    // randn(3, 5, -1.0, 0.02, 4, BF16, Cpu) and the same with F16
    let r = Random::new(3).device(device).offset(5);
    let t = r.dtype(DType::BF16).normal(4, -1.0, 0.02).unwrap();
    assert_eq!(bits(&t), [0xbf7d, 0xbf81, 0xbf80, 0xbf74]);
    let t = r.dtype(DType::F16).normal(4, -1.0, 0.02).unwrap();
    assert_eq!(bits(&t), [0xbbea, 0xbc08, 0xbbff, 0xbb9c]);
    // rand_uniform(42, 0, -1.0, 2.0, 5, F64, Cpu) and the same with F32
    let t = Random::new(42)
        .device(device)
        .dtype(DType::F64)
        .uniform(5, -1.0, 2.0)
        .unwrap();
    assert_eq!(
        bits(&t),
        [
            0x3fead81a00000000,
            0x3fff691630000000,
            0x3ff7a44060000000,
            0x3ff30550c0000000,
            0xbf953e5c00000000
        ]
    );
    let t = Random::new(42)
        .device(device)
        .uniform(5, -1.0, 2.0)
        .unwrap();
    assert_eq!(
        bits(&t),
        [0x3f56c0d0, 0x3ffb48b2, 0x3fbd2203, 0x3f982a86, 0xbca9f2e0]
    );
    // rand_uniform(9, 17, 0.0, 1.0, 3, BF16, Cpu)
    let t = Random::new(9)
        .device(device)
        .offset(17)
        .dtype(DType::BF16)
        .uniform(3, 0.0, 1.0)
        .unwrap();
    assert_eq!(bits(&t), [0x3ed1, 0x3f64, 0x3e91]);
    // rand_uniform(u64::MAX, (1 << 32) - 2, -0.1, 0.1, 4, F64, Cpu): crosses the 32-bit counter word
    let t = Random::new(u64::MAX)
        .device(device)
        .offset((1 << 32) - 2)
        .dtype(DType::F64)
        .uniform(4, -0.1, 0.1)
        .unwrap();
    assert_eq!(
        bits(&t),
        [
            0xbfa7e390cccccccd,
            0x3faa88fa66666668,
            0x3f7230b666666660,
            0x3f81c79999999998
        ]
    );
    // randn(11, 3, 0.0, 0.02, 20000, F32, Cpu) and rand_uniform(11, 3, -0.5, 0.5, 20000, F32,
    // Cpu): large enough to be filled in parallel chunks; elements at chunk edges.
    let n = Random::new(11)
        .device(device)
        .offset(3)
        .normal(20000, 0.0, 0.02)
        .unwrap();
    let u = Random::new(11)
        .device(device)
        .offset(3)
        .uniform(20000, -0.5, 0.5)
        .unwrap();
    let (n, u) = (bits(&n), bits(&u));
    let want = [
        (0, 0x3ba72ae4, 0x3e7fc998),
        (4095, 0xbc761f24, 0xbc546bc0),
        (4096, 0x3d2f6aaa, 0xbee066a2),
        (16383, 0xbceb46ec, 0xbe41debc),
        (16384, 0xbd5e82f8, 0xbef5112a),
        (19999, 0xbc18e95e, 0x3ebc5654),
    ];
    for (i, wn, wu) in want {
        assert_eq!((n[i], u[i]), (wn, wu), "element {i}");
    }
    Ok(())
}
test_device!(values_are_bit_identical_to_the_previous_api);

// CPU-only: the short forms are defined as CPU constructors.
#[test]
fn short_forms_are_the_builder_defaults() {
    let a = Tensor::randn((3, 4), 5).unwrap();
    assert_eq!(
        (a.dims(), a.dtype(), a.device()),
        (&[3, 4][..], DType::F32, Device::Cpu)
    );
    assert_eq!(
        bits(&a),
        bits(&Random::new(5).normal(12, 0.0, 1.0).unwrap())
    );
    let u = Tensor::rand(7, 5).unwrap();
    assert_eq!(u.dtype(), DType::F32);
    assert_eq!(
        bits(&u),
        bits(&Random::new(5).uniform(7, 0.0, 1.0).unwrap())
    );
    let i = Tensor::randint((2, 2), -3, 3, 5).unwrap();
    assert_eq!((i.dims(), i.dtype()), (&[2, 2][..], DType::I64));
    assert_eq!(
        i.to_vec::<i64>().unwrap(),
        Random::new(5)
            .randint(4, -3, 3)
            .unwrap()
            .to_vec::<i64>()
            .unwrap()
    );
    // f32 draws are the f64 draws rounded, for normal and uniform alike.
    let r = Random::new(77).offset(9);
    let n64 = r.dtype(DType::F64).normal(50, 1.0, 3.0).unwrap();
    let n32 = r.normal(50, 1.0, 3.0).unwrap();
    assert_eq!(n32.to_vec::<f32>().unwrap(), n64.to_vec_f32().unwrap());
    let u64s = r.dtype(DType::F64).uniform(50, -2.0, 5.0).unwrap();
    let u32s = r.uniform(50, -2.0, 5.0).unwrap();
    assert_eq!(u32s.to_vec::<f32>().unwrap(), u64s.to_vec_f32().unwrap());
}

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn builder_errors_name_the_problem() {
    let e = Random::new(0).normal(3, 0.0, -1.0).unwrap_err().to_string();
    assert!(e.contains("std -1"), "{e}");
    let e = Random::new(0).uniform(3, 2.0, 1.0).unwrap_err().to_string();
    assert!(e.contains("[2, 1)"), "{e}");
    let e = Random::new(0)
        .dtype(DType::I64)
        .normal(3, 0.0, 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("normal") && e.contains("I64"), "{e}");
    let e = Random::new(0).randint(3, 5, 5).unwrap_err().to_string();
    assert!(e.contains("empty range [5, 5)"), "{e}");
    let e = Random::new(0)
        .dtype(DType::U8)
        .randint(3, 0, 257)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[0, 257)") && e.contains("u8"), "{e}");
    let e = Random::new(0)
        .dtype(DType::U32)
        .randint(3, -1, 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("u32"), "{e}");
    // A CUDA device that is not usable here (no GPU, or no `cuda` feature) is an error naming it.
    if Device::Cuda(0).check_available().is_err() {
        let e = Random::new(0)
            .device(Device::Cuda(0))
            .randint(3, 0, 5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cuda:0"), "{e}");
    }
}

fn randint_respects_the_range_in_every_dtype(device: Device) -> Result<()> {
    let v = Random::new(1)
        .device(device)
        .randint(10_000, -5, 7)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    assert!(v.iter().all(|x| (-5..7).contains(x)));
    // Both ends are reached.
    assert!(v.contains(&-5) && v.contains(&6));
    // A one-value range.
    let one = Random::new(1)
        .device(device)
        .randint(5, 9, 10)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    assert_eq!(one, vec![9; 5]);
    // The extremes of i64.
    let w = Random::new(2)
        .device(device)
        .randint(1000, i64::MIN, i64::MAX)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    assert!(w.iter().all(|&x| x < i64::MAX));
    assert!(w.iter().any(|&x| x < i64::MIN / 2) && w.iter().any(|&x| x > i64::MAX / 2));
    // Other dtypes hold the same integers.
    let r = Random::new(3).device(device).offset(11);
    let ints = r.randint(500, 0, 256).unwrap().to_vec::<i64>().unwrap();
    let as_u8 = r.dtype(DType::U8).randint(500, 0, 256).unwrap();
    assert_eq!(
        as_u8.to_vec::<u8>().unwrap(),
        ints.iter().map(|&x| x as u8).collect::<Vec<_>>()
    );
    let as_u32 = r.dtype(DType::U32).randint(500, 0, 256).unwrap();
    assert_eq!(
        as_u32.to_vec::<u32>().unwrap(),
        ints.iter().map(|&x| x as u32).collect::<Vec<_>>()
    );
    let as_f32 = r.dtype(DType::F32).randint(500, 0, 256).unwrap();
    assert_eq!(
        as_f32.to_vec::<f32>().unwrap(),
        ints.iter().map(|&x| x as f32).collect::<Vec<_>>()
    );
    Ok(())
}
test_device!(randint_respects_the_range_in_every_dtype);

fn randint_is_deterministic_by_seed_and_offset(device: Device) -> Result<()> {
    let draw = |seed, offset, n| {
        Random::new(seed)
            .device(device)
            .offset(offset)
            .randint(n, 0, 1000)
            .unwrap()
            .to_vec::<i64>()
            .unwrap()
    };
    assert_eq!(draw(4, 0, 300), draw(4, 0, 300));
    assert_eq!(draw(4, 100, 300), draw(4, 100, 300));
    // Other seeds and offsets give other values (1000 values: few coincidences).
    let same = |a: &[i64], b: &[i64]| a.iter().zip(b).filter(|(x, y)| x == y).count();
    assert!(same(&draw(4, 0, 300), &draw(5, 0, 300)) < 10);
    assert!(same(&draw(4, 0, 300), &draw(4, 1, 300)) < 10);
    // Offsetting by k gives the tail of a longer draw, across the parallel fill's chunk size too.
    let whole = draw(4, 0, 40_000);
    for k in [1u64, 17, 4096, 16_385, 39_999] {
        assert_eq!(
            draw(4, k, 40_000 - k as usize),
            whole[k as usize..],
            "offset {k}"
        );
    }
    // The shape does not matter, only the row-major position.
    let shaped = Random::new(4)
        .device(device)
        .randint((20, 15), 0, 1000)
        .unwrap();
    assert_eq!(shaped.to_vec::<i64>().unwrap(), whole[..300]);
    Ok(())
}
test_device!(randint_is_deterministic_by_seed_and_offset);

/// Pearson's chi-square statistic of `counts` against equal expected counts.
fn chi_square(counts: &[usize]) -> f64 {
    let n: usize = counts.iter().sum();
    let e = n as f64 / counts.len() as f64;
    counts.iter().map(|&c| (c as f64 - e).powi(2) / e).sum()
}

fn randint_is_uniform_chi_square(device: Device) -> Result<()> {
    // 10 values, 9 degrees of freedom: P(chi2 > 40) is about 1e-5, a generous bound.
    let v = Random::new(123)
        .device(device)
        .randint(200_000, 0, 10)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    let mut counts = [0usize; 10];
    for x in v {
        counts[x as usize] += 1;
    }
    let c = chi_square(&counts);
    assert!(c < 40.0, "chi2 {c} for counts {counts:?}");
    // A range that is not a power of two, shifted negative, 1000 values in 20 buckets of 50
    // (19 degrees of freedom: P(chi2 > 60) is about 4e-6).
    let v = Random::new(9)
        .device(device)
        .offset(1 << 40)
        .randint(200_000, -500, 500)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    let mut buckets = [0usize; 20];
    for x in v {
        buckets[((x + 500) / 50) as usize] += 1;
    }
    let c = chi_square(&buckets);
    assert!(c < 60.0, "chi2 {c} for buckets {buckets:?}");
    // A statistic that large would be rejected: a skewed histogram fails the same bound.
    let mut skewed = counts;
    skewed[0] += 2_000;
    assert!(chi_square(&skewed) > 40.0);
    Ok(())
}
test_device!(randint_is_uniform_chi_square);
