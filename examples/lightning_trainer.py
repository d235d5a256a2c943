"""Train a digits classifier with PyTorch Lightning's Trainer on shardkit (`strategy="shardkit"`).

    pip install -e '.[examples,lightning]'
    python examples/lightning_trainer.py --devices 2                     # 2 CPU ranks, Lightning launches them
    python examples/lightning_trainer.py --devices 2 --precision bf16-mixed --accumulate 2 --clip 1.0
    python examples/lightning_trainer.py --devices 3 --epochs 1 --resume lightning-ckpt/last.ckpt  # one more epoch

The LightningModule is ordinary Lightning: nothing in it knows about shardkit. The strategy is
chosen by name, or as `ShardkitStrategy(...)` with any shardkit.shard() option; the layers are
built in `configure_model`, on the meta device, and materialised straight into shards.
Checkpoints (`ModelCheckpoint`) are shardkit's sharded directories: `--resume PATH` continues one,
at any number of devices, for `--epochs` more epochs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import shardkit  # noqa: F401 - makes strategy="shardkit" known to Lightning
from shardkit.demo.data import load_digits_28
from shardkit.checkpoint import read_extra
from shardkit.lightning import ShardkitStrategy
from shardkit.wrap import transformer_layers


class Block(torch.nn.Module):
    """A residual MLP block: one shardkit unit each."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = (torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width),
                                         torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class DigitsClassifier(pl.LightningModule):
    """28x28 digits -> 10 classes; the layers are made in configure_model (meta device under shardkit)."""

    def __init__(self, width: int = 128, depth: int = 3, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        width = self.hparams.width
        self.embed = torch.nn.Linear(28 * 28, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(self.hparams.depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.embed(images.flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Fit, validate and return the final metrics (rank 0's view)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs to train (with --resume: epochs to train beyond the checkpoint's)")
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed or bf16-true")
    p.add_argument("--sharding", default="FULL_SHARD",
                   help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val (global norm)")
    p.add_argument("--checkpoint-dir", default="lightning-ckpt")
    p.add_argument("--resume", default=None, help="a checkpoint directory ModelCheckpoint wrote")
    args = p.parse_args(argv)
    # Lightning's max_epochs counts from epoch 0, so a resumed run whose checkpoint already
    # reached it would train nothing; --epochs counts the epochs this run adds instead.
    done = read_extra(args.resume)["epoch"] + 1 if args.resume else 0

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, test = load_digits_28()
    strategy = ShardkitStrategy(strategy=args.sharding,
                                auto_wrap_policy=transformer_layers({Block}))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision,
        max_epochs=done + args.epochs, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip, logger=False, enable_progress_bar=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True)])
    model = DigitsClassifier()
    trainer.fit(model, DataLoader(TensorDataset(train.images, train.labels), batch_size=32,
                                  shuffle=True),
                DataLoader(TensorDataset(test.images, test.labels), batch_size=64),
                ckpt_path=args.resume)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_rank == 0:
        if args.resume:
            print(f"resumed after epoch {done - 1}; trained epochs {done} to {done + args.epochs - 1}")
        print("final: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    return metrics


if __name__ == "__main__":
    main()
