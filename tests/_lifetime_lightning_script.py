"""Two Trainer.fit runs, then two Fabric.setup runs, in one process per rank (Lightning's launcher
re-runs this script per rank), each dropped before the next: rank 0 writes to --out which of the
models (and their shards) outlived their run, and the process-group count after each.

    python tests/_lifetime_lightning_script.py --devices 2 --out lifetimes.json
"""

from __future__ import annotations

import argparse
import json
import weakref

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning.fabric as lf
import lightning.pytorch as pl

import shardkit  # noqa: F401 - registers strategy="shardkit", as a user's import would

from _lifetime_workers import collect
from _lightning_script import Module, build, data


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


def _refs(model: torch.nn.Module) -> list[weakref.ref]:
    return [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]


def fit_once(devices: int) -> list[weakref.ref]:
    """One Trainer.fit over a few steps with strategy='shardkit'; weak references to what it made."""
    module = Module("mlp", in_configure_model=False)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="shardkit", max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(data("mlp"), batch_size=4))
    return _refs(module) + _refs(module.net)


def fabric_once(devices: int) -> list[weakref.ref]:
    """One Fabric.setup and a few steps with strategy='shardkit'; weak references to what it made."""
    fabric = lf.Fabric(accelerator="cpu", devices=devices, strategy="shardkit")
    fabric.launch()
    model = build("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data("mlp"), batch_size=4))
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return _refs(model) + _refs(model.module) + [weakref.ref(optimizer)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    report = {}
    for name, run in (("fit", fit_once), ("fabric", fabric_once)):
        for attempt in range(2):
            refs = run(args.devices)
            collect(refs)
            report[f"{name} {attempt}"] = {"alive": sum(r() is not None for r in refs),
                                           "checked": len(refs), "groups": _groups()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
