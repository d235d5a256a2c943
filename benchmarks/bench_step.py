"""Step-time / memory / traffic benchmark: shardkit against torch FSDP2, FSDP1, DDP and one process.

Every mode runs in fresh processes (one subprocess per mode, which spawns its ranks), on the same
model, per-rank batch, world size and optimizer (Adam), with random 1x28x28 inputs.

    python benchmarks/bench_step.py --model mlp --steps 30 --warmup 3
    python benchmarks/bench_step.py --model deep --steps 10 --warmup 2 --modes shardkit-full,fsdp2,ddp

Prints a markdown table (median seconds per step, ratios against FSDP2 and DDP, peak RSS per rank,
bytes sent per rank per step) and writes a PNG plot. Bytes are measured by shardkit.comm_stats for
shardkit and computed from ring-collective formulas for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

# shardkit modes: (strategy, prefetch depth); prefetch 0 means every all-gather waits in place.
SHARDKIT_MODES = {
    "shardkit-full": ("FULL_SHARD", 1), "shardkit-full-noprefetch": ("FULL_SHARD", 0),
    "shardkit-grad-op": ("SHARD_GRAD_OP", 1), "shardkit-grad-op-noprefetch": ("SHARD_GRAD_OP", 0),
    "shardkit-no-shard": ("NO_SHARD", 1), "shardkit-no-shard-noprefetch": ("NO_SHARD", 0),
    "shardkit-hybrid": ("HYBRID_SHARD", 1), "shardkit-hybrid-noprefetch": ("HYBRID_SHARD", 0),
}
TORCH_MODES = ("fsdp2", "fsdp1", "ddp", "single")
ALL_MODES = tuple(SHARDKIT_MODES) + TORCH_MODES
MB = 1024 * 1024


# ---- one rank ------------------------------------------------------------------------------------
def _leaf_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def _wrap(model: nn.Module, mode: str, ctx, prefetch_off: bool = False) -> nn.Module:
    """Apply the distributed wrapper `mode` names; every wrapper unit is one Linear/Conv layer."""
    if mode in SHARDKIT_MODES:
        import shardkit

        strategy, prefetch = SHARDKIT_MODES[mode]
        kwargs = {"hybrid_group_size": max(1, ctx.world_size // 2)} if strategy == "HYBRID_SHARD" else {}
        return shardkit.shard(model, strategy=shardkit.ShardingStrategy[strategy],
                              auto_wrap_policy=shardkit.wrap.transformer_layers({nn.Linear, nn.Conv2d}),
                              prefetch=prefetch, backend=ctx.backend, **kwargs)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in _leaf_layers(model):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear, nn.Conv2d}),
                    device_id=ctx.device, use_orig_params=True)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, **ctx.backend.ddp_kwargs(ctx.device))
    return model


def _formula_bytes(mode: str, num_params: int, world: int) -> int:
    """Ring-collective bytes one rank sends per step for the torch modes (fp32 everywhere)."""
    p = num_params * 4
    if mode in ("fsdp2", "fsdp1"):
        # all-gather in forward, again in backward (resharded after forward), one reduce-scatter.
        return 3 * (world - 1) * p // world
    if mode == "ddp":
        return 2 * (world - 1) * p // world
    return 0


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_rank(rank: int, mode: str, args_dict: dict) -> dict:
    """Build, wrap and time `steps` training steps on this rank; return its figures."""
    import shardkit
    from shardkit.demo.models import build_model, count_params

    a = argparse.Namespace(**args_dict)
    ctx = shardkit.current_context() if mode != "single" else None
    device = ctx.device if ctx is not None else torch.device("cpu")
    world = ctx.world_size if ctx is not None else 1
    torch.manual_seed(0)
    model = build_model(a.model).to(device)
    num_params = count_params(model)
    model = _wrap(model, mode, ctx)
    rss_after_wrap = _peak_rss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(a.batch, 1, 28, 28, generator=gen).to(device) for _ in range(4)]
    ys = [torch.randint(0, 10, (a.batch,), generator=gen).to(device) for _ in range(4)]
    sync = ctx.backend.synchronize if ctx is not None else (lambda device=None: None)
    step_boundary = ctx.backend.step_boundary if ctx is not None else (lambda: None)
    times, comm = [], None
    for i in range(a.warmup + a.steps):
        if i == a.warmup and mode in SHARDKIT_MODES:
            shardkit.comm_stats(model, reset=True)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs[i % 4]), ys[i % 4])
        loss.backward()
        opt.step()
        step_boundary()
        loss.item()
        sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    if mode in SHARDKIT_MODES:
        comm = shardkit.comm_stats(model)["total"] // a.steps
        source = "measured"
    else:
        comm = _formula_bytes(mode, num_params, world)
        source = "formula"
    return {"rank": rank, "times": times, "peak_rss": _peak_rss(),
            "rss_after_wrap": rss_after_wrap, "bytes_per_step": comm, "bytes_source": source,
            "num_params": num_params, "world": world}


def run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    """Run one mode in this (fresh) process: spawn its ranks, or run inline for `single`."""
    torch.set_num_threads(args.threads)
    if mode == "single":
        return [bench_rank(0, mode, vars(args))]
    import shardkit

    return shardkit.spawn(bench_rank, args.nproc, mode, vars(args), backend=args.backend,
                          threads_per_rank=args.threads)


# ---- driver ----------------------------------------------------------------------------------------
def _summarise(mode: str, ranks: list[dict]) -> dict:
    # Steps are lock-stepped by collectives; the slowest rank's time is the step time.
    per_step = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    return {"mode": mode, "sec_per_step": statistics.median(per_step),
            "peak_rss_mb": [r["peak_rss"] / MB for r in ranks],
            "bytes_per_step": max(r["bytes_per_step"] for r in ranks),
            "bytes_source": ranks[0]["bytes_source"], "num_params": ranks[0]["num_params"],
            "world": ranks[0]["world"]}


def _launch(mode: str, args: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode] + args.passthrough
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"[{mode}] FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    res = _summarise(mode, json.loads(lines[-1][len("RESULT "):]))
    print(f"[{mode}] {res['sec_per_step']:.3f} s/step, peak RSS "
          f"{max(res['peak_rss_mb']):.0f} MB/rank ({time.perf_counter() - t0:.0f} s wall)",
          file=sys.stderr, flush=True)
    return res


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def markdown_table(rows: list[dict]) -> str:
    """Render results as a markdown table with ratios against FSDP2 and DDP."""
    by_mode = {r["mode"]: r for r in rows}
    fsdp2, ddp = by_mode.get("fsdp2"), by_mode.get("ddp")
    out = ["| mode | s/step (median) | vs FSDP2 | vs DDP | peak RSS/rank (MB) | RSS vs FSDP2 "
           "| sent/rank/step (MB) | bytes |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rss = max(r["peak_rss_mb"])
        out.append(
            f"| {r['mode']} | {r['sec_per_step']:.3f} "
            f"| {_ratio(r['sec_per_step'], fsdp2 and fsdp2['sec_per_step'])} "
            f"| {_ratio(r['sec_per_step'], ddp and ddp['sec_per_step'])} "
            f"| {' / '.join(f'{m:.0f}' for m in r['peak_rss_mb'])} "
            f"| {_ratio(rss, fsdp2 and max(fsdp2['peak_rss_mb']))} "
            f"| {r['bytes_per_step'] / MB:.1f} | {r['bytes_source']} |")
    return "\n".join(out)


def target_lines(rows: list[dict]) -> list[str]:
    """The issue's targets for shardkit FULL_SHARD, checked against this run."""
    by_mode = {r["mode"]: r for r in rows}
    sk, fsdp2, ddp = (by_mode.get(m) for m in ("shardkit-full", "fsdp2", "ddp"))
    if sk is None:
        return []
    checks = []
    if fsdp2:
        checks.append(("step time <= 0.8 x FSDP2", sk["sec_per_step"] / fsdp2["sec_per_step"], 0.8))
        checks.append(("peak RSS/rank <= FSDP2", max(sk["peak_rss_mb"]) / max(fsdp2["peak_rss_mb"]), 1.0))
    if ddp:
        checks.append(("step time <= 1.2 x DDP", sk["sec_per_step"] / ddp["sec_per_step"], 1.2))
    return [f"- {name}: {ratio:.3f} -> {'met' if ratio <= limit else 'MISSED'}"
            for name, ratio, limit in checks]


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bar charts of step time and peak RSS per rank, one bar per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in rows]
    colors = ["tab:blue" if m.startswith("shardkit") else "tab:gray" for m in modes]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 2), sharey=True)
    ax1.barh(modes, [r["sec_per_step"] for r in rows], color=colors)
    ax1.set_xlabel("median seconds per step (lower is better)")
    ax2.barh(modes, [max(r["peak_rss_mb"]) for r in rows], color=colors)
    ax2.set_xlabel("peak RSS per rank, MB (lower is better)")
    ax1.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; --worker is internal (one mode in a fresh process)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "deep", "shallow"), default="mlp")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--nproc", type=int, default=2, help="ranks (world size)")
    p.add_argument("--modes", default="shardkit-full,shardkit-full-noprefetch,shardkit-grad-op,"
                   "shardkit-grad-op-noprefetch,shardkit-no-shard,fsdp2,fsdp1,ddp,single",
                   help=f"comma-separated subset of: {', '.join(ALL_MODES)}, or 'all'")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--backend", default=None, help="shardkit backend (default: best available)")
    p.add_argument("--plot", default=None, help="PNG path (default: bench_step_<model>.png)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = list(ALL_MODES) if args.modes == "all" else args.modes.split(",")
    unknown = sorted(set(args.modes) - set(ALL_MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(ALL_MODES)}")
    args.passthrough = [f"--model={args.model}", f"--steps={args.steps}",
                        f"--warmup={args.warmup}", f"--batch={args.batch}",
                        f"--nproc={args.nproc}", f"--threads={args.threads}"]
    if args.backend:
        args.passthrough.append(f"--backend={args.backend}")
    return args


def main(argv=None) -> int:
    """Run every requested mode in its own process and report."""
    args = parse_args(argv)
    if args.worker:
        ranks = run_mode(args.worker, args)
        print("RESULT " + json.dumps(ranks), flush=True)
        return 0
    rows = [r for r in (_launch(m, args) for m in args.modes) if r is not None]
    if not rows:
        return 1
    params = rows[0]["num_params"]
    title = (f"{args.model} ({params / 1e6:.1f}M params), {args.nproc} ranks, batch {args.batch}/rank, "
             f"Adam, {args.threads} thread(s)/rank, torch {torch.__version__}")
    print(f"\n{title}; {args.steps} timed steps after {args.warmup} warm-up\n")
    print(markdown_table(rows))
    targets = target_lines(rows)
    if targets:
        print("\nTargets (shardkit FULL_SHARD):\n" + "\n".join(targets))
    path = args.plot or f"bench_step_{args.model}.png"
    plot(rows, path, title)
    print(f"\nplot written to {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if len(rows) == len(args.modes) else 1


if __name__ == "__main__":
    sys.exit(main())
