"""One rank of a 2-rank job (started mpirun-style by test_checkpoint_background_faults.py): a
background save is in flight when the victim rank SIGKILLs itself; the survivor trains on.

argv: checkpoint root, victim rank, "finally" or "plain" (the loop inside try/finally: shutdown()).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import shardkit


def main() -> None:
    root, victim, style = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ctx = shardkit.init(timeout=10)
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]))
    opt = torch.optim.AdamW(model.parameters())

    def train() -> None:
        for step in range(1000):
            model(torch.ones(8, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                shardkit.checkpoint.save(os.path.join(root, "ckpt"), model, opt,
                                         extra={"step": 1})
            if step == 3:
                shardkit.checkpoint.save(os.path.join(root, "ckpt"), model, opt,
                                         extra={"step": 3}, background=True)
                if ctx.rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)  # the writer thread is mid-write
                with open(os.path.join(root, f"survivor{ctx.rank}"), "w") as f:
                    f.write(str(time.time()))
            time.sleep(0.01)

    if style == "finally":
        try:
            train()
        finally:
            shardkit.shutdown()
    else:
        train()


if __name__ == "__main__":
    main()
