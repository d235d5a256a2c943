"""A rank of a hand-launched job (RANK/WORLD_SIZE/MASTER_* set per process, as mpirun-style
scripts do), run as a script by test_two_jobs.py.

Trains a small sharded model until the file TEST_STOP exists (or for TEST_STEPS steps), writing
TEST_READY once shardkit.init() returned. TEST_SLEEP_BEFORE_STEP=<step> makes rank 1 write
TEST_MARK and sleep before that step (the test stops it with SIGSTOP there). Written like
examples/launching.py: `try: ... finally: shardkit.shutdown()`.
"""

import os
import time

import torch

import shardkit

stop_file = os.environ.get("TEST_STOP", "")
steps = int(os.environ.get("TEST_STEPS", "100000"))
sleep_at = int(os.environ.get("TEST_SLEEP_BEFORE_STEP", "-1"))
try:
    ctx = shardkit.init(backend="cpu")
    with open(os.environ["TEST_READY"] + f".{ctx.rank}", "w") as f:
        f.write("ready")
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(ctx.rank)
    trained = 0
    for step in range(steps):
        if stop_file and os.path.exists(stop_file):
            break
        if ctx.rank == 1 and step == sleep_at:
            with open(os.environ["TEST_MARK"], "w") as f:
                f.write(repr(time.time()))
            time.sleep(600)
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        trained += 1
        time.sleep(0.05)
    print(f"rank {ctx.rank} trained {trained} steps", flush=True)
finally:
    shardkit.shutdown()
