//! Test support: one launch of every kernel entry point the fused ops use, built by the same
//! pure functions the ops call, with fake addresses and sizes. A checker of the kernels'
//! `extern "C"` parameter lists can run over [`every_launch`] (`file`, `entry`, `sizes()`), and
//! the test below checks that every entry point of the fused kernel files is covered: the entry
//! names come from `meshgrad_kernels::cuda::SOURCES`, which the kernels crate's build script
//! reads from the `.cu` sources (the builders name the entry they launch; no list repeats them).

use std::collections::BTreeSet;

use meshgrad_kernels::ops::{AdamWStep, AttentionShape, UnaryGrad};

use super::args::{assert_known, Launch};
use super::norm_partials::partials_reduce_launch;
use crate::ops::fused::adamw::cuda::adamw_launch;
use crate::ops::fused::attention::cuda::params::{
    delta_launch, dkdv_launch, dq_launch, fwd_launch, qkv_params, separate_params, HEAD_DIMS,
};
use crate::ops::fused::cross_entropy::cuda::{ce_bwd_launch, ce_fwd_launch};
use crate::ops::fused::gelu::cuda::gelu_bwd_launch;
use crate::ops::fused::layer_norm::cuda::{layer_norm_bwd_launch, layer_norm_fwd_launch};
use crate::ops::fused::logsumexp::cuda::logsumexp_launch;
use crate::ops::fused::rms_norm::cuda::{rms_norm_bwd_launch, rms_norm_fwd_launch};
use crate::ops::fused::rotary::cuda::rotary_launch;
use crate::ops::fused::sgd::cuda::sgd_launch;
use crate::ops::fused::softmax::cuda::{softmax_bwd_launch, softmax_fwd_launch};
use crate::ops::fused::swiglu::cuda::{swiglu_bwd_launch, swiglu_fwd_launch};
use crate::ops::fused::unary_backward::cuda::unary_bwd_launch;

/// The dtype suffixes the fused kernels are instantiated for.
const SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];

/// One launch of every entry point the fused ops use, for every dtype suffix.
pub(crate) fn every_launch() -> Vec<Launch> {
    let mut v = Vec::new();
    let hp = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    // Log-sum-exp also takes f64 (logsumexp.cu instantiates it with the basic kernels' dtypes).
    for t in ["f32", "bf16", "f16", "f64"] {
        v.push(logsumexp_launch(t, [1, 2], 3, 4, 1));
        v.push(logsumexp_launch(t, [1, 2], 3, 4, 5));
    }
    for t in SUFFIXES {
        for log in [false, true] {
            v.push(softmax_fwd_launch(t, log, [1, 2], 3, 4));
            v.push(softmax_bwd_launch(t, log, [1, 2, 3], 4, 5));
        }
        v.push(gelu_bwd_launch(t, &[1, 2, 3], 4, true));
        v.push(unary_bwd_launch(
            t,
            &[1, 2, 3],
            4,
            UnaryGrad::Clamp(0.0, 1.0),
        ));
        v.push(swiglu_fwd_launch(t, &[1, 2, 3], 4));
        v.push(swiglu_bwd_launch(t, &[1, 2, 3, 4, 5], 6));
        v.push(rotary_launch(t, 1, 2, 3, [1, 2, 3, 4], 1e4, false));
        v.push(layer_norm_fwd_launch(t, [1, 2, 3, 4, 5, 6], 7, 8, 1e-5));
        v.push(rms_norm_fwd_launch(t, [1, 2, 3, 4], 5, 6, 1e-5));
        v.push(layer_norm_bwd_launch(t, [1, 2, 3, 4, 5, 6, 7, 8], 9, 10, 9));
        v.push(rms_norm_bwd_launch(t, [1, 2, 3, 4, 5, 6], 7, 8, 7));
        v.push(partials_reduce_launch(t, 1, 2, 3, 4, false));
        v.push(ce_fwd_launch(t, [1, 2, 3, 4, 5], 6, 7, Some(-100)));
        v.push(ce_bwd_launch(t, [1, 2, 3, 4, 5], 6, 7, None));
        v.push(adamw_launch(t, [1, 2, 3, 4], 5, &hp));
        v.push(sgd_launch(t, [1, 2, 3], 4, [0.1, 0.9, 0.0], false));
        for d in HEAD_DIMS {
            let shape = AttentionShape {
                batch_heads: 4,
                seq_q: 33,
                seq_k: 33,
                head_dim: d,
                causal: true,
                scale: 0.1,
            };
            let p = separate_params(&shape, 2);
            let q = qkv_params(&shape, 2, 2);
            v.push(fwd_launch(t, d, [1, 2, 3, 4, 5, 6], &p));
            v.push(dq_launch(t, d, [1, 2, 3, 4, 5, 6, 7, 8], &q));
            v.push(dkdv_launch(t, d, [1, 2, 3, 4, 5, 6, 7, 8, 9], &q));
        }
        let p = separate_params(
            &AttentionShape {
                batch_heads: 4,
                seq_q: 33,
                seq_k: 33,
                head_dim: 64,
                causal: false,
                scale: 0.1,
            },
            1,
        );
        v.push(delta_launch(t, 64, [1, 2, 3], &p));
    }
    v
}

#[test]
fn every_entry_point_of_the_fused_kernel_files_has_a_launch() {
    let launches = every_launch();
    let mut built = BTreeSet::new();
    for l in &launches {
        assert_known(l);
        built.insert((l.file, l.entry.clone()));
    }
    for file in [
        "softmax.cu",
        "layer_norm.cu",
        "rms_norm.cu",
        "norm_partials.cu",
        "gelu.cu",
        "swiglu.cu",
        "unary_backward.cu",
        "rotary.cu",
        "cross_entropy.cu",
        "adamw.cu",
        "sgd.cu",
        "attention.cu",
        "logsumexp.cu",
    ] {
        let src = meshgrad_kernels::cuda::source(file).expect("listed");
        for e in src.entries {
            // The GELU forward is the basic `unary` op (basic.rs), not a fused one.
            if e.starts_with("gelu_fwd_") {
                continue;
            }
            assert!(
                built.contains(&(file, e.to_string())),
                "no fused launch of {file}:{e}"
            );
        }
    }
}

#[test]
fn every_fused_launch_matches_the_parsed_kernel_signature() {
    // The argument sizes of each launch against the declaration read from the kernel source
    // (signature.rs), independently of the hand-copied lists the builders' own tests use.
    for l in every_launch() {
        crate::cuda_backend::signature::check_args(l.file, &l.entry, &l.sizes())
            .unwrap_or_else(|e| panic!("{}:{}: {e}", l.file, l.entry));
    }
}
