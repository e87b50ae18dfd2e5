"""transformers' rotary embedding at long positions, for the unit test of nn/src/llama/rope.rs
(expected values from transformers' LlamaRotaryEmbedding and apply_rotary_pos_emb, never meshgrad).

x[t, j] = sin(0.37 t + 0.11 j) (computed in float64, stored as float32) for positions
t = 0..8192 of one head of width 128; rope_theta 500000 (Llama 3). Writes the rotated rows at a few
positions to fixtures/hf_llama/rope_long.json.

    python nn/tests/hf_llama_rope_reference.py
"""

import json
import os

import numpy as np
import torch
import transformers
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

HERE = os.path.dirname(os.path.abspath(__file__))
T, D, THETA = 8192, 128, 500000.0
ROWS = [0, 1, 77, 1000, 4095, 8191]


def main():
    cfg = LlamaConfig(hidden_size=D, num_attention_heads=1, rope_theta=THETA,
                      max_position_embeddings=T)
    rope = LlamaRotaryEmbedding(cfg)
    t = np.arange(T, dtype=np.float64)[:, None]
    j = np.arange(D, dtype=np.float64)[None, :]
    x = torch.from_numpy(np.sin(0.37 * t + 0.11 * j).astype(np.float32))[None, None]  # [1, 1, T, D]
    with torch.no_grad():
        cos, sin = rope(x, torch.arange(T)[None])
        y, _ = apply_rotary_pos_emb(x, x, cos, sin)
    out = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "theta": THETA,
        "seq": T,
        "head_dim": D,
        "rows": ROWS,
        "rotated": [y[0, 0, r].tolist() for r in ROWS],
    }
    with open(os.path.join(HERE, "fixtures", "hf_llama", "rope_long.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
