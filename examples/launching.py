"""How the examples start: as one rank when a launcher started them, else by spawning local ranks."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import shardkit


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """The two options every sharded example takes: --backend and --nproc."""
    parser.add_argument("--backend", default=None,
                        help="shardkit backend: cpu, cuda, xpu, xla (default: best available)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn when no launcher started us (default: one per "
                             "device, 2 on cpu)")


def run(fn: Callable[[int, Any], None], args: argparse.Namespace) -> None:
    """Call fn(rank, args) with shardkit initialised on every rank of the job."""
    if shardkit.detect_launch_env().launcher != "none":
        # torchrun (shardkit launch), mpirun or SLURM started this process as one rank.
        ctx = shardkit.init(args.backend)
        try:
            fn(ctx.rank, args)
        finally:
            shardkit.shutdown()
        return
    backend = shardkit.get_backend(args.backend)
    limit = backend.max_local_ranks()  # None: ranks share the host, so 2 show the sharding
    nproc = args.nproc or (2 if limit is None else max(limit, 1))
    shardkit.spawn(fn, nproc, args, backend=backend.name)
