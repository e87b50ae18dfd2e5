//! The compute time of one micro-batch through one block, the embedding and the head on one
//! device: matrix multiplications at a shape-dependent efficiency, plus the memory-bound
//! element-wise work.
//!
//! **Matrix multiplications.** A block's forward is the GEMMs [`super::flops`] counts, each
//! split over the `tp` tensor-parallel ranks as Megatron splits them (q/k/v and the MLP's up
//! projections by columns, the output projections by rows, the attention by heads). An
//! `m x k` by `k x n` product of `2 m n k` operations runs at
//! `peak * peak_fraction * f(m) f(n) f(k)` with `f(d) = d / (d + half_dim)` (the device file's
//! `[matmul]` curve: a large GEMM reaches `peak_fraction` of the peak, and a thin one loses to
//! tiles it cannot fill). The backward runs two GEMMs of the same shapes per forward GEMM (the
//! input and the weight gradient), so it costs twice the forward's time. A mixture of experts'
//! experts stay whole on every tensor-parallel rank, each running `k / E` of the token copies
//! (balanced routing), and its router adds a `C x E` product.
//!
//! **Element-wise work** moves activations through device memory at
//! [`STREAM_FRACTION`] of its bandwidth. Per token, the forward of a block reads and writes
//! `16 C` values outside the attention and the MLP (two norms, two residual additions, two
//! dropouts; every tensor-parallel rank does it all unless sequence parallelism splits it by
//! `tp`), `2 F` inside the MLP (its activation; `3 F` for a gated MLP), and, when the attention
//! materialises its scores ([`Attention::Materialized`]), `5 H T` for the softmax and the
//! dropout over them (both split by `tp`). A fused attention keeps the scores on chip. The
//! backward moves twice the forward's values.
//!
//! The embedding's forward moves `4 C` values per token (the lookup and the position sum); the
//! head's forward is one GEMM (`C x V / tp`) and `3 V / tp` values per token for the logits,
//! the softmax and its gradient.

use meshgrad_nn::ModelShape;

use super::device::DeviceKind;
use super::memory::Precision;

/// The fraction of the device memory's bandwidth that streaming kernels reach (an assumption:
/// copy kernels on recent GPUs reach 80 to 90% of the datasheet figure).
pub const STREAM_FRACTION: f64 = 0.8;

/// How the attention treats its `T x T` scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Attention {
    /// A flash-attention style kernel (meshgrad's): the scores stay on chip.
    #[default]
    Fused,
    /// The scores go through device memory (a softmax kernel and a dropout over them), as in
    /// Megatron-LM of 2021.
    Materialized,
}

/// What a device runs for one micro-batch (see the [module docs](self)).
#[derive(Clone, Copy, Debug)]
pub struct MicroBatch<'a> {
    /// The model.
    pub model: &'a ModelShape,
    /// The device.
    pub device: &'a DeviceKind,
    /// The precision of the GEMMs and the activations.
    pub precision: Precision,
    /// The attention kernel.
    pub attention: Attention,
    /// Rows of the micro-batch.
    pub rows: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Sequence parallelism (splits the element-wise work outside attention and MLP).
    pub sequence_parallel: bool,
    /// Context-parallel degree: the rank holds `1 / cp` of each row's tokens, whose queries
    /// meet all `T` keys over the ring.
    pub cp: usize,
}

/// Measured over modelled compute time of each part of the model on the device, by which the
/// cost model multiplies its compute: a per-layer profile's correction (`--device-kind cpu`
/// measures the model's layers on this machine and sets it); 1 for every part otherwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeScale {
    /// One block's forward and backward.
    pub block: f64,
    /// The embedding's.
    pub embedding: f64,
    /// The head's (the logits and the loss).
    pub head: f64,
}

impl ComputeScale {
    /// The scale of measured forward + backward milliseconds of one block, the embedding and
    /// the head (a per-layer profile's) against what `mb` predicts at `peak` FLOP/s for them
    /// (three forwards: the backward is twice the forward).
    pub fn measured(
        block_ms: f64,
        embedding_ms: f64,
        head_ms: f64,
        mb: &MicroBatch<'_>,
        peak: f64,
    ) -> Self {
        let ratio = |ms: f64, forward: f64| (ms * 1e-3 / (3.0 * forward)).max(0.0);
        ComputeScale {
            block: ratio(block_ms, mb.block(peak).total()),
            embedding: ratio(embedding_ms, mb.embedding().total()),
            head: ratio(head_ms, mb.head(peak).total()),
        }
    }
}

impl Default for ComputeScale {
    /// 1 for every part: the cost model's compute as it is.
    fn default() -> Self {
        ComputeScale {
            block: 1.0,
            embedding: 1.0,
            head: 1.0,
        }
    }
}

