"""Train a small CNN classifier the way a PyTorch Lightning project is written.

A ``LightningModule``-shaped class (``training_step``, ``validation_step``,
``configure_optimizers`` returning an optimizer and a warm-up-then-cosine
scheduler stepped every step) and a small ``Trainer`` that runs it as
Lightning's fit loop does: shuffled batches from a ``DataLoader`` (``--num-workers``
worker processes; the dataset does not divide into batches: every epoch ends on a short one), a
validation every ``--val-check-interval`` steps and at each epoch's end
(``model.eval()``, ``torch.no_grad()``), a ``ModelCheckpoint``-like save of
the best weights and optimizer state, ``EarlyStopping`` on the validation
loss, and gradient clipping. Random images, no download::

    python examples/train_lightning_style.py --max-epochs 2
    umrt run --simulate h100-pcie5-80g --gpu-memory 50% examples/train_lightning_style.py

Lightning itself is not needed: the classes below follow its interfaces.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class LitClassifier(nn.Module):
    """A ``LightningModule``-shaped model: the network and its steps."""

    def __init__(self, width: int, num_classes: int, lr: float, warmup_steps: int, max_steps: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(4 * width, num_classes),
        )
        self.lr, self.warmup_steps, self.max_steps = lr, warmup_steps, max_steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return {"val_loss": F.cross_entropy(logits, y), "val_acc": (logits.argmax(-1) == y).float().mean()}

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)

        def warmup_cosine(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Trainer:
    """The parts of Lightning's ``Trainer.fit`` this example uses."""

    def __init__(self, max_epochs: int, val_check_interval: int, patience: int, gradient_clip_val: float,
                 checkpoint_dir: str, device: str) -> None:
        self.max_epochs, self.val_check_interval, self.patience = max_epochs, val_check_interval, patience
        self.gradient_clip_val, self.checkpoint_dir, self.device = gradient_clip_val, checkpoint_dir, device
        self.global_step, self.best, self.wait, self.should_stop = 0, math.inf, 0, False

    def fit(self, model: LitClassifier, train_loader: DataLoader, val_loader: DataLoader) -> None:
        model.to(self.device)
        conf = model.configure_optimizers()
        optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        for epoch in range(self.max_epochs):
            model.train()
            for batch_idx, batch in enumerate(train_loader):
                batch = [t.to(self.device) for t in batch]
                loss = model.training_step(batch, batch_idx)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.gradient_clip_val)
                optimizer.step()
                scheduler.step()
                self.global_step += 1
                if self.global_step % self.val_check_interval == 0:
                    self._validate(model, optimizer, val_loader, epoch)
            self._validate(model, optimizer, val_loader, epoch)
            if self.should_stop:
                print(f"early stopping at epoch {epoch}, step {self.global_step}")
                break

    def _validate(self, model: LitClassifier, optimizer, val_loader: DataLoader, epoch: int) -> None:
        # As Lightning's evaluation loop: the model in eval mode and gradients off for the
        # batches, the epoch-end metrics and the callbacks; train mode again at the end.
        model.eval()
        outs = []
        with torch.no_grad():
            for batch_idx, batch in enumerate(val_loader):
                batch = [t.to(self.device) for t in batch]
                outs.append(model.validation_step(batch, batch_idx))
            val_loss = torch.stack([o["val_loss"] for o in outs]).mean().item()  # on_validation_epoch_end
            val_acc = torch.stack([o["val_acc"] for o in outs]).mean().item()
        print(f"epoch {epoch} step {self.global_step}: val_loss {val_loss:.4f}, val_acc {val_acc:.3f}")
        if val_loss < self.best:  # ModelCheckpoint(monitor="val_loss") and EarlyStopping(monitor="val_loss")
            self.best, self.wait = val_loss, 0
            torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "global_step": self.global_step}, os.path.join(self.checkpoint_dir, "best.ckpt"))
        else:
            self.wait += 1
            self.should_stop = self.wait >= self.patience
        del outs
        model.train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=600)
    parser.add_argument("--val-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--val-check-interval", type=int, default=5, help="validate every N steps")
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    s = args.image_size
    train = TensorDataset(torch.randn(args.train_size, 3, s, s), torch.randint(0, 10, (args.train_size,)))
    val = TensorDataset(torch.randn(args.val_size, 3, s, s), torch.randint(0, 10, (args.val_size,)))
    loading = dict(num_workers=args.num_workers, persistent_workers=args.num_workers > 0,
                   pin_memory=args.device.startswith("cuda"))
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, **loading)
    val_loader = DataLoader(val, batch_size=args.batch_size, **loading)
    max_steps = args.max_epochs * len(train_loader)
    model = LitClassifier(args.width, 10, args.lr, warmup_steps=max(1, max_steps // 10), max_steps=max_steps)
    trainer = Trainer(args.max_epochs, args.val_check_interval, args.patience, gradient_clip_val=1.0,
                      checkpoint_dir=tempfile.mkdtemp(prefix="lightning-style-"), device=args.device)
    trainer.fit(model, train_loader, val_loader)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
