"""`shardkit.spawn()`: run a function on N local ranks without any distributed ceremony."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from typing import TYPE_CHECKING, Any, Callable

from .errors import ShardkitError

if TYPE_CHECKING:
    from .backend import Backend


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that nothing is listening on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _rank_body(local_rank: int, fn: Callable, backend: Any, args: tuple) -> Any:
    from . import runtime

    runtime.init(backend)
    try:
        return fn(local_rank, *args)
    finally:
        runtime.shutdown()


def _rank_main(local_rank: int, fn: Callable, nprocs: int, port: int, backend: Any,
               args: tuple, threads: int | None, result_dir: str) -> None:
    os.environ.update({"RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
                       "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nprocs),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    value = _rank_body(local_rank, fn, backend, args)
    # A file, not a queue: a child blocked on a full pipe would never exit and join would hang.
    with open(os.path.join(result_dir, f"rank{local_rank}.pkl"), "wb") as f:
        pickle.dump(value, f)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | Backend | None = None,
          threads_per_rank: int | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on `nprocs` local processes with shardkit initialised; return their results in rank order."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ShardkitError(f"nprocs must be a positive integer, got {nprocs!r}")
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise ShardkitError(
            f"spawn needs a function and arguments that pickle (ranks start fresh interpreters): "
            f"{exc}. Define the function at module level, not as a lambda or nested function, "
            "and guard the call with `if __name__ == '__main__':`") from exc
    from .backend import check_local_ranks
    from .selection import get_backend

    # Refused here, before any rank starts: past it, the device library fails inside the ranks.
    check_local_ranks(get_backend(backend), nprocs)
    if backend is not None:
        # A backend whose ranks are not processes (XLA device threads) starts them itself.
        results = get_backend(backend).spawn_ranks(_rank_body, nprocs, (fn, backend, args))
        if results is not None:
            return results
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="shardkit-spawn-") as result_dir:
        mp.start_processes(_rank_main, nprocs=nprocs, join=True, start_method="spawn",
                           args=(fn, nprocs, free_port(), backend, args, threads_per_rank,
                                 result_dir))
        out = []
        for rank in range(nprocs):
            with open(os.path.join(result_dir, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
