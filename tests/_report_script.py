"""A 2-rank training script that fails on purpose, run by test_failure_reports.py.

TEST_FAILURE: "raise" (rank 1 raises ValueError at step 3) or "out_of_step" (rank 1 skips a
backward at step 2, as a "skip the step if the loss is NaN" branch does on one rank).
TEST_FINALLY=1 wraps the loop in `try: ... finally: shardkit.shutdown()` like
examples/launching.py. TEST_VIA=spawn runs it through shardkit.spawn; otherwise the process is a
rank of a hand-made or `shardkit launch` job. Rank 1 writes TEST_MARK (time.time()) as it fails.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

import shardkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import Block, TinyNet, batch

FAILURE = os.environ["TEST_FAILURE"]


def _mark() -> None:
    with open(os.environ["TEST_MARK"], "w") as f:
        f.write(repr(time.time()))


def loop(rank: int) -> None:
    """Train until rank 1 fails the chosen way."""
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        x, y = batch(step, rank)
        if rank == 1 and step == 3 and FAILURE == "raise":
            _mark()
            raise ValueError("bad batch on rank 1")
        loss = F.cross_entropy(model(x), y)
        if rank == 1 and step == 2 and FAILURE == "out_of_step":
            _mark()
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()


def main(rank: int | None = None) -> None:
    """One rank: init, the loop, shutdown (in a finally when TEST_FINALLY=1)."""
    if os.environ.get("TEST_FINALLY") == "1":
        try:
            ctx = shardkit.init(timeout=float(os.environ["TEST_TIMEOUT"]))
            loop(ctx.rank)
        finally:
            shardkit.shutdown()
    else:
        ctx = shardkit.init(timeout=float(os.environ["TEST_TIMEOUT"]))
        loop(ctx.rank)


if __name__ == "__main__":
    if os.environ.get("TEST_VIA") == "spawn":
        shardkit.spawn(main, 2, backend="cpu", threads_per_rank=1,
                       timeout=float(os.environ["TEST_TIMEOUT"]))
    else:
        main()
