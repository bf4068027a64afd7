"""Train a small transformer the way many hand-written loops do: a case where umrt loses.

Four pre-norm blocks (``nn.MultiheadAttention`` and an MLP), every other one under
activation checkpointing (``use_reentrant=False``), bf16 autocast, gradient clipping,
AdamW with ``OneCycleLR``, ``zero_grad(set_to_none=False)``, and every 4 steps a
``torch.save`` of the model's and the optimizer's state into memory. Random tokens,
no download::

    python examples/train_small_checkpointed.py --steps 8
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_small_checkpointed.py

At the default width (128), every tensor is a few hundred KB or less. A call that moves
data has a fixed cost, so the driver's batched faults cost less than a plan's calls, and
umrt's guard stops acting after its first acting steps (README, "Small models lose to
plain Unified Memory while umrt finds out"). ``--width 512`` is a model where acting pays.
"""
from __future__ import annotations

import argparse
import io

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, BATCH, TOKENS = 500, 8, 64


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, width: int, blocks: int = 4, checkpointed: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, VOCAB)
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i % 2 and self.checkpointed else block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--no-checkpoint", action="store_true", help="no block under activation checkpointing")
    parser.add_argument("--no-autocast", action="store_true", help="fp32 throughout")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Net(args.width, checkpointed=not args.no_checkpoint).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=args.steps)
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, TOKENS))
        tokens = (tokens.pin_memory() if device == "cuda" else tokens).to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not args.no_autocast):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=False)
        if step % 4 == 3:  # a checkpoint, kept in memory
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, io.BytesIO())
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
