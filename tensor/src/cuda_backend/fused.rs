//! The fused ops of the CUDA backend (normalisations, softmax, attention, cross-entropy, SwiGLU,
//! rotary embedding, optimizer steps). `Ok(None)`: not provided (the tensor op falls back to a
//! composition of basic ops).
#![allow(clippy::too_many_arguments, clippy::type_complexity)]
use super::CudaStorage;
use crate::backend::api::{Fused, In, MaskArgs};
use crate::Layout;
use meshgrad_kernels::ops::{AdamWStep, AttentionShape, UnaryGrad};

/// See `BackendStorage::softmax`.
pub(super) fn softmax(
    _x: In<'_, CudaStorage>,
    _rows: usize,
    _cols: usize,
    _log: bool,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::softmax_backward`.
pub(super) fn softmax_backward(
    _y: In<'_, CudaStorage>,
    _dy: In<'_, CudaStorage>,
    _rows: usize,
    _cols: usize,
    _log: bool,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::gelu_backward`.
pub(super) fn gelu_backward(
    _x: In<'_, CudaStorage>,
    _dy: In<'_, CudaStorage>,
    _tanh_form: bool,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::unary_backward`.
pub(super) fn unary_backward(
    _x: In<'_, CudaStorage>,
    _dy: In<'_, CudaStorage>,
    _op: UnaryGrad,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::logsumexp`.
pub(super) fn logsumexp(
    _x: In<'_, CudaStorage>,
    _outer: usize,
    _red: usize,
    _inner: usize,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::layer_norm`.
pub(super) fn layer_norm(
    _x: In<'_, CudaStorage>,
    _w: Option<In<'_, CudaStorage>>,
    _b: Option<In<'_, CudaStorage>>,
    _rows: usize,
    _cols: usize,
    _eps: f64,
) -> Fused<(CudaStorage, CudaStorage, CudaStorage)> {
    Ok(None)
}

/// See `BackendStorage::layer_norm_backward`.
pub(super) fn layer_norm_backward(
    _x: In<'_, CudaStorage>,
    _w: Option<In<'_, CudaStorage>>,
    _mean: In<'_, CudaStorage>,
    _rstd: In<'_, CudaStorage>,
    _dy: In<'_, CudaStorage>,
    _rows: usize,
    _cols: usize,
    _param_grads: bool,
) -> Fused<(CudaStorage, Option<CudaStorage>, Option<CudaStorage>)> {
    Ok(None)
}

/// See `BackendStorage::rms_norm`.
pub(super) fn rms_norm(
    _x: In<'_, CudaStorage>,
    _w: Option<In<'_, CudaStorage>>,
    _rows: usize,
    _cols: usize,
    _eps: f64,
) -> Fused<(CudaStorage, CudaStorage)> {
    Ok(None)
}

/// See `BackendStorage::rms_norm_backward`.
pub(super) fn rms_norm_backward(
    _x: In<'_, CudaStorage>,
    _w: Option<In<'_, CudaStorage>>,
    _rstd: In<'_, CudaStorage>,
    _dy: In<'_, CudaStorage>,
    _rows: usize,
    _cols: usize,
    _weight_grad: bool,
) -> Fused<(CudaStorage, Option<CudaStorage>)> {
    Ok(None)
}

/// See `BackendStorage::rotary_embedding`.
pub(super) fn rotary_embedding(
    _x: In<'_, CudaStorage>,
    _positions: In<'_, CudaStorage>,
    _dims: [usize; 4],
    _theta: f64,
    _inverse: bool,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::swiglu`.
pub(super) fn swiglu(_gate: In<'_, CudaStorage>, _up: In<'_, CudaStorage>) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::swiglu_backward`.
pub(super) fn swiglu_backward(
    _gate: In<'_, CudaStorage>,
    _up: In<'_, CudaStorage>,
    _dy: In<'_, CudaStorage>,
) -> Fused<(CudaStorage, CudaStorage)> {
    Ok(None)
}

/// See `BackendStorage::cross_entropy`.
pub(super) fn cross_entropy(
    _logits: In<'_, CudaStorage>,
    _targets: In<'_, CudaStorage>,
    _rows: usize,
    _cols: usize,
    _ignore_index: Option<i64>,
) -> Fused<(CudaStorage, CudaStorage)> {
    Ok(None)
}

/// See `BackendStorage::cross_entropy_backward`.
pub(super) fn cross_entropy_backward(
    _logits: In<'_, CudaStorage>,
    _lse: In<'_, CudaStorage>,
    _targets: In<'_, CudaStorage>,
    _dloss: In<'_, CudaStorage>,
    _rows: usize,
    _cols: usize,
    _ignore_index: Option<i64>,
) -> Fused<CudaStorage> {
    Ok(None)
}

/// See `BackendStorage::attention`.
pub(super) fn attention(
    _q: In<'_, CudaStorage>,
    _k: In<'_, CudaStorage>,
    _v: In<'_, CudaStorage>,
    _shape: AttentionShape,
    _mask: MaskArgs<'_, CudaStorage>,
) -> Fused<(CudaStorage, CudaStorage)> {
    Ok(None)
}

/// See `BackendStorage::attention_backward`.
pub(super) fn attention_backward(
    _ops: [In<'_, CudaStorage>; 6],
    _shape: AttentionShape,
    _mask: MaskArgs<'_, CudaStorage>,
    _want_dz: bool,
) -> Fused<(CudaStorage, CudaStorage, CudaStorage, Option<CudaStorage>)> {
    Ok(None)
}

/// See `BackendStorage::attention_qkv`.
pub(super) fn attention_qkv(
    _qkv: In<'_, CudaStorage>,
    _shape: AttentionShape,
    _heads: usize,
    _mask: MaskArgs<'_, CudaStorage>,
) -> Fused<(CudaStorage, CudaStorage)> {
    Ok(None)
}

/// See `BackendStorage::attention_qkv_backward`.
pub(super) fn attention_qkv_backward(
    _ops: [In<'_, CudaStorage>; 4],
    _shape: AttentionShape,
    _heads: usize,
    _mask: MaskArgs<'_, CudaStorage>,
    _want_dz: bool,
) -> Fused<(CudaStorage, Option<CudaStorage>)> {
    Ok(None)
}

/// See `BackendStorage::adamw`.
pub(super) fn adamw(
    _param: &mut CudaStorage,
    _pl: &Layout,
    _grad: In<'_, CudaStorage>,
    _m: &mut CudaStorage,
    _ml: &Layout,
    _v: &mut CudaStorage,
    _vl: &Layout,
    _hp: &AdamWStep,
) -> Fused<()> {
    Ok(None)
}

/// See `BackendStorage::sgd`.
pub(super) fn sgd(
    _param: &mut CudaStorage,
    _pl: &Layout,
    _grad: In<'_, CudaStorage>,
    _buf: &mut CudaStorage,
    _bl: &Layout,
    _lr: f64,
    _momentum: f64,
    _weight_decay: f64,
    _first_step: bool,
) -> Fused<()> {
    Ok(None)
}
