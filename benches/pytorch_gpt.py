#!/usr/bin/env python3
"""PyTorch reference for `meshgrad bench`: the same GPT training step, on the CPU or a GPU.

nanoGPT-style model exactly as shared/notes/anchors.md describes it: learned positions, pre-LN
blocks with a fused qkv Linear (with bias), F.scaled_dot_product_attention(is_causal=True),
4x MLP with tanh GELU, final LayerNorm, output head tied to the token embedding; AdamW lr 1e-3
(weight decay 0.01 on every parameter, as meshgrad's bench); f32; dropout 0; random tokens from a
fixed seed. 2 warm-up steps, then the median of N timed steps (forward + backward + optimizer).

Prints, last, one line: params=... step_median_s=... tokens_per_s=... gflops=... peak_bytes=...
(peak_bytes: on the CPU the process's peak resident set size, the closest CPU figure PyTorch
offers; on a GPU torch.cuda.max_memory_allocated over the timed steps). On a GPU the line also
has mfu=... against 989 TFLOP/s (H100 dense bf16), and the first line names the mode.

Usage: python benches/pytorch_gpt.py --model tiny-gpt|small-gpt|gpt2-124m [--steps 10]
       [--threads 2] [--device cpu|cuda] [--batch B] [--compile] [--precision f32|bf16]
On a GPU: --precision bf16 runs the forward under torch.autocast(bfloat16) with f32 parameters
and optimizer state (PyTorch's mixed precision); --compile wraps the model in torch.compile;
AdamW is PyTorch's fused kernel (fused=True).
gpt2-124m: vocab 50304, 12 layers, 12 heads, n_embd 768, seq 1024 (anchors.md); FLOPs count N
without the position embeddings, as the anchors do.
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
    # name: (n_layer, n_head, n_embd, seq, vocab); batch 8 by default.
    "tiny-gpt": (4, 4, 256, 128, 256),
    "small-gpt": (6, 6, 384, 256, 256),
    "gpt2-124m": (12, 12, 768, 1024, 50304),
}
H100_BF16_DENSE_FLOPS = 989e12


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
    def __init__(self, n_layer, n_head, n_embd, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(seq, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
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
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
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
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    dev = torch.device(args.device)
    n_layer, n_head, n_embd, seq, vocab = CONFIGS[args.model]
    model = GPT(n_layer, n_head, n_embd, seq, vocab).to(dev)
    model.train()
    params = sum(p.numel() for p in model.parameters())  # tied head counted once
    flops_params = params - seq * n_embd if args.model == "gpt2-124m" else params
    # On a GPU, PyTorch's fused AdamW kernel (as nanoGPT uses): the strongest reference.
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)
    fwd = torch.compile(model) if args.compile else model
    g = torch.Generator().manual_seed(0x5EED)
    batch = args.batch
    toks = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    x, y = toks[:, :-1].contiguous().to(dev), toks[:, 1:].contiguous().to(dev)
    use_amp = args.precision == "bf16"

    def step():
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp):
            loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()  # waits for the device

    first = step()
    step()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    last = first
    for _ in range(args.steps):
        t0 = time.perf_counter()
        last = step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = batch * seq
    flops = 6 * flops_params * tokens + 12 * n_layer * n_embd * seq * tokens
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        mode = (
            f"{'compile' if args.compile else 'eager'} {args.precision}, fused AdamW, "
            f"on {torch.cuda.get_device_name()}"
        )
        extra = f" mfu={flops / med / H100_BF16_DENSE_FLOPS:.4f}"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        mode = f"{'compile' if args.compile else 'eager'} {args.precision} cpu, {torch.get_num_threads()} threads"
        extra = ""
    print(
        f"pytorch {torch.__version__} bench {args.model} ({mode}), batch {batch}; "
        f"loss {first:.4f} -> {last:.4f}; step times (s): min {min(times):.4f} "
        f"median {med:.4f} max {max(times):.4f}"
    )
    print(
        f"params={params} step_median_s={med:.6f} tokens_per_s={tokens / med:.1f} "
        f"gflops={flops / med / 1e9:.2f} peak_bytes={peak}{extra}"
    )


if __name__ == "__main__":
    main()
