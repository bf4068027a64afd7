"""A character-level LSTM trained with truncated backpropagation through time.

Each step trains on the next chunk of a long sequence; the LSTM's hidden state is
carried from one step to the next, detached (the gradient stops at the chunk's
start), as RNN language-model scripts do::

    python examples/train_rnn_tbptt.py
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_rnn_tbptt.py

The state each step hands on is born in that step and read, then freed, in the next.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=32, help="tokens per step (the truncation length)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    vocab = 128
    emb = nn.Embedding(vocab, args.hidden)
    lstm = nn.LSTM(args.hidden, args.hidden, num_layers=2, batch_first=True)
    head = nn.Linear(args.hidden, vocab)
    model = nn.ModuleDict(dict(emb=emb, lstm=lstm, head=head)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    text = torch.randint(0, vocab, (args.batch_size, args.steps * args.chunk + 1), device=device)
    state = None
    for step in range(args.steps):
        chunk = text[:, step * args.chunk: (step + 1) * args.chunk + 1]
        out, state = lstm(emb(chunk[:, :-1]), state)
        state = tuple(s.detach() for s in state)  # carried to the next chunk, without its graph
        loss = F.cross_entropy(head(out).flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
