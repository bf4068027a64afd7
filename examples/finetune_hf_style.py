"""Fine-tune a small causal LM with the loop the Hugging Face course teaches.

A hand-written loop in the shape of transformers' Trainer and its docs:
``GPT2LMHeadModel`` from a small config (random init, no download), a
character-level dataset built in, a length-grouped sampler so that each batch
holds sequences of one length bucket (no padding: the lengths vary from batch
to batch, as a padding-free collator makes them), gradient accumulation over
``--accum`` micro-batches, AdamW with ``get_linear_schedule_with_warmup``,
gradient clipping, an evaluation at the end of every epoch
(``model.eval()``, ``torch.no_grad()``) with early stopping on the
validation loss, and ``save_pretrained`` of the best model. The dataset does
not divide into batches: every epoch ends on a short one::

    python examples/finetune_hf_style.py --epochs 3
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/finetune_hf_style.py
"""
from __future__ import annotations

import argparse
import math
import random
import tempfile

import torch

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. "
)


def make_dataset(n: int, buckets: list[int], seed: int) -> list[torch.Tensor]:
    """``n`` character sequences, each as long as one of ``buckets`` (byte values as token ids)."""
    rng = random.Random(seed)
    data = TEXT.encode() * 16
    out = []
    for _ in range(n):
        length = rng.choice(buckets)
        start = rng.randrange(len(data) - length)
        out.append(torch.tensor(list(data[start:start + length]), dtype=torch.long))
    return out


def length_grouped_batches(dataset: list[torch.Tensor], batch_size: int, seed: int) -> list[list[int]]:
    """Indices in batches of one length each (shuffled within and across lengths); the
    last batch of each length may be short."""
    rng = random.Random(seed)
    by_len: dict[int, list[int]] = {}
    for i, x in enumerate(dataset):
        by_len.setdefault(len(x), []).append(i)
    batches = []
    for idx in by_len.values():
        rng.shuffle(idx)
        batches += [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(examples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack sequences of one length: no padding, labels are the inputs."""
    input_ids = torch.stack(examples)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=90, help="training sequences (default 90)")
    parser.add_argument("--eval-size", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="per micro-batch")
    parser.add_argument("--accum", type=int, default=4, help="gradient accumulation steps")
    parser.add_argument("--buckets", default="64,128", help="sequence lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    parser.add_argument("--patience", type=int, default=1, help="epochs without improvement before stopping")
    parser.add_argument("--min-delta", type=float, default=0.0, help="the least decrease that counts as improvement")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    buckets = [int(b) for b in args.buckets.split(",")]
    train_set = make_dataset(args.train_size, buckets, args.seed)
    eval_set = make_dataset(args.eval_size, buckets, args.seed + 1)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                        n_positions=max(buckets), vocab_size=256, use_cache=False)
    model = GPT2LMHeadModel(config).to(device)

    no_decay = ("bias", "ln_")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, foreach=True)
    steps_per_epoch = math.ceil(len(length_grouped_batches(train_set, args.batch_size, 0)) / args.accum)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf-style-")

    def evaluate() -> float:
        model.eval()
        losses = []
        for batch_idx in length_grouped_batches(eval_set, args.batch_size, 0):
            batch = {k: v.to(device) for k, v in collate([eval_set[i] for i in batch_idx]).items()}
            with torch.no_grad():
                outputs = model(**batch)
            losses.append(outputs.loss.item())
        model.train()
        return sum(losses) / len(losses)

    best, bad_epochs, global_step = float("inf"), 0, 0
    model.train()
    for epoch in range(args.epochs):
        batches = length_grouped_batches(train_set, args.batch_size, args.seed + epoch)
        for step, batch_idx in enumerate(batches):
            batch = {k: v.to(device) for k, v in collate([train_set[i] for i in batch_idx]).items()}
            outputs = model(**batch)
            loss = outputs.loss / args.accum
            loss.backward()
            if (step + 1) % args.accum == 0 or step + 1 == len(batches):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                if global_step % 5 == 0:
                    print(f"step {global_step}: loss {loss.item() * args.accum:.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
        eval_loss = evaluate()
        print(f"epoch {epoch}: eval loss {eval_loss:.4f}")
        if eval_loss < best - args.min_delta:
            best, bad_epochs = eval_loss, 0
            model.save_pretrained(output_dir)
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                print(f"early stopping after epoch {epoch}")
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
