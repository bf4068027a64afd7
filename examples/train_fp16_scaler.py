"""Mixed-precision training with a loss scaler: fp16 autocast and ``torch.amp.GradScaler``.

A scaler that starts high overflows: the step's gradients hold inf, and ``scaler.step``
skips the optimizer's step. Large models meet this in their first steps (the default
scale, 65536, is too high for most), and again now and then after the scale has grown.
Here the scale starts at 2**20 and grows every 4 steps, so a short run skips a few::

    python examples/train_fp16_scaler.py
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_fp16_scaler.py

umrt counts a step per ``scaler.step``, the skipped ones too: a skipped step runs the
forward and backward and no optimizer update, and its iteration ends there (it is not
merged with the next step's).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--init-scale", type=float, default=2.0**20, help="the scaler's first scale")
    parser.add_argument("--growth-interval", type=int, default=4, help="steps without overflow before it doubles")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    emb = nn.Embedding(512, 256)
    blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                           for _ in range(4))
    head = nn.Linear(256, 512)
    model = nn.ModuleDict(dict(emb=emb, blocks=blocks, head=head)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=args.init_scale, growth_interval=args.growth_interval)
    skipped = 0
    for step in range(args.steps):
        x = torch.randint(0, 512, (16, 64), device=device)
        with torch.autocast(device, dtype=torch.float16):
            h = emb(x)
            for block in blocks:
                h = h + block(h)
            loss = F.cross_entropy(head(h).flatten(0, 1).float(), x.flatten())
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if scaler.get_scale() < scale:
            skipped += 1
            print(f"step {step}: loss {loss.item():.4f} (skipped: inf gradients at scale {scale:.0f})", flush=True)
        else:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    print(f"{skipped} of {args.steps} steps skipped by the scaler")


if __name__ == "__main__":
    main()
