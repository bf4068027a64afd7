"""Train a GAN the way DCGAN-style loops do: two models, two optimizers, steps that take turns.

Each iteration of the loop is two optimizer steps: the discriminator's (on a real batch and
on the generator's output, detached), then the generator's (through the discriminator).
Adam with the GAN betas, BCE-with-logits loss, random data, no download::

    python examples/train_gan.py --steps 12
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_gan.py

umrt sees a training step per optimizer step, of two shapes in strict turns. Its pool
plans neither alone (each would miss every other step: umrt/memory/POOL.md); it keeps
what the steps free, as a caching allocator does, and the runtime learns both shapes.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

LATENT, DATA, BATCH = 64, 256, 128


def mlp(sizes: list[int], act: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="loop iterations (each: a D step and a G step)")
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    gen = mlp([LATENT, args.width, args.width, DATA], nn.ReLU).to(device)
    disc = mlp([DATA, args.width, args.width, 1], nn.LeakyReLU).to(device)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    real_label = torch.ones(BATCH, 1, device=device)
    fake_label = torch.zeros(BATCH, 1, device=device)
    for step in range(args.steps):
        real = torch.randn(BATCH, DATA, device=device)
        fake = gen(torch.randn(BATCH, LATENT, device=device))
        loss_d = bce(disc(real), real_label) + bce(disc(fake.detach()), fake_label)
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = bce(disc(fake), real_label)
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        print(f"step {step}: loss_d {loss_d.item():.4f} loss_g {loss_g.item():.4f}")


if __name__ == "__main__":
    main()
