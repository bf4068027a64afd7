"""Fine-tune as fastai's ``fine_tune`` does: the head alone first, then the whole model.

A pretrained-style backbone (random init here, no download) is frozen while a new head
trains for ``--frozen-steps`` steps; then the backbone is unfrozen and joins the optimizer
as a parameter group with a lower learning rate, and every step from then on runs its
backward and its AdamW update too::

    python examples/finetune_unfreeze.py
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/finetune_unfreeze.py

umrt learns the frozen step, then the unfrozen one. The frozen step's plan has no decision
that could tell the two apart (the model is small), so an unfrozen step it is predicted for
is told apart by its launch count: more than the plan's is not the plan's shape.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frozen-steps", type=int, default=6, help="steps of the head alone")
    parser.add_argument("--steps", type=int, default=14, help="steps in all")
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(256, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
                             nn.Linear(args.width, 512))
    head = nn.Linear(512, 10)
    model = nn.Sequential(backbone, head).to(device)
    backbone.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    for step in range(args.steps):
        if step == args.frozen_steps:
            backbone.requires_grad_(True)
            opt.add_param_group({"params": backbone.parameters(), "lr": 1e-4})
        x = torch.randn(64, 256, device=device)
        y = torch.randint(0, 10, (64,), device=device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
