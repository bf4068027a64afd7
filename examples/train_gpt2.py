"""Train a small GPT-2 for a few steps: umrt's example job.

A real PyTorch training loop — transformers' GPT2LMHeadModel from a small
GPT2Config (random init, no download), random token batches, AdamW with
foreach=True as on CUDA — that runs on a CPU in seconds::

    python examples/train_gpt2.py --steps 6
    umrt run --simulate h100-pcie5-80g --gpu-memory 20% examples/train_gpt2.py

The second command runs it unchanged in umrt's shadow mode: umrt then drives
a simulated GPU whose memory is 20% of the footprint the job needs (the GPU
memory its allocations take with nothing evicted) and reports what the GPU
would have done, and how much memory the job can save at what cost.
"""
from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.seq, args.layers, args.hidden) < 1:
        parser.error("--steps, --batch, --seq, --layers and --hidden must be positive")

    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # keep the output to the loss lines

    torch.manual_seed(args.seed)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=max(1, args.hidden // 64),
        n_positions=max(args.seq, 128),
        vocab_size=8192,
        use_cache=False,
    )
    device = torch.device(args.device)
    model = GPT2LMHeadModel(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"gpt2: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M parameters, "
          f"batch {args.batch} x {args.seq} tokens on {device}")

    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - t0:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