/// Forward seconds of one part of the model for one micro-batch, split by kind of work.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PartTime {
    /// Matrix multiplications.
    pub gemm: f64,
    /// Element-wise, memory-bound work.
    pub elementwise: f64,
}

impl PartTime {
    /// Both together.
    pub fn total(&self) -> f64 {
        self.gemm + self.elementwise
    }
}

/// One GEMM: `count` products of `m x k` by `k x n`.
struct Gemm {
    m: f64,
    n: f64,
    k: f64,
    count: f64,
}

impl MicroBatch<'_> {
    /// This rank's tokens: `rows x T / cp`.
    fn tokens(&self) -> f64 {
        (self.rows * self.model.positions) as f64 / self.cp.max(1) as f64
    }

    /// The efficiency curve's factor for one dimension.
    fn dim(&self, d: f64) -> f64 {
        d / (d + self.device.matmul.half_dim)
    }

    fn gemm_seconds(&self, g: &Gemm, peak: f64) -> f64 {
        let eff = self.device.matmul.peak_fraction * self.dim(g.m) * self.dim(g.n) * self.dim(g.k);
        2.0 * g.m * g.n * g.k * g.count / (peak * eff)
    }

    fn stream_seconds(&self, values: f64) -> f64 {
        values * self.precision.bytes() as f64
            / (self.device.memory_bytes_per_s() * STREAM_FRACTION)
    }

    /// The GEMMs of one block's forward on one tensor-parallel rank.
    fn block_gemms(&self) -> Vec<Gemm> {
        let s = self.model;
        let (tok, tp) = (self.tokens(), self.tp as f64);
        let c = s.n_embd as f64;
        let d = (s.n_embd / s.n_head.max(1)) as f64;
        let kv = d * s.n_kv_head as f64;
        let f = s.ffn as f64;
        let t = s.positions as f64;
        let cp = self.cp.max(1) as f64;
        let heads = self.rows as f64 * s.n_head as f64 / tp;
        let up = if s.gated_mlp { 2.0 } else { 1.0 };
        let one = |m, n, k| Gemm {
            m,
            n,
            k,
            count: 1.0,
        };
        // A mixture of experts: whole on every tensor-parallel rank, each of the `E` experts
        // takes `k / E` of the token copies (balanced routing), and the router one product.
        let moe = s.n_experts > 0;
        let (mlp_m, mlp_count, mlp_tp) = if moe {
            let e = s.n_experts as f64;
            (tok * s.mlps_per_token() as f64 / e, e, 1.0)
        } else {
            (tok, 1.0, tp)
        };
        let mut gemms = vec![
            one(tok, (c + 2.0 * kv) / tp, c),
            Gemm {
                m: t / cp,
                n: t,
                k: d,
                count: heads,
            },
            Gemm {
                m: t / cp,
                n: d,
                k: t,
                count: heads,
            },
            one(tok, c, c / tp),
            Gemm {
                m: mlp_m,
                n: f / mlp_tp,
                k: c,
                count: up * mlp_count,
            },
            Gemm {
                m: mlp_m,
                n: c,
                k: f / mlp_tp,
                count: mlp_count,
            },
        ];
        if moe {
            gemms.push(one(tok, s.n_experts as f64, c));
        }
        gemms
    }

    /// Operations of one block's forward on one tensor-parallel rank.
    pub fn block_flops(&self) -> f64 {
        self.block_gemms()
            .iter()
            .map(|g| 2.0 * g.m * g.n * g.k * g.count)
            .sum()
    }

    /// One block's forward.
    pub fn block(&self, peak: f64) -> PartTime {
        let s = self.model;
        let tp = self.tp as f64;
        let outside = 16.0 * s.n_embd as f64 / if self.sequence_parallel { tp } else { 1.0 };
        let mlp = if s.gated_mlp { 3.0 } else { 2.0 } * s.ffn as f64;

        let scores = match self.attention {
            Attention::Fused => 0.0,
            Attention::Materialized => 5.0 * (s.n_head * s.positions) as f64,
        };
        // A mixture of experts streams its `k` experts' values on every tensor-parallel rank.
        let inside = if s.n_experts > 0 {
            s.mlps_per_token() as f64 * mlp + scores / tp
        } else {
            (mlp + scores) / tp
        };
        PartTime {
            gemm: self
                .block_gemms()
                .iter()
                .map(|g| self.gemm_seconds(g, peak))
                .sum(),
            elementwise: self.stream_seconds(self.tokens() * (outside + inside)),
        }
    }

    /// The embedding's forward.
    pub fn embedding(&self) -> PartTime {
        PartTime {
            gemm: 0.0,
            elementwise: self.stream_seconds(self.tokens() * 4.0 * self.model.n_embd as f64),
        }
    }

    /// The head's forward (the logits and the loss).
    pub fn head(&self, peak: f64) -> PartTime {
        let v = self.model.vocab_size as f64 / self.tp as f64;
        let g = Gemm {
            m: self.tokens(),
            n: v,
            k: self.model.n_embd as f64,
            count: 1.0,
        };
        PartTime {
            gemm: self.gemm_seconds(&g, peak),
            elementwise: self.stream_seconds(self.tokens() * 3.0 * v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_nn::GptConfig;

    fn gpt(l: usize, c: usize, heads: usize) -> ModelShape {
        GptConfig {
            vocab_size: 51200,
            block_size: 2048,
            n_layer: l,
            n_head: heads,
            n_embd: c,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        }
        .shape()
    }

    #[test]
    fn gemms_split_the_flop_count_over_tensor_parallel_ranks() {
        // Narayanan et al. (2021): a block's forward is 24 B s h^2 (1 + s / 6h) operations.
        let shape = gpt(2, 12288, 96);
        let device = DeviceKind::preset("a100-80gb").unwrap();
        for tp in [1, 2, 8] {
            let mb = MicroBatch {
                model: &shape,
                device: &device,
                precision: Precision::Bf16,
                attention: Attention::Fused,
                rows: 2,
                tp,
                sequence_parallel: false,
                cp: 1,
            };
            let (b, s, h) = (2.0, 2048.0, 12288.0);
            let paper = 24.0 * b * s * h * h * (1.0 + s / (6.0 * h)) / tp as f64;
            assert!((mb.block_flops() / paper - 1.0).abs() < 1e-12, "tp {tp}");
            // Context parallelism: a rank's queries are `1 / cp` of the tokens, whatever the
            // keys they meet.
            for cp in [2, 4] {
                let part = MicroBatch { cp, ..mb }.block_flops();
                assert!(
                    (part * cp as f64 / paper - 1.0).abs() < 1e-12,
                    "tp {tp} cp {cp}"
                );
            }
        }
    }

    #[test]
    fn a_mixture_of_experts_runs_the_flops_the_count_gives() {
        let mut c = meshgrad_nn::LlamaConfig::new(32000, 1024, 1024, 2, 16);
        c.moe = Some(meshgrad_nn::moe::MoeSettings {
            n_experts: 8,
            experts_per_token: 2,
            router_aux_loss_coef: 0.02,
            capacity_factor: None,
        });
        let shape = c.shape();
        let device = DeviceKind::preset("h100").unwrap();
        for tp in [1, 2] {
            let mb = MicroBatch {
                model: &shape,
                device: &device,
                precision: Precision::Bf16,
                attention: Attention::Fused,
                rows: 2,
                tp,
                sequence_parallel: false,
                cp: 1,
            };
            let per_token = super::super::flops::forward_per_token(&shape, 1024).block;
            // Under tp the experts and the router stay whole on every rank.
            let f = shape.ffn as f64;
            let whole = 2.0 * (6.0 * 1024.0 * f) + 2.0 * 1024.0 * 8.0;
            let want = 2048.0 * ((per_token - whole) / tp as f64 + whole);
            assert!((mb.block_flops() / want - 1.0).abs() < 1e-12, "tp {tp}");
        }
    }

    #[test]
    fn a_large_gemm_runs_near_the_curve_s_ceiling() {
        let shape = gpt(1, 8192, 64);
        let device = DeviceKind::preset("a100-80gb").unwrap();
        let mb = MicroBatch {
            model: &shape,
            device: &device,
            precision: Precision::Bf16,
            attention: Attention::Fused,
            rows: 4,
            tp: 1,
            sequence_parallel: false,
            cp: 1,
        };
        let g = Gemm {
            m: 8192.0,
            n: 8192.0,
            k: 8192.0,
            count: 1.0,
        };
        // 0.85 x (8192 / 8256)^3 of 312 TFLOP/s, by hand: 0.8302...
        let t = mb.gemm_seconds(&g, 312e12);
        let rate = 2.0 * 8192f64.powi(3) / t;
        let by_hand = 312e12 * 0.85 * (8192.0f64 / 8256.0).powi(3);
        assert!((rate / by_hand - 1.0).abs() < 1e-12);
        // Element-wise: 16 C + 2 F = 24 C values per token in bf16 at 0.8 x 2039 GB/s.
        let ew = mb.block(312e12).elementwise;
        let by_hand = 4.0 * 2048.0 * 24.0 * 8192.0 * 2.0 / (2039e9 * 0.8);
        assert!((ew / by_hand - 1.0).abs() < 1e-12);
    }
}
