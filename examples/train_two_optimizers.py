"""Train a small language model with two optimizers stepped one after the other.

SGD with Nesterov momentum for the blocks' weight matrices and AdamW for the rest
(embedding, head, norms, biases), as modded-nanogpt-style scripts split Muon and Adam.
Random tokens, no download::

    python examples/train_two_optimizers.py --steps 14
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_two_optimizers.py

umrt sees a training step per optimizer step: two iterations of two shapes per loop step,
the second reading the gradients the first one's backward wrote.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BATCH, TOKENS = 512, 16, 64


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Net(args.width, args.blocks).to(device)
    matrices = [p for p in model.blocks.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    optimizers = (torch.optim.SGD(matrices, lr=0.02, momentum=0.95, nesterov=True),
                  torch.optim.AdamW(rest, lr=1e-3))
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, TOKENS), device=device)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
