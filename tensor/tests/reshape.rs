//! `reshape` with an inferred dimension, through the public API: views, copies of strided views,
//! and the errors.

use meshgrad_tensor::{test_device, DType, Device, Result, ShapeSpec, Tensor};

fn iota(dims: &[usize], device: Device) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::arange(0, n as i64, DType::F32, device)
        .unwrap()
        .reshape(dims)
        .unwrap()
}

#[allow(clippy::needless_borrows_for_generic_args)] // the borrowed forms are under test
fn inferred_dimension_on_contiguous_and_strided_tensors(device: Device) -> Result<()> {
    let x = iota(&[2, 3, 4], device);
    let (b, t) = (2usize, 3usize);
    let y = x.reshape((b, t, -1)).unwrap();
    assert_eq!(y.dims(), &[2, 3, 4]);
    assert!(y.same_storage(&x), "a contiguous reshape is a view");
    assert_eq!(x.reshape(&[b as isize, -1]).unwrap().dims(), &[2, 12]);
    assert_eq!(x.reshape((-1, 2)).unwrap().dims(), &[12, 2]);
    assert_eq!(x.reshape(-1).unwrap().dims(), &[24]);
    // A transposed view cannot be flattened without a copy; the values follow the view.
    let xt = x.transpose(1, 2).unwrap(); // [2, 4, 3]
    let flat = xt.reshape((b, -1)).unwrap();
    assert_eq!(flat.dims(), &[2, 12]);
    assert!(!flat.same_storage(&x));
    assert_eq!(
        flat.to_vec::<f32>().unwrap()[..12],
        [0., 4., 8., 1., 5., 9., 2., 6., 10., 3., 7., 11.]
    );
    // Splitting the rows of a narrowed view stays a view.
    let n = iota(&[4, 8], device).narrow(1, 0, 4).unwrap();
    let s = n.reshape((2, -1, 4)).unwrap();
    assert_eq!(s.dims(), &[2, 2, 4]);
    assert_eq!(s.layout().strides(), &[16, 8, 1]);
    // A spec value works as well as a literal.
    let spec = ShapeSpec::new(vec![3, -1]);
    assert_eq!(x.reshape(&spec).unwrap().dims(), &[3, 8]);
    assert_eq!(x.reshape(spec).unwrap().dims(), &[3, 8]);
    Ok(())
}
test_device!(inferred_dimension_on_contiguous_and_strided_tensors);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn reshape_errors_name_shape_spec_and_count() {
    let x = iota(&[2, 3, 4], Device::Cpu);
    let e = x.reshape((-1, -1)).unwrap_err().to_string();
    assert_eq!(
        e,
        "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [-1, -1]: \
         only one dimension can be -1 (inferred), found 2"
    );
    let e = x.reshape((7, -1)).unwrap_err().to_string();
    assert_eq!(
        e,
        "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [7, -1]: \
         24 is not a multiple of 7 (the product of the other sizes)"
    );
    let e = x.reshape([5usize, 5]).unwrap_err().to_string();
    assert_eq!(
        e,
        "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [5, 5]: \
         25 elements, not 24"
    );
}
