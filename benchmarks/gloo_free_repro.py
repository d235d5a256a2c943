"""A tensor whose last reference gloo's worker thread drops is never subtracted from torch's
profiler memory total (torch only, no shardkit): the reproducer behind issue 55's "lingering"
reduction tensors and the planner test that failed in CI.

    python benchmarks/gloo_free_repro.py            # torch's profiler as users run it
    python benchmarks/gloo_free_repro.py --counted  # with shardkit's host_memory_profiler

Two gloo ranks. Rank 0 starts an async all-reduce of a 16 MB tensor, lets go of the tensor and the
work before the collective ends (rank 1 joins 0.5 s late), so gloo's worker holds the last
reference and frees it (rank 0 waits until a weak reference says so); then rank 0 allocates 1 KB. Printed: the profiler's "Total Allocated"
at that last allocation, less what was held before. Memory really held: 1,000 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile


def _rank(rank: int, port: int, counted: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if counted:
        from shardkit.planner.measure import host_memory_profiler

        profiler = host_memory_profiler()
    else:
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with profiler as prof:
        tensor = torch.ones(4_000_000)  # 16 MB
        if rank == 1:
            time.sleep(0.5)  # rank 0's worker now waits inside the collective
        work = dist.all_reduce(tensor, async_op=True)
        if rank == 0:
            alive = weakref.ref(tensor)
            del tensor, work  # only gloo's work references the tensor now
            deadline = time.monotonic() + 60
            while alive() is not None:  # the collective ends; the worker drops work and tensor
                assert time.monotonic() < deadline, "gloo's worker never let go of the tensor"
                time.sleep(0.01)
        else:
            work.wait()
        small = torch.empty(1_000, dtype=torch.uint8)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        with open(path) as f:
            memory = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
        os.remove(path)
        base = memory[0]["Total Allocated"] - memory[0]["Bytes"]
        with open(out, "w") as f:
            json.dump({"events": len(memory), "last_total": memory[-1]["Total Allocated"] - base,
                       "small": small.numel()}, f)


def main() -> None:
    """Run the two ranks and print what the profiler counted at the end."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counted", action="store_true",
                        help="measure with shardkit.planner.measure.host_memory_profiler")
    args = parser.parse_args()
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.counted, out), nprocs=2)
    with open(out) as f:
        got = json.load(f)
    os.remove(out)
    how = "host_memory_profiler" if args.counted else "profile(profile_memory=True)"
    print(f"torch {torch.__version__}, {how}: total at the last allocation "
          f"{got['last_total']:,} bytes (held: 1,000)")


if __name__ == "__main__":
    main()
