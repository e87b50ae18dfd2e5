#!/usr/bin/env python3
"""Step-for-step check of `meshgrad train --init-from` against PyTorch + transformers.

What it checks
--------------
`meshgrad train --init-from DIR` fine-tunes a Hugging Face GPT-2 folder (config.json +
model.safetensors) with a fresh AdamW and schedule. This script builds a tiny random GPT-2 with
transformers (vocab 256, n_positions 32, n_embd 64, 2 layers, 4 heads, no dropout, fixed seed),
saves it with save_pretrained(safe_serialization=True), trains it for a few steps with meshgrad
(AdamW, no gradient clipping, no warm-up, constant learning rate, weight decay 0.1) and with
torch.optim.AdamW on the same weights, batch and hyper-parameters, and compares the per-step
training losses (the loss of each step's forward pass, before its update). It exits non-zero if
any step's loss differs by more than 1e-5 relative (f32 on both sides).

How the batch is made identical
-------------------------------
meshgrad draws each training row's window start as reduce(window_hash(seed, step, row),
len - block_size) over the *training split*, which is the head of the token stream; the last
round(len * data.val_fraction) tokens are held out for validation (nn/src/data/memory.rs,
TokenDataset::split / window_start). The data file is a raw little-endian u16 .bin (no llm.c
shard header: ids < 256 can never spell the shard magic) of 2 * (block_size + 1) = 66 random
ids, with data.val_fraction = 0.5: the training split is exactly block_size + 1 = 33 tokens, so
it has exactly one window start (0), and every row of every step is inputs = tokens[0:32],
targets = tokens[1:33]. The validation split (33 tokens) is just long enough to be accepted.

The PyTorch side feeds the same [batch_size, 32] inputs and takes the mean cross-entropy over
all batch_size * 32 positions against the next tokens. (transformers' `labels=` shift would
drop the last position, 31 predictions per row, so the loss is computed from the logits.)

Hyper-parameters mirrored (see src/train.rs optimizer_and_schedule, nn/src/optim):
  * AdamW betas = (train.beta1, train.beta2) = (0.9, 0.95) (meshgrad's defaults), eps = 1e-8
    (AdamWConfig default; optimizer_and_schedule does not set it), bias correction per step as
    in PyTorch, decoupled decay p -= lr * wd * p before the Adam update (PyTorch's order).
  * weight decay 0.1 on every parameter of rank >= 2 (nanoGPT rule, param_groups_for_decay):
    wte (tied with lm_head, counted once), wpe, c_attn/c_proj/c_fc weights; none on biases and
    LayerNorm weights/biases.
  * constant learning rate: train.lr = train.min_lr with warmup_steps = 0 makes
    CosineSchedule.lr_at(step) = lr for every step.
  * no clipping (train.grad_clip = 0), dropout 0, f32, eval mode on the PyTorch side.

How to run
----------
    python tests/hf_gpt2_finetune_check.py /path/to/meshgrad [--steps 8] [--keep DIR]

Needs torch, transformers and safetensors (CPU is enough). Everything is written to a
temporary folder (or to --keep DIR, which is kept).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256
BLOCK = 32
BATCH = 4
LR = 1e-3
WD = 0.1
BETAS = (0.9, 0.95)  # meshgrad's train.beta1 / train.beta2 defaults
EPS = 1e-8  # meshgrad's AdamWConfig default
TOL = 1e-5  # relative


def make_model(model_dir, seed):
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=BLOCK,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    model.save_pretrained(model_dir, safe_serialization=True)


def make_data(path, seed):
    """2 * (BLOCK + 1) raw u16 ids: with val_fraction 0.5 the training split is one window."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=2 * (BLOCK + 1), dtype=np.uint16)
    tokens.astype("<u2").tofile(path)
    return tokens.astype(np.int64)


def run_meshgrad(binary, model_dir, data_path, steps, work):
    metrics = os.path.join(work, "m.jsonl")
    out = os.path.join(work, "out")
    cmd = [
        binary, "train",
        "--init-from", model_dir,
        "--data", data_path,
        "--steps", str(steps),
        "--set", f"train.batch_size={BATCH}",
        "--set", "train.grad_clip=0",
        "--set", "train.warmup_steps=0",
        "--set", f"train.lr={LR}",
        "--set", f"train.min_lr={LR}",
        "--set", f"train.weight_decay={WD}",
        "--set", f"train.beta1={BETAS[0]}",
        "--set", f"train.beta2={BETAS[1]}",
        "--set", "train.eval_interval=0",
        "--set", "train.sample_tokens=0",
        "--set", "data.val_fraction=0.5",
        "--set", "model.dropout=0",
        "--metrics", metrics,
        "--out", out,
        "--overwrite",
    ]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        sys.exit(f"meshgrad train failed with exit status {r.returncode}")
    losses = []
    with open(metrics) as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                if "loss" in rec:
                    losses.append(float(rec["loss"]))
    if len(losses) != steps:
        sys.exit(f"expected {steps} loss lines in {metrics}, got {len(losses)}")
    return losses


def run_torch(model_dir, tokens, steps):
    torch.manual_seed(0)
    model = GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()  # dropout is 0 anyway
    window = torch.tensor(tokens[: BLOCK + 1])
    ids = window[:-1].unsqueeze(0).repeat(BATCH, 1)  # [B, T]
    targets = window[1:].unsqueeze(0).repeat(BATCH, 1)  # [B, T]

    # nanoGPT decay groups: rank >= 2 decays; parameters() yields the tied wte/lm_head once.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append((name, p))
    print("decayed:", [n for n, _ in decay])
    print("not decayed:", [n for n, _ in no_decay])
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in decay], "weight_decay": WD},
            {"params": [p for _, p in no_decay], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        foreach=False,
        fused=False,
    )
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("meshgrad", help="path to the meshgrad binary")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--keep", help="work in this folder and keep it")
    args = ap.parse_args()

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, numpy {np.__version__}")
    torch.set_num_threads(1)
    if args.keep:
        work = os.path.abspath(args.keep)
        os.makedirs(work, exist_ok=True)
    else:
        work = tempfile.mkdtemp(prefix="hf_gpt2_finetune_check.")
    try:
        model_dir = os.path.join(work, "gpt2-tiny")
        data_path = os.path.join(work, "tokens.bin")
        make_model(model_dir, args.seed)
        tokens = make_data(data_path, args.seed)
        mg = run_meshgrad(os.path.abspath(args.meshgrad), model_dir, data_path, args.steps, work)
        pt = run_torch(model_dir, tokens, args.steps)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"{'step':>4} {'meshgrad':>14} {'pytorch':>14} {'abs diff':>10} {'rel diff':>10}")
    max_abs = max_rel = 0.0
    for i, (a, b) in enumerate(zip(mg, pt)):
        d = abs(a - b)
        r = d / max(abs(b), 1e-30)
        max_abs, max_rel = max(max_abs, d), max(max_rel, r)
        print(f"{i + 1:>4} {a:>14.8f} {b:>14.8f} {d:>10.2e} {r:>10.2e}")
    print(f"max abs diff {max_abs:.3e}, max rel diff {max_rel:.3e} (tolerance {TOL:g} relative)")
    if max_rel > TOL:
        print("FAIL")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
