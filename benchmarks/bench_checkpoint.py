"""Training stall per checkpoint: shardkit.checkpoint.save synchronous vs background=True, same ranks.

    python benchmarks/bench_checkpoint.py --model gpt2-small --nproc 2 --batch 2 --seq 64 --saves 2
    python benchmarks/bench_checkpoint.py --backend cuda --nproc 1   # pinned staging on a GPU

Per rank, FULL_SHARD per block, AdamW. Three phases in the same processes, each `--saves` rounds
of `--interval` steps with a save after the first: no save (the baseline), sync saves, background
saves (each round ends by waiting for its save, as the next save would). Reported:
the call's wall time (what the step waits for), the round's time above the baseline round (the
stall the job feels, including any contention from the writer thread), the write time of the
background save (until wait() returns) and the host memory its copies hold. The slowest rank
counts, as it holds the others up at the next collective.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import build, loss_of, make_batches

import shardkit
import shardkit.checkpoint as ck
from shardkit.wrap import transformer_layers


def bench_rank(rank: int, name: str, batch: int, seq: int, saves: int, interval: int,
               root: str) -> dict:
    """Times of rounds without a save, with sync saves and with background saves on this rank."""
    ctx = shardkit.current_context()
    torch.manual_seed(0)
    model, units = build(name)
    model = shardkit.shard(model, auto_wrap_policy=transformer_layers(set(units)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = make_batches(name, model, batch, seq, rank, ctx.device)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()

    def now() -> float:
        # Device work is queued: the clock counts only once the device has caught up.
        ctx.backend.synchronize(ctx.device)
        return time.perf_counter()

    step(0)  # warm-up: allocates the optimizer state, so every save holds all of it
    out: dict[str, list[float]] = {"round_none": [], "round_sync": [], "round_background": [],
                                   "call_sync": [], "call_background": [], "write_background": []}
    host_bytes = 0
    for mode in ("none", "sync", "background"):
        for i in range(saves):
            ctx.backend.barrier(ctx.world)
            began = now()
            step(0)
            call = now()
            handle = None
            if mode == "sync":
                ck.save(os.path.join(root, "sync"), model, opt, step=i)
            elif mode == "background":
                handle = ck.save(os.path.join(root, "bg"), model, opt, step=i, background=True)
                host_bytes = handle.host_bytes
            returned = now()
            for k in range(1, interval):
                step(k)
            if handle is not None:
                # The next save would wait here too; a write longer than the round shows as stall.
                handle.wait()
                out["write_background"].append(now() - call)
            ctx.backend.barrier(ctx.world)
            out[f"round_{mode}"].append(now() - began)
            if mode != "none":
                out[f"call_{mode}"].append(returned - call)
    return {"times": out, "host_bytes": host_bytes}


def main() -> None:
    """Run the three phases at --nproc ranks and print one table (and --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--interval", type=int, default=4, help="steps per round (a save after the first)")
    ap.add_argument("--backend", default="cpu", help="cpu (gloo, one thread per rank) or cuda (a GPU per rank)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="shardkit-bench-ckpt-")
    try:
        ranks = shardkit.spawn(bench_rank, args.nproc, args.model, args.batch, args.seq,
                               args.saves, args.interval, root, threads_per_rank=1, backend=args.backend)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Per round, the slowest rank; then the median round.
    med = {key: statistics.median(max(r["times"][key][i] for r in ranks)
                                  for i in range(len(ranks[0]["times"][key])))
           for key in ranks[0]["times"]}
    base = med["round_none"]
    rows = {"sync": {"call_s": med["call_sync"], "stall_s": med["round_sync"] - base},
            "background": {"call_s": med["call_background"],
                           "stall_s": med["round_background"] - base,
                           "write_s": med["write_background"]}}
    host = [r["host_bytes"] for r in ranks]
    print(f"model {args.model}, {args.nproc} ranks on {args.backend}, batch {args.batch} x {args.seq}, torch "
          f"{torch.__version__}, shardkit {shardkit.__version__}; round = {args.interval} steps, a save after the first")
    print(f"baseline round (no save): {base:.2f} s")
    print(f"{'save':<12}{'call s':>9}{'stall s':>9}{'write s':>9}")
    for mode, row in rows.items():
        write = f"{row['write_s']:9.2f}" if "write_s" in row else f"{'-':>9}"
        print(f"{mode:<12}{row['call_s']:9.2f}{row['stall_s']:9.2f}{write}")
    ratio = rows["background"]["stall_s"] / rows["sync"]["stall_s"]
    print(f"background stall / sync stall: {ratio:.3f}; call: "
          f"{rows['background']['call_s'] / rows['sync']['call_s']:.3f}")
    print(f"host memory held by a background save's copies: "
          f"{', '.join(f'rank {i} {b / 2**20:.1f} MiB' for i, b in enumerate(host))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "baseline_round_s": base, "rows": rows,
                       "host_bytes": host, "stall_ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
