//! The rotary position embedding of a Llama, two ways: the fused op (angles in f64 inside one
//! kernel) or transformers' tables (cos and sin computed in f32 as `LlamaRotaryEmbedding` does,
//! applied with elementwise ops), so a Hugging Face checkpoint sees the rotation it was trained
//! and evaluated with.

use meshgrad_autograd::Var;
use std::sync::Mutex;

use meshgrad_tensor::{DType, Device, Result, Tensor};

use crate::cp::ContextParallel;

/// How a Llama computes its rotary embedding's angles. Both rotate in the "rotate half"
/// convention of Hugging Face's Llama (element `i < D/2` of a head pairs with `i + D/2`) by the
/// angle `position · theta^(-2i/D)`; they differ in rounding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeAngles {
    /// The fused op ([`Var::rotary_embedding`]): angles, cos and sin in f64 inside one kernel.
    /// The most accurate, and one op per tensor. The default of a model built from scratch.
    #[default]
    Fused,
    /// As transformers' `LlamaRotaryEmbedding`: `inv_freq = 1 / theta^(2i/D)`, the angles
    /// `inv_freq · position`, cos and sin all in f32 (then cast to the model's dtype), applied as
    /// `x cos + rotate_half(x) sin`. At long positions the f32 angles are off the exact ones by
    /// up to ~2e-4 (position 4096); a checkpoint trained with them is evaluated with them here.
    /// The default of a model read from a Hugging Face `config.json`.
    Transformers,
}

/// The last cos and sin tables `[T, 1, D]` a layer built for [`RopeAngles::Transformers`], so a
/// run of one sequence length computes them once per layer.
#[derive(Default)]
pub(crate) struct TableCache {
    last: Mutex<Option<Tables>>,
}

/// Tables and what they were built for: sequence length, head width, base, dtype, device.
struct Tables {
    key: (usize, usize, u64, DType, Device),
    cos: Tensor,
    sin: Tensor,
}

impl TableCache {
    /// transformers' tables for `t` positions of heads of width `d`, in `dtype` on `device`.
    fn get(
        &self,
        t: usize,
        d: usize,
        theta: f64,
        dtype: DType,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        let key = (t, d, theta.to_bits(), dtype, device);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tab) = last.as_ref().filter(|tab| tab.key == key) {
            return Ok((tab.cos.clone(), tab.sin.clone()));
        }
        let (cos, sin) = transformers_tables(t, d, theta);
        let table = |v: Vec<f32>| Tensor::from_vec(v, (t, 1, d), device)?.to_dtype(dtype);
        let (cos, sin) = (table(cos)?, table(sin)?);
        *last = Some(Tables {
            key,
            cos: cos.clone(),
            sin: sin.clone(),
        });
        Ok((cos, sin))
    }
}

/// Rotates `x [B, T, H, D]` at positions `0..T` with base `theta` (under context parallelism
/// `cp`, at this rank's global positions of a sequence `cp.degree()` times longer); `cache`
/// keeps transformers' tables between calls.
pub(crate) fn rotate(
    x: &Var,
    theta: f64,
    angles: RopeAngles,
    cache: &TableCache,
    cp: Option<&ContextParallel>,
) -> Result<Var> {
    let t = x.tensor().dims()[1];
    let device = x.tensor().device();
    if angles == RopeAngles::Fused {
        let positions = match cp {
            Some(cp) => cp.positions(t, device)?,
            None => Tensor::arange(0, t as i64, DType::I64, device)?,
        };
        return x.rotary_embedding(&positions, theta);
    }
    let d = *x.tensor().dims().last().unwrap_or(&0);
    if x.tensor().rank() != 4 || !d.is_multiple_of(2) {
        meshgrad_tensor::bail!(
            "rotary embedding: expected x [B, T, H, D] with an even head width D, got {}",
            x.tensor().shape()
        );
    }
    let (cos, sin) = match cp {
        // The whole sequence's tables, this rank's rows.
        Some(cp) => {
            let (cos, sin) = cache.get(t * cp.degree(), d, theta, x.tensor().dtype(), device)?;
            (cp.local_rows(&cos, 0)?, cp.local_rows(&sin, 0)?)
        }
        None => cache.get(t, d, theta, x.tensor().dtype(), device)?,
    };
    let (cos, sin) = (Var::constant(cos), Var::constant(sin));
    let half = d / 2;
    let rotated = Var::cat(
        &[&x.narrow(3, half, half)?.neg()?, &x.narrow(3, 0, half)?],
        3,
    )?;
    x.mul(&cos)?.add(&rotated.mul(&sin)?)
}

/// transformers' cos and sin tables `[T, D]` (row-major) for heads of width `d`, in f32:
/// `inv_freq[i] = 1 / theta^((2i) / d)`, `angle[t][i] = t · inv_freq[i]` (one f32 product),
/// each half of a row the same `D/2` angles.
fn transformers_tables(t: usize, d: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let base = theta as f32;
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0f32 / base.powf((2 * i) as f32 / d as f32))
        .collect();
    let (mut cos, mut sin) = (Vec::with_capacity(t * d), Vec::with_capacity(t * d));
    for pos in 0..t {
        for _ in 0..2 {
            for f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_tensor::Device;

    /// Both ways against transformers' `LlamaRotaryEmbedding` + `apply_rotary_pos_emb` at
    /// positions up to 8191 with Llama 3's base (fixture of `tests/hf_llama_rope_reference.py`):
    /// transformers' tables agree to f32 rounding; the exact fused angles differ by the f32
    /// rounding of transformers' angles, which grows with the position.
    #[test]
    fn rotations_match_transformers_at_long_positions() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/hf_llama/rope_long.json"
        );
        let e: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let (t, d) = (
            e["seq"].as_u64().unwrap() as usize,
            e["head_dim"].as_u64().unwrap() as usize,
        );
        let theta = e["theta"].as_f64().unwrap();
        let x: Vec<f32> = (0..t * d)
            .map(|k| (0.37 * (k / d) as f64 + 0.11 * (k % d) as f64).sin() as f32)
            .collect();
        let x = Var::constant(Tensor::from_vec(x, (1, t, 1, d), Device::Cpu).unwrap());
        let cache = TableCache::default();
        let worst = |angles: RopeAngles| -> f64 {
            let y = rotate(&x, theta, angles, &cache, None).unwrap();
            let mut worst = 0.0f64;
            for (row, want) in e["rows"]
                .as_array()
                .unwrap()
                .iter()
                .zip(e["rotated"].as_array().unwrap())
            {
                let r = row.as_u64().unwrap() as usize;
                let got = y.tensor().narrow(1, r, 1).unwrap().to_vec_f64().unwrap();
                for (g, w) in got.iter().zip(want.as_array().unwrap()) {
                    worst = worst.max((g - w.as_f64().unwrap()).abs());
                }
            }
            worst
        };
        let (ours, fused) = (worst(RopeAngles::Transformers), worst(RopeAngles::Fused));
        println!("worst difference from transformers: tables {ours:.2e}, fused {fused:.2e}");
        assert!(ours < 1e-6, "transformers' tables: worst difference {ours}");
        assert!(
            fused > 1e-5 && fused < 2e-3,
            "fused angles: worst difference {fused}"
        );
    }
}
