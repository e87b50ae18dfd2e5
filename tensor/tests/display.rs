//! `Display` and `Debug` of tensors: the expected strings are written out by hand.

use half::{bf16, f16};
use meshgrad_tensor::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

fn ints(n: i64, dims: &[usize]) -> Tensor {
    Tensor::arange(0, n, DType::I64, CPU)
        .unwrap()
        .reshape(dims)
        .unwrap()
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn matrix_of_floats() {
    let t = Tensor::from_vec(vec![1f32, -2.5, 3., 4., 5., 6.], (2, 3), CPU).unwrap();
    let want = "\
Tensor([[ 1.0000, -2.5000,  3.0000],
        [ 4.0000,  5.0000,  6.0000]], shape=[2, 3], dtype=f32, device=cpu)";
    assert_eq!(format!("{t}"), want);
    assert_eq!(format!("{t:?}"), want, "Debug prints the same");
    // The precision of the format sets the decimals.
    assert_eq!(
        format!("{t:.1}"),
        "\
Tensor([[ 1.0, -2.5,  3.0],
        [ 4.0,  5.0,  6.0]], shape=[2, 3], dtype=f32, device=cpu)"
    );
    assert_eq!(
        format!(
            "{:.0?}",
            Tensor::from_vec(vec![0.25f64, 7.75], 2, CPU).unwrap()
        ),
        "Tensor([0, 8], shape=[2], dtype=f64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn integers_print_as_integers() {
    assert_eq!(
        ints(6, &[3, 2]).to_string(),
        "\
Tensor([[0, 1],
        [2, 3],
        [4, 5]], shape=[3, 2], dtype=i64, device=cpu)"
    );
    let u = Tensor::from_vec(vec![0u8, 255, 7], 3, CPU).unwrap();
    assert_eq!(
        u.to_string(),
        "Tensor([  0, 255,   7], shape=[3], dtype=u8, device=cpu)"
    );
    let n = Tensor::from_vec(vec![-12i64, 3, i64::MAX], 3, CPU).unwrap();
    assert_eq!(
        n.to_string(),
        "Tensor([                -12,                   3, 9223372036854775807], \
         shape=[3], dtype=i64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn three_dimensions_leave_a_blank_line_between_blocks() {
    assert_eq!(
        ints(8, &[2, 2, 2]).to_string(),
        "\
Tensor([[[0, 1],
         [2, 3]],

        [[4, 5],
         [6, 7]]], shape=[2, 2, 2], dtype=i64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn scalars_and_empty_tensors() {
    let s = Tensor::scalar(3.5, DType::F32, CPU).unwrap();
    assert_eq!(
        s.to_string(),
        "Tensor(3.5000, shape=[], dtype=f32, device=cpu)"
    );
    let i = Tensor::scalar(-7.0, DType::I64, CPU).unwrap();
    assert_eq!(i.to_string(), "Tensor(-7, shape=[], dtype=i64, device=cpu)");
    let e = Tensor::zeros((0, 3), DType::F32, CPU).unwrap();
    assert_eq!(
        e.to_string(),
        "Tensor([], shape=[0, 3], dtype=f32, device=cpu)"
    );
    let e = Tensor::zeros(0, DType::I64, CPU).unwrap();
    assert_eq!(
        e.to_string(),
        "Tensor([], shape=[0], dtype=i64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn strided_views_print_their_own_values() {
    let t = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), CPU).unwrap();
    assert_eq!(
        t.t().unwrap().to_string(),
        "\
Tensor([[1.0000, 4.0000],
        [2.0000, 5.0000],
        [3.0000, 6.0000]], shape=[3, 2], dtype=f32, device=cpu)"
    );
    assert_eq!(
        t.narrow(1, 1, 2).unwrap().to_string(),
        "\
Tensor([[2.0000, 3.0000],
        [5.0000, 6.0000]], shape=[2, 2], dtype=f32, device=cpu)"
    );
    // A broadcast (stride 0) view.
    let row = Tensor::from_vec(vec![1i64, 2], 2, CPU).unwrap();
    assert_eq!(
        row.expand((2, 2)).unwrap().to_string(),
        "\
Tensor([[1, 2],
        [1, 2]], shape=[2, 2], dtype=i64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn half_precision_prints_the_stored_values() {
    // bf16 stores 0.1 as 0.10009765625 and f16 as 0.0999755859375.
    let v = [0.1f32, 1.0, -2.0];
    let b = Tensor::from_vec(v.iter().map(|&x| bf16::from_f32(x)).collect(), 3, CPU).unwrap();
    assert_eq!(
        b.to_string(),
        "Tensor([ 0.1001,  1.0000, -2.0000], shape=[3], dtype=bf16, device=cpu)"
    );
    let h = Tensor::from_vec(v.iter().map(|&x| f16::from_f32(x)).collect(), 3, CPU).unwrap();
    assert_eq!(
        h.to_string(),
        "Tensor([ 0.1000,  1.0000, -2.0000], shape=[3], dtype=f16, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn wide_ranges_switch_to_scientific_notation() {
    let t = Tensor::from_vec(vec![1e-5f64, 1.0, 123456.0], 3, CPU).unwrap();
    assert_eq!(
        t.to_string(),
        "Tensor([1.0000e-05, 1.0000e+00, 1.2346e+05], shape=[3], dtype=f64, device=cpu)"
    );
    let t = Tensor::from_vec(vec![-0.5f32, 2e8], 2, CPU).unwrap();
    assert_eq!(
        t.to_string(),
        "Tensor([-5.0000e-01,  2.0000e+08], shape=[2], dtype=f32, device=cpu)"
    );
    // Integer-valued floats stay fixed below 1e8 however wide the range.
    let t = Tensor::from_vec(vec![1f32, 20000.], 2, CPU).unwrap();
    assert_eq!(
        t.to_string(),
        "Tensor([    1.0000, 20000.0000], shape=[2], dtype=f32, device=cpu)"
    );
    // Zeros and non-finite values do not decide the notation.
    let t = Tensor::from_vec(
        vec![0f32, 1.5, f32::NAN, f32::NEG_INFINITY, f32::INFINITY],
        5,
        CPU,
    )
    .unwrap();
    assert_eq!(
        t.to_string(),
        "Tensor([0.0000, 1.5000,    nan,   -inf,    inf], shape=[5], dtype=f32, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn long_rows_wrap_under_their_first_element() {
    // Width 2 plus ", ": (80 - 8) / 4 = 18 elements per line.
    assert_eq!(
        ints(25, &[25]).to_string(),
        "\
Tensor([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16, 17,
        18, 19, 20, 21, 22, 23, 24], shape=[25], dtype=i64, device=cpu)"
    );
    // Inside a matrix the rows start one column further in: (80 - 9) / 4 = 17 per line.
    assert_eq!(
        ints(38, &[2, 19]).to_string(),
        "\
Tensor([[ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16,
         17, 18],
        [19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,
         36, 37]], shape=[2, 19], dtype=i64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn more_than_a_thousand_elements_are_summarised() {
    assert_eq!(
        ints(1001, &[1001]).to_string(),
        "Tensor([   0,    1,    2, ...,  998,  999, 1000], shape=[1001], dtype=i64, device=cpu)"
    );
    // Exactly 1000 elements are all shown (wrapped, 14 per line).
    let all = ints(1000, &[1000]).to_string();
    assert!(!all.contains("..."), "{all}");
    assert!(all.contains(" 500, 501, "), "{all}");
    assert_eq!(
        ints(2000, &[40, 50]).to_string(),
        "\
Tensor([[   0,    1,    2, ...,   47,   48,   49],
        [  50,   51,   52, ...,   97,   98,   99],
        [ 100,  101,  102, ...,  147,  148,  149],
        ...,
        [1850, 1851, 1852, ..., 1897, 1898, 1899],
        [1900, 1901, 1902, ..., 1947, 1948, 1949],
        [1950, 1951, 1952, ..., 1997, 1998, 1999]], shape=[40, 50], dtype=i64, device=cpu)"
    );
    // Short dimensions are shown whole; long ones summarised.
    assert_eq!(
        ints(1200, &[2, 600]).to_string(),
        "\
Tensor([[   0,    1,    2, ...,  597,  598,  599],
        [ 600,  601,  602, ..., 1197, 1198, 1199]], shape=[2, 600], dtype=i64, device=cpu)"
    );
    // In 3-d the summarised blocks keep their blank lines.
    let t = ints(8 * 8 * 20, &[8, 8, 20]).narrow(2, 0, 2).unwrap(); // 128 elements: whole
    assert!(!t.to_string().contains("..."));
    let t = ints(7 * 2 * 80, &[7, 2, 80]).narrow(2, 78, 2).unwrap(); // 28 elements: whole
    assert_eq!(
        t.to_string().lines().next().unwrap(),
        "Tensor([[[  78,   79],"
    );
    let t = ints(7 * 2 * 80, &[7, 2, 80]); // 1120 elements
    assert_eq!(
        t.to_string(),
        "\
Tensor([[[   0,    1,    2, ...,   77,   78,   79],
         [  80,   81,   82, ...,  157,  158,  159]],

        [[ 160,  161,  162, ...,  237,  238,  239],
         [ 240,  241,  242, ...,  317,  318,  319]],

        [[ 320,  321,  322, ...,  397,  398,  399],
         [ 400,  401,  402, ...,  477,  478,  479]],

        ...,

        [[ 640,  641,  642, ...,  717,  718,  719],
         [ 720,  721,  722, ...,  797,  798,  799]],

        [[ 800,  801,  802, ...,  877,  878,  879],
         [ 880,  881,  882, ...,  957,  958,  959]],

        [[ 960,  961,  962, ..., 1037, 1038, 1039],
         [1040, 1041, 1042, ..., 1117, 1118, 1119]]], shape=[7, 2, 80], dtype=i64, device=cpu)"
    );
}

// CPU-only: display formatting, whose expected strings name `device=cpu`.
#[test]
fn released_storage_prints_its_shape() {
    let t = Tensor::ones((2, 3), DType::F32, CPU).unwrap();
    let view = t.narrow(0, 1, 1).unwrap();
    t.release_storage();
    assert_eq!(
        t.to_string(),
        "Tensor(released, shape=[2, 3], dtype=f32, device=cpu)"
    );
    assert_eq!(
        format!("{view:?}"),
        "Tensor(released, shape=[1, 3], dtype=f32, device=cpu)"
    );
    t.materialize_from(&Tensor::zeros((2, 3), DType::F32, CPU).unwrap())
        .unwrap();
    assert_eq!(
        view.to_string(),
        "Tensor([[0.0000, 0.0000, 0.0000]], shape=[1, 3], dtype=f32, device=cpu)"
    );
}
