"""Data-parallel training through `shardkit.replicate`: the oneCCL bindings' DDP example, on any backend.

The original sets RANK/WORLD_SIZE from mpirun's PMI_* variables, calls
init_process_group(backend="ccl"), moves the model to "xpu:{rank}" and wraps it in
DDP(model, device_ids=[device]). Here `shardkit.init()` reads whichever launcher started us
(torchrun, mpirun, SLURM, or none) and `shardkit.replicate()` does the rest for the backend.

    python examples/ddp_replicate.py                                  # one process
    shardkit launch --nproc 2 examples/ddp_replicate.py --steps 20    # two ranks
    mpirun -n 2 python examples/ddp_replicate.py --backend xpu        # the oneCCL way
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import shardkit


class Model(nn.Module):
    """The example's model: one linear layer."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, input):
        """Apply the layer."""
        return self.linear(input)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (small defaults so the example runs in seconds)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="shardkit backend (default: best available)")
    parser.add_argument("--steps", type=int, default=10, help="training iterations")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="rank 0 writes weights and losses here")
    return parser.parse_args(argv)


def main(argv=None) -> list[float]:
    """Train for --steps iterations and return the world-mean loss of each step."""
    args = parse_args(argv)
    ctx = shardkit.init(args.backend)
    device = ctx.device
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = shardkit.replicate(Model())
    teacher = torch.randn(4, 5, generator=torch.Generator().manual_seed(args.seed + 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    data = torch.Generator().manual_seed(args.seed + 1000 * (ctx.rank + 1))  # each rank its own samples
    losses = []
    for i in range(args.steps):
        input = torch.randn(args.batch_size, 4, generator=data)
        labels = input @ teacher
        input, labels = input.to(device), labels.to(device)
        optimizer.zero_grad()
        L = loss_fn(model(input), labels)
        L.backward()
        optimizer.step()
        # The loss the whole job saw this step: sum over ranks, then divide.
        total = L.detach().clone()
        ctx.backend.all_reduce(total, ctx.world, op="sum").wait()
        losses.append(total.item() / ctx.world_size)
        if ctx.rank == 0:
            print(f"iteration {i}: loss {losses[-1]:.5f} on {ctx.world_size} rank(s), device {device}",
                  flush=True)
    if args.save and ctx.rank == 0:
        torch.save({"state": {k: v.cpu() for k, v in model.module.state_dict().items()},
                    "losses": losses, "world_size": ctx.world_size}, args.save)
    shardkit.shutdown()
    return losses


if __name__ == "__main__":
    main()
