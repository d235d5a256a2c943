"""One Lightning Fabric run, launched the way Fabric launches (this script runs once per rank), by
tests/test_lightning.py. Rank 0 writes per-step losses and the final weights' sums to --out.

    python tests/_fabric_script.py --strategy shardkit --devices 2 --out run.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning.fabric as lf

import shardkit  # noqa: F401 - registers strategy="shardkit", as a user's import would

from _lightning_script import build, data  # beside this script: the Trainer runs' models and data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="shardkit")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--model", default="mlp")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=8, help="micro-batches")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--meta", action="store_true", help="fabric.init_module(empty_init=True)")
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    fabric = lf.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy,
                       precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    with fabric.init_module(empty_init=args.meta):
        model = build(args.model)
    built_on = next(model.parameters()).device.type
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer made first, as Fabric allows
    loader = fabric.setup_dataloaders(DataLoader(data(args.model), batch_size=4))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.ckpt, state)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step < state["step"]:
            continue  # the batches the checkpointed run had trained on
        if step == args.steps:
            break
        accumulating = (step + 1) % args.accumulate != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            logits = model(x)
            logits = logits.logits if hasattr(logits, "logits") else logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            fabric.backward(loss / args.accumulate)
        if not accumulating:
            if args.clip:
                fabric.clip_gradients(model, optimizer, max_norm=args.clip)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if args.save_at == step + 1:
            state["step"] = step + 1
            fabric.save(args.ckpt, state)
    if args.strategy == "shardkit":
        from shardkit.checkpoint import full_state_dict

        weights = full_state_dict(model.module)
    else:
        weights = model.module.state_dict()
    if fabric.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "val": [], "built_on": built_on,
                       "weights": {k: v.double().sum().item() for k, v in weights.items()}}, f)


if __name__ == "__main__":
    main()
