"""K-fold cross-validation in one process, as Kaggle notebooks run it: a new model and
optimizer per fold, trained, validated, then dropped.

An MLP on a synthetic tabular set (no download), ``--folds`` folds of ``--steps`` AdamW
steps each, the fold's validation under ``no_grad`` after them::

    python examples/train_kfold.py
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_kfold.py

Each fold's steps launch exactly as the last fold's did, on other weights and optimizer
state. umrt learns each fold's step again: a plan whose long-lived objects are gone would
move none of the new ones.
"""
from __future__ import annotations

import argparse
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="training steps per fold")
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    rows = 512 * args.folds
    x = torch.randn(rows, 128)
    y = (x[:, :10].sum(1) > 0).long()
    w = args.width
    for fold in range(args.folds):
        val = torch.arange(fold * 512, (fold + 1) * 512)
        train = torch.cat([torch.arange(0, fold * 512), torch.arange((fold + 1) * 512, rows)])
        model = nn.Sequential(nn.Linear(128, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                              nn.Linear(w, 2)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        for _ in range(args.steps):
            idx = train[torch.randint(0, len(train), (128,))]
            loss = F.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(x[val].to(device)).argmax(1) == y[val].to(device)).float().mean().item()
        print(f"fold {fold}: last loss {loss.item():.4f}, validation accuracy {acc:.3f}", flush=True)
        del model, opt
        gc.collect()


if __name__ == "__main__":
    main()
