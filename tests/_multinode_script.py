"""One rank of a multi-node job (started by `shardkit launch` inside a simulated node).

    _multinode_script.py OUT_JSON STRATEGY STEPS

Trains the shared MLP (tests/_multinode_model.py) on a fixed global batch per step, each rank
its slice; counts one step's traffic (the second: the first records the execution order) with
comm_stats; rank 0 writes losses, every rank's counters, and the final full state dict.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardkit
from shardkit.checkpoint import full_state_dict
from shardkit.wrap import transformer_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multinode_model import Block, batch_for_step, build


def main() -> None:
    """Train, measure, report (rank 0 writes OUT_JSON and OUT_JSON.pt)."""
    out, strategy, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = shardkit.init()
    # "STRATEGY+quantized": weights and gradients as int8 blocks (two hops across the nodes).
    strategy, _, quantized = strategy.partition("+")
    quantize = shardkit.Quantization(weights=True, gradients=True) if quantized else None
    model = shardkit.shard(build(), strategy=strategy, auto_wrap_policy=transformer_layers({Block}),
                           quantize=quantize)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, measured = [], None
    share = None
    for step in range(steps):
        x, y = batch_for_step(step)
        share = len(x) // ctx.world_size
        rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
        stats = shardkit.comm_stats(model, reset=True)
        if step == 1:
            measured = stats
    everywhere = full_state_dict(model, rank0_only=False)  # what each rank holds, gathered
    digest = [float(v.double().sum()) for _, v in sorted(everywhere.items())]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"rank": ctx.rank, "stats": measured, "digest": digest,
                                      "local_world_size": ctx.env.local_world_size,
                                      "launcher": ctx.env.launcher,
                                      "node": os.environ.get("SIMCLUSTER_NODE")})
    state = full_state_dict(model)
    if ctx.rank == 0:
        torch.save(state, out + ".pt")
        with open(out, "w") as f:
            json.dump({"losses": losses, "ranks": everyone, "world_size": ctx.world_size}, f)
    shardkit.shutdown()


if __name__ == "__main__":
    main()
