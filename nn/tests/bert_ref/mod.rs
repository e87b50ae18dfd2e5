//! An independent float64 reference of Hugging Face's `BertForMaskedLM` forward and MLM loss,
//! written with plain loops over the raw tensors of a safetensors file (read with the
//! `safetensors` crate, no meshgrad code). Shared by `nn/tests/bert.rs` and `tests/cli_bert.rs`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensors;

/// A tensor read straight from the safetensors bytes: shape and values as f64.
pub struct Raw {
    pub shape: Vec<usize>,
    pub v: Vec<f64>,
}

/// Every tensor of `path` (f32 or f64 data).
pub fn read_raw(path: &Path) -> HashMap<String, Raw> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let d = view.data();
        let v: Vec<f64> = match view.dtype() {
            safetensors::Dtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            safetensors::Dtype::F64 => d
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            other => panic!("{name}: unexpected dtype {other:?}"),
        };
        out.insert(
            name.to_string(),
            Raw {
                shape: view.shape().to_vec(),
                v,
            },
        );
    }
    out
}

/// erf(x) in f64: the Taylor series below 3, the continued fraction of erfc above.
pub fn erf(x: f64) -> f64 {
    let z = x.abs();
    let r = if z < 3.0 {
        let mut term = z;
        let mut sum = z;
        for n in 1..200 {
            term *= -z * z / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        let mut f = z;
        for n in (1..=80).rev() {
            f = z + (n as f64 / 2.0) / f;
        }
        1.0 - (-z * z).exp() / (std::f64::consts::PI.sqrt() * f)
    };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

/// Exact GELU.
pub fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

/// The hyper-parameters the reference needs.
#[derive(Clone, Copy, Debug)]
pub struct RefConfig {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub layer_norm_eps: f64,
}

/// One sequence: ids, attention mask (1 attend, 0 padding), token types, labels (-100 ignored).
pub struct Seq {
    pub ids: Vec<usize>,
    pub mask: Vec<f64>,
    pub types: Vec<usize>,
    pub labels: Vec<i64>,
}

/// The reference model: the tensors of a checkpoint, under names with `prefix` (`"bert."` or
/// `""`) for the encoder and `cls.` for the head.
pub struct Reference {
    pub w: HashMap<String, Raw>,
    pub prefix: String,
    pub cfg: RefConfig,
}

impl Reference {
    /// Reads `dir/model.safetensors`.
    pub fn load(dir: &Path, prefix: &str, cfg: RefConfig) -> Self {
        Reference {
            w: read_raw(&dir.join("model.safetensors")),
            prefix: prefix.to_string(),
            cfg,
        }
    }

    fn get(&self, name: &str) -> &Raw {
        let full = if name.starts_with("cls.") {
            name.to_string()
        } else {
            format!("{}{name}", self.prefix)
        };
        self.w
            .get(&full)
            .unwrap_or_else(|| panic!("missing {full}"))
    }

    /// `x W^T + b` for rows `x`.
    fn linear(&self, x: &[Vec<f64>], name: &str) -> Vec<Vec<f64>> {
        let w = self.get(&format!("{name}.weight"));
        let b = self.get(&format!("{name}.bias"));
        let (o, i) = (w.shape[0], w.shape[1]);
        x.iter()
            .map(|row| {
                assert_eq!(row.len(), i);
                (0..o)
                    .map(|r| b.v[r] + (0..i).map(|c| w.v[r * i + c] * row[c]).sum::<f64>())
                    .collect()
            })
            .collect()
    }

    fn layer_norm(&self, x: &[Vec<f64>], name: &str) -> Vec<Vec<f64>> {
        let w = &self.get(&format!("{name}.weight")).v;
        let b = &self.get(&format!("{name}.bias")).v;
        x.iter()
            .map(|row| {
                let n = row.len() as f64;
                let mean = row.iter().sum::<f64>() / n;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                let rstd = 1.0 / (var + self.cfg.layer_norm_eps).sqrt();
                row.iter()
                    .enumerate()
                    .map(|(j, v)| (v - mean) * rstd * w[j] + b[j])
                    .collect()
            })
            .collect()
    }

    /// Logits `[T][V]` of one sequence.
    pub fn logits(&self, ids: &[usize], mask: &[f64], types: &[usize]) -> Vec<Vec<f64>> {
        let h = self.cfg.hidden_size;
        let nh = self.cfg.num_attention_heads;
        let d = h / nh;
        let t = ids.len();
        let we = self.get("embeddings.word_embeddings.weight");
        let pe = self.get("embeddings.position_embeddings.weight");
        let te = self.get("embeddings.token_type_embeddings.weight");
        let x: Vec<Vec<f64>> = (0..t)
            .map(|i| {
                (0..h)
                    .map(|j| we.v[ids[i] * h + j] + pe.v[i * h + j] + te.v[types[i] * h + j])
                    .collect()
            })
            .collect();
        let mut x = self.layer_norm(&x, "embeddings.LayerNorm");
        for l in 0..self.cfg.num_hidden_layers {
            let p = format!("encoder.layer.{l}");
            let q = self.linear(&x, &format!("{p}.attention.self.query"));
            let k = self.linear(&x, &format!("{p}.attention.self.key"));
            let v = self.linear(&x, &format!("{p}.attention.self.value"));
            let mut ctx = vec![vec![0.0; h]; t];
            // Padded keys take no part (HF's additive mask gives them probability 0).
            let keys: Vec<usize> = (0..t).filter(|&j| mask[j] != 0.0).collect();
            for head in 0..nh {
                let cols = head * d..(head + 1) * d;
                for i in 0..t {
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            cols.clone().map(|c| q[i][c] * k[j][c]).sum::<f64>() / (d as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (n, &j) in keys.iter().enumerate() {
                        for c in cols.clone() {
                            ctx[i][c] += e[n] / z * v[j][c];
                        }
                    }
                }
            }
            let add = |a: &[Vec<f64>], b: &[Vec<f64>]| -> Vec<Vec<f64>> {
                a.iter()
                    .zip(b)
                    .map(|(r, s)| r.iter().zip(s).map(|(u, w)| u + w).collect())
                    .collect()
            };
            let a = self.linear(&ctx, &format!("{p}.attention.output.dense"));
            let a = self.layer_norm(&add(&a, &x), &format!("{p}.attention.output.LayerNorm"));
            let inter: Vec<Vec<f64>> = self
                .linear(&a, &format!("{p}.intermediate.dense"))
                .into_iter()
                .map(|r| r.into_iter().map(gelu).collect())
                .collect();
            let o = self.linear(&inter, &format!("{p}.output.dense"));
            x = self.layer_norm(&add(&o, &a), &format!("{p}.output.LayerNorm"));
        }
        let hd: Vec<Vec<f64>> = self
            .linear(&x, "cls.predictions.transform.dense")
            .into_iter()
            .map(|r| r.into_iter().map(gelu).collect())
            .collect();
        let hd = self.layer_norm(&hd, "cls.predictions.transform.LayerNorm");
        let bias = &self.get("cls.predictions.bias").v;
        let vocab = self.cfg.vocab_size;
        hd.iter()
            .map(|row| {
                (0..vocab)
                    .map(|tok| bias[tok] + (0..h).map(|j| we.v[tok * h + j] * row[j]).sum::<f64>())
                    .collect()
            })
            .collect()
    }

    /// The mean cross-entropy over every labelled token of `seqs`.
    pub fn loss(&self, seqs: &[Seq]) -> f64 {
        let (mut total, mut n) = (0.0, 0);
        for s in seqs {
            let lg = self.logits(&s.ids, &s.mask, &s.types);
            for (i, &l) in s.labels.iter().enumerate() {
                if l == -100 {
                    continue;
                }
                let m = lg[i].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + lg[i].iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                total += lse - lg[i][l as usize];
                n += 1;
            }
        }
        total / n as f64
    }
}
