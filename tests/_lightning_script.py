"""One Lightning Trainer run, launched the way Lightning launches (this script runs once per rank),
by tests/test_lightning.py. Rank 0 writes what it saw as JSON to --out: per-step training losses,
validation losses, predictions, and whether the weights it ended with are sharded.

    python tests/_lightning_script.py --strategy shardkit --devices 2 --out run.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import shardkit  # noqa: F401 - registers strategy="shardkit", as a user's import would

VOCAB, SEQ = 64, 16


def build(kind: str) -> torch.nn.Module:
    """The network: an MLP classifier, the seed tutorial's MNIST CNN, or a GPT-2-shaped
    transformers language model."""
    if kind == "cnn":
        from shardkit.demo.models import build_model

        return build_model("shallow")
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                   torch.nn.ReLU(), torch.nn.Linear(32, 4))
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class Module(pl.LightningModule):
    """The same LightningModule for every strategy: built in __init__, or in configure_model."""

    def __init__(self, kind: str, in_configure_model: bool) -> None:
        super().__init__()
        self.kind, self.in_configure_model = kind, in_configure_model
        if not in_configure_model:
            self.net = build(kind)

    def configure_model(self) -> None:
        if self.in_configure_model and not hasattr(self, "net"):
            self.net = build(self.kind)
            self.built_on = next(self.net.parameters()).device.type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out.logits if hasattr(out, "logits") else out

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def data(kind: str) -> TensorDataset:
    """A fixed dataset, the same in every process."""
    gen = torch.Generator().manual_seed(1234)
    if kind == "mlp":
        x = torch.randn(96, 16, generator=gen)
        return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long())
    if kind == "cnn":
        return TensorDataset(torch.randn(96, 1, 28, 28, generator=gen),
                             torch.randint(0, 10, (96,), generator=gen))
    ids = torch.randint(0, VOCAB, (96, SEQ + 1), generator=gen)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class Recorder(pl.Callback):
    """Per optimizer-step loss (the last micro-batch's) and validation loss, as rank 0 sees them."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_epoch_end(self, trainer, module) -> None:
        self.val.append(float(trainer.callback_metrics["val_loss"]))


class SummaryRecorder(pl.callbacks.ModelSummary):
    """Lightning's model-summary callback, keeping the totals it prints (rank 0)."""

    totals: dict = {}

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, *args,
                  **kwargs) -> None:
        SummaryRecorder.totals.update(total=total_parameters, trainable=trainable_parameters,
                                      layers=[row for name, row in summary_data if name == "Params"])


def strategy_for(args: argparse.Namespace):
    """The --strategy name as a Trainer argument (an object where options are needed)."""
    if args.strategy == "shardkit-policy":
        from shardkit.lightning import ShardkitStrategy
        from shardkit.wrap import transformer_layers

        block = type(build(args.model).transformer.h[0]) if args.model == "gpt2" else torch.nn.Linear
        quantize = None
        if args.quantize:  # int8 gathers and reductions, passed through as a shard() option
            import shardkit

            quantize = shardkit.Quantization(weights=True, gradients=True)
        return ShardkitStrategy(strategy=args.sharding, auto_wrap_policy=transformer_layers({block}),
                                quantize=quantize)
    return args.strategy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="shardkit")
    p.add_argument("--sharding", default="FULL_SHARD")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--model", default="mlp")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--configure-model", action="store_true")
    p.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint every 4 steps into this directory")
    p.add_argument("--resume", default=None, help="ckpt_path= for fit()")
    p.add_argument("--summary", action="store_true", help="record Lightning's model summary")
    p.add_argument("--quantize", action="store_true", help="shardkit-policy with Quantization")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module = Module(args.model, args.configure_model)
    recorder = Recorder()
    callbacks: list = [recorder] + ([SummaryRecorder(max_depth=1)] if args.summary else [])
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=4,
                                                      save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy_for(args),
                         precision=args.precision, max_steps=args.steps,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
                         val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0,
                         enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=args.summary,
                         default_root_dir=os.path.dirname(os.path.abspath(args.out)))
    loader = DataLoader(data(args.model), batch_size=4)
    trainer.fit(module, loader, DataLoader(data(args.model), batch_size=4), ckpt_path=args.resume)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}  # predict() clears them
    predictions = trainer.predict(module, DataLoader(data(args.model), batch_size=8), return_predictions=True)
    weights = _full_weights(module, args.strategy)
    local_step = None  # did the user's optimizer step shardkit's DTensors' local tensors?
    if args.strategy.startswith("shardkit"):
        from shardkit.sharding.surface.local_step import last_step_was_local

        local_step = last_step_was_local(trainer.optimizers[0])
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": recorder.losses, "val": recorder.val, "world": trainer.world_size,
                       "global_step": trainer.global_step,
                       "predictions": [t.tolist() for t in predictions][:2],
                       "weights": {k: v.double().sum().item() for k, v in weights.items()},
                       "built_on": getattr(module, "built_on", None),
                       "logged": logged, "summary": SummaryRecorder.totals,
                       "local_step": local_step}, f)


def _full_weights(module: torch.nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (gathered from the shards under shardkit)."""
    if strategy.startswith("shardkit"):
        from shardkit.checkpoint import full_state_dict

        return full_state_dict(module)
    return module.state_dict()


if __name__ == "__main__":
    main()
