"""FULL_SHARD vs HYBRID_SHARD vs DDP (and quantized modes) across two capped simulated nodes (root).

    python benchmarks/bench_multinode.py --model gpt2-small --rate 1gbit --nproc 2 --steps 3

Two network namespaces (tests/simcluster.py) joined by veth links capped with `tbf` at --rate;
the ranks of one node talk over its loopback at full speed. Each mode is one job started with
`shardkit launch --nnodes 2 --node-rank i --rdzv-endpoint NODE0:PORT` in each node, the same model,
data and seed. Reported per mode, same run: seconds per step (median of the slowest rank), bytes
that crossed the node boundary per step as comm_stats counts them (ring model; shardkit modes)
and as the kernel counted them on the nodes' links during the timed steps (gloo's real traffic,
everything included), and the planner's prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = {"full": "shardkit-full", "hybrid": "shardkit-hybrid", "ddp": "ddp",
         "full-q": "shardkit-full", "hybrid-q": "shardkit-hybrid"}
# Modes ending in -q send weights and gradients as int8 blocks (shardkit.Quantization).
QUANTIZED = {"full-q", "hybrid-q"}


def _link_tx() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def worker(args: argparse.Namespace) -> None:
    """One rank: train --steps timed steps after one warm-up; rank 0 writes the figures."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from bench_step import build, loss_of, make_batches, wrap

    import shardkit

    ctx = shardkit.init()
    torch.manual_seed(0)
    model, units = build(args.model)
    batches = make_batches(args.model, model, args.batch, args.seq, ctx.rank, ctx.device)
    quantize = (shardkit.Quantization(weights=True, gradients=True) if args.mode in QUANTIZED
                else None)
    model = wrap(model, MODES[args.mode], ctx, units, torch.float32, quantize=quantize)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    stats = shardkit.comm_stats(model, reset=True) if args.mode != "ddp" else None
    times = []
    dist.barrier()
    tx0 = _link_tx() if ctx.env.local_rank == 0 else 0
    for i in range(args.steps):
        dist.barrier()
        began = time.perf_counter()
        step(i + 1)
        dist.barrier()
        times.append(time.perf_counter() - began)
    tx = (_link_tx() - tx0) if ctx.env.local_rank == 0 else 0
    if args.mode != "ddp":
        stats = shardkit.comm_stats(model)
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"times": times, "link_tx": tx, "stats": stats})
    if ctx.rank == 0:
        with open(args.out, "w") as f:
            json.dump(everyone, f)
    shardkit.shutdown()


def run_mode(cluster, args: argparse.Namespace, mode: str, out: str, port: int) -> list[dict]:
    """One job of `mode` over both nodes; every rank's figures."""
    procs = []
    for node in range(2):
        argv = [sys.executable, "-m", "shardkit.cli.main", "launch", "--nnodes", "2", "--nproc",
                str(args.nproc), "--node-rank", str(node), "--rdzv-endpoint",
                f"{cluster.address(0)}:{port}", os.path.abspath(__file__), "--worker", "--mode",
                mode, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
                "--steps", str(args.steps), "--out", out]
        procs.append(cluster.start(node, argv, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode} failed:\n" + "\n".join(logs))
    with open(out) as f:
        return json.load(f)


def planned(args: argparse.Namespace, mode: str) -> int | None:
    """The planner's bytes sent across nodes per step, all ranks together (shardkit modes)."""
    if mode == "ddp":
        return None
    sys.path.insert(0, HERE)
    from bench_step import build

    import shardkit
    from shardkit.wrap import transformer_layers

    model, units = build(args.model)
    # backend="cpu": its direct collectives decide the buckets, and a quantized bucket's bytes
    # depend on them (each is padded to whole blocks).
    plan = shardkit.plan(model, world_size=2 * args.nproc, nodes=2, optimizer="adamw",
                         backend="cpu",
                         strategy="FULL_SHARD" if mode.startswith("full") else "HYBRID_SHARD",
                         auto_wrap_policy=transformer_layers(set(units)),
                         quantize=shardkit.Quantization(weights=True, gradients=True)
                         if mode in QUANTIZED else None)
    return sum(r["total"] for r in plan.comm["inter_node_by_rank"])


def main() -> None:
    """Build the cluster, run every mode, print one table (and --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=sorted(MODES), default="full")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="full,hybrid,ddp",
                    help="comma-separated: full, hybrid, ddp, full-q, hybrid-q (quantized)")
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per node")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="cap of each node's link (tc syntax); none: uncapped")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from simcluster import SimCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench_multinode: {reason}")
    import torch

    import shardkit

    rows = {}
    with SimCluster(2, rate=None if args.rate == "none" else args.rate) as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(args.modes.split(",")):
            ranks = run_mode(cluster, args, mode, os.path.join(tmp, f"{mode}.json"), 29500 + i)
            per_step = [max(r["times"][k] for r in ranks) for k in range(args.steps)]
            counted = (sum(r["stats"]["inter_node"]["total"] for r in ranks) // args.steps
                       if ranks[0]["stats"] else None)
            rows[mode] = {"sec_per_step": statistics.median(per_step),
                          "link_bytes_per_step": sum(r["link_tx"] for r in ranks) // args.steps,
                          "counted_inter_node_per_step": counted,
                          "planned_inter_node_per_step": planned(args, mode)}
            print(f"{mode}: {rows[mode]}", flush=True)
    print(f"model {args.model}, 2 nodes x {args.nproc} ranks, batch {args.batch} x {args.seq} per "
          f"rank, link {args.rate}; torch {torch.__version__}, shardkit {shardkit.__version__}")
    print(f"{'mode':<8}{'s/step':>9}{'vs full':>9}{'link MB/step':>14}{'counted MB':>12}"
          f"{'planned MB':>12}")
    full = rows.get("full", {}).get("sec_per_step")
    for mode, r in rows.items():
        mb = lambda v: f"{v / 2**20:12.1f}" if v is not None else f"{'-':>12}"  # noqa: E731
        ratio = f"{r['sec_per_step'] / full:9.3f}" if full else f"{'-':>9}"
        print(f"{mode:<8}{r['sec_per_step']:9.2f}{ratio}{r['link_bytes_per_step'] / 2**20:14.1f}"
              f"{mb(r['counted_inter_node_per_step'])}{mb(r['planned_inter_node_per_step'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
