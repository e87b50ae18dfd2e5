#!/usr/bin/env python3
"""PyTorch reference for `meshgrad bench`: the same GPT training step on CPU.

nanoGPT-style model exactly as shared/notes/anchors.md describes it: learned positions, pre-LN
blocks with a fused qkv Linear (with bias), F.scaled_dot_product_attention(is_causal=True),
4x MLP with tanh GELU, final LayerNorm, output head tied to the token embedding; AdamW lr 1e-3
(weight decay 0.01 on every parameter, as meshgrad's bench); f32; dropout 0; random tokens from a
fixed seed. 2 warm-up steps, then the median of N timed steps (forward + backward + optimizer).

Prints, last, one line: params=... step_median_s=... tokens_per_s=... gflops=... peak_bytes=...
(peak_bytes is the process's peak resident set size, the closest CPU figure PyTorch offers).

Usage: python benches/pytorch_gpt.py --model tiny-gpt|small-gpt [--steps 10] [--threads 2]
"""

import argparse
import math
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    # name: (n_layer, n_head, n_embd, seq); vocab 256, batch 8 for both.
    "tiny-gpt": (4, 4, 256, 128),
    "small-gpt": (6, 6, 384, 256),
}
VOCAB = 256
BATCH = 8


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.n_head = h
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.c_attn = nn.Linear(c, 3 * c, bias=True)
        self.attn_proj = nn.Linear(c, c, bias=True)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.c_fc = nn.Linear(c, 4 * c, bias=True)
        self.mlp_proj = nn.Linear(4 * c, c, bias=True)

    def attn(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        h = self.n_head
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.attn_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, seq):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(seq, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        pos = torch.arange(t, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-gpt", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    n_layer, n_head, n_embd, seq = CONFIGS[args.model]
    model = GPT(n_layer, n_head, n_embd, seq)
    model.train()
    params = sum(p.numel() for p in model.parameters())  # tied head counted once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0x5EED)
    toks = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=g)
    x, y = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()

    def step():
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    first = step()
    step()
    times = []
    last = first
    for _ in range(args.steps):
        t0 = time.perf_counter()
        last = step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = BATCH * seq
    flops = 6 * params * tokens + 12 * n_layer * n_embd * seq * tokens
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"pytorch {torch.__version__} bench {args.model}: {torch.get_num_threads()} threads; "
        f"loss {first:.4f} -> {last:.4f}; step times (s): min {min(times):.4f} "
        f"median {med:.4f} max {max(times):.4f}"
    )
    print(
        f"params={params} step_median_s={med:.6f} tokens_per_s={tokens / med:.1f} "
        f"gflops={flops / med / 1e9:.2f} peak_bytes={peak}"
    )


if __name__ == "__main__":
    main()
