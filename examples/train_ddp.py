"""Train a small GPT-2 with DistributedDataParallel under torchrun: umrt's multi-rank example.

Every rank trains transformers' GPT2LMHeadModel (a small GPT2Config, random
init, no download) on its own random token batches; DDP averages the gradients
across ranks after each backward pass. On the CPU the ranks talk through gloo::

    torchrun --nproc_per_node 2 examples/train_ddp.py
    umrt run --simulate h100-pcie5-80g --gpu-memory 20% -- torchrun --nproc_per_node 2 examples/train_ddp.py

The second command runs it unchanged, each rank in umrt's shadow mode with a
simulated GPU of its own, and prints one report with a row per rank. On GPUs
(NCCL, one GPU per rank; ranks beyond the GPUs share them)::

    UMRT=1 torchrun --nproc_per_node 8 examples/train_ddp.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch and rank (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    parser.add_argument("--backend", default=None, help="process group backend (default: gloo on cpu, nccl on cuda)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.seq, args.layers, args.hidden) < 1:
        parser.error("--steps, --batch, --seq, --layers and --hidden must be positive")

    import torch
    import torch.distributed as dist
    import transformers
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # keep the output to the loss lines
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())  # before the first CUDA tensor
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"))
    world = dist.get_world_size()

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                        n_positions=max(args.seq, 128), vocab_size=8192, use_cache=False)
    model = GPT2LMHeadModel(config).to(device)
    model.train()
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4, foreach=True)
    data = torch.Generator().manual_seed(args.seed + 1000 + rank)  # each rank its own batches
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"ddp: {world} ranks, gpt2 {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M "
              f"parameters, batch {args.batch} x {args.seq} tokens per rank on {device.type}", flush=True)

    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=data).to(device)
        loss = ddp(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"rank {rank} step {step}: loss {loss.item()!r} ({time.perf_counter() - t0:.2f} s)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
