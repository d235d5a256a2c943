"""Step-time / memory / traffic benchmark: shardkit against torch FSDP2, FSDP1, DDP and one process.

Two phases, both on the same model, per-rank batch, world size and optimizer (Adam):

- **memory** (`--isolated`, on by default): every mode in fresh processes (one subprocess per
  mode, which spawns its ranks) for a few steps; peak host RSS per rank and, on an accelerator,
  peak device memory. A fresh process per mode keeps one mode's peak out of another's.
- **time** (`--interleave`, on by default): every mode built in the *same* rank processes and
  stepped round-robin (`--chunk` steps of each mode per round, the order rotating), so slow and
  fast phases of a noisy machine hit every mode alike and the ratios hold. Per-step time comes
  from device events on an accelerator (wall clock on the host), median over the timed steps.
  `--profile DIR` adds a torch.profiler pass per mode: kernels per step, host (CPU) time per step
  and the time in each `shardkit::` range.

    python benchmarks/bench_step.py --model mlp --steps 30 --warmup 3
    python benchmarks/bench_step.py --model deep --steps 10 --warmup 2 --modes shardkit-full,fsdp2,ddp
    python benchmarks/bench_step.py --model gpt2-medium --device cuda --dtype bf16 --nproc 1 \\
        --batch 8 --seq 512 --modes shardkit-full,fsdp2,fsdp1,single --steps 40 --profile prof/

Models: mlp / deep / shallow (1x28x28 inputs, 10 classes) and gpt2-medium / gpt2-small / gpt-tiny
(token ids; a transformers GPT2LMHeadModel when transformers is installed, else shardkit's
in-repo GPT of the same shape). Units are one per Linear/Conv (CNN/MLP) or one per transformer
block (GPT), for every engine.
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

# shardkit modes: (strategy, prefetch depth, the root's reshard_after_forward); prefetch 0 means
# every all-gather waits in place; root None is the engine's default, True/False force it (the
# root-reshard comparison of issue 38: freed after forward and gathered again for backward, or kept).
SHARDKIT_MODES = {
    "shardkit-full": ("FULL_SHARD", 1, None), "shardkit-full-noprefetch": ("FULL_SHARD", 0, None),
    "shardkit-full-root-resharded": ("FULL_SHARD", 1, True),
    "shardkit-full-root-kept": ("FULL_SHARD", 1, False),
    "shardkit-grad-op": ("SHARD_GRAD_OP", 1, None),
    "shardkit-grad-op-noprefetch": ("SHARD_GRAD_OP", 0, None),
    "shardkit-no-shard": ("NO_SHARD", 1, None), "shardkit-no-shard-noprefetch": ("NO_SHARD", 0, None),
    "shardkit-hybrid": ("HYBRID_SHARD", 1, None), "shardkit-hybrid-noprefetch": ("HYBRID_SHARD", 0, None),
    # shardkit.Quantization(weights=True, gradients=True): int8 gathers and reductions (HYBRID:
    # the reduction's all-reduce across replicas too).
    "shardkit-full-quantized": ("FULL_SHARD", 1, None), "shardkit-hybrid-quantized": ("HYBRID_SHARD", 1, None),
}
QUANTIZED_MODES = ("shardkit-full-quantized", "shardkit-hybrid-quantized")
TORCH_MODES = ("fsdp2", "fsdp1", "ddp", "single")
ALL_MODES = tuple(SHARDKIT_MODES) + TORCH_MODES
# (layers, width, heads, vocabulary, context) of the GPT models.
GPT_SHAPES = {"gpt2-medium": (24, 1024, 16, 50257, 1024), "gpt2-small": (12, 768, 12, 50257, 1024),
              "gpt-tiny": (2, 32, 4, 128, 32)}
GPT_MODELS = tuple(GPT_SHAPES)
MB = 1024 * 1024
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- models and data -----------------------------------------------------------------------------
def build(name: str) -> tuple[nn.Module, tuple[type, ...]]:
    """The model and the module classes that become units (one per layer / block)."""
    if name not in GPT_MODELS:
        from shardkit.demo.models import build_model

        return build_model(name), (nn.Linear, nn.Conv2d)
    layers, dim, heads, vocab, context = GPT_SHAPES[name]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        from shardkit.demo.models import GPT

        model = GPT(vocab=vocab, context=context, dim=dim, layers=layers, heads=heads)
        return model, (type(model.blocks[0]),)
    cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=dim, n_layer=layers,
                     n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)  # SDPA attention: the default where torch has it
    return model, (type(model.transformer.h[0]),)


def make_batches(name: str, model: nn.Module, batch: int, seq: int, rank: int, device) -> list:
    """Four fixed (input, target) batches for this rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if name in GPT_MODELS:
        vocab = model.config.vocab_size if hasattr(model, "config") else model.wte.num_embeddings
        ids = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(4)]
        return [(i[:, :-1].to(device), i[:, 1:].to(device)) for i in ids]
    return [(torch.randn(batch, 1, 28, 28, generator=gen).to(device),
             torch.randint(0, 10, (batch,), generator=gen).to(device)) for _ in range(4)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits (per token for language models)."""
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---- wrapping --------------------------------------------------------------------------------------
def wrap(model: nn.Module, mode: str, ctx, unit_classes: tuple, dtype: torch.dtype,
         quantize=None) -> nn.Module:
    """Apply the distributed wrapper `mode` names; units are instances of `unit_classes`
    (`quantize`: a shardkit.Quantization for the shardkit modes)."""
    low = dtype != torch.float32
    if mode in SHARDKIT_MODES:
        import shardkit

        strategy, prefetch, root = SHARDKIT_MODES[mode]
        if mode in QUANTIZED_MODES and quantize is None:
            quantize = shardkit.Quantization(weights=True, gradients=True)
        kwargs: dict = {"hybrid_group_size": max(1, ctx.world_size // 2)} if strategy == "HYBRID_SHARD" else {}
        if root is not None:
            kwargs["reshard_after_forward"] = {"<root>": root}
        if low:
            kwargs["mixed_precision"] = shardkit.MixedPrecision(param_dtype=dtype,
                                                                reduce_dtype=torch.float32)
        return shardkit.shard(model, strategy=shardkit.ShardingStrategy[strategy],
                              auto_wrap_policy=shardkit.wrap.transformer_layers(unit_classes),
                              prefetch=prefetch, backend=ctx.backend, quantize=quantize,
                              **kwargs)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if low else None
        kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
        for layer in [m for m in model.modules() if isinstance(m, unit_classes)]:
            fully_shard(layer, **kw)
        return fully_shard(model, **kw)
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if low else None
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(set(unit_classes)),
                    device_id=ctx.device, use_orig_params=True, mixed_precision=mp)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, **ctx.backend.ddp_kwargs(ctx.device))
    return model


def compile_blocks(model: nn.Module, unit_classes: tuple, backend: str) -> None:
    """`block.compile(backend=...)` on every unit after wrapping, the call torch's docs and
    torchtitan show, for every engine alike."""
    for module in model.modules():
        if isinstance(module, unit_classes):
            module.compile(backend=backend)


def compile_model(model: nn.Module, backend: str) -> nn.Module:
    """`torch.compile(model, backend=...)` on the whole wrapped model (shardkit traces its hooks
    into the graph; FSDP2 breaks it at each unit)."""
    return torch.compile(model, backend=backend)


def split_mode(mode: str) -> tuple[str, str | None]:
    """'shardkit-full+inductor' -> ('shardkit-full', 'inductor'); an eager mode has no backend.
    A backend ending in '-model' ('inductor-model') compiles the whole model instead of blocks."""
    engine, _, backend = mode.partition("+")
    return engine, backend or None


def _formula_bytes(mode: str, num_params: int, world: int, elem: int = 4) -> int:
    """Ring-collective bytes one rank sends per step for the torch modes."""
    p = num_params * elem
    if mode in ("fsdp2", "fsdp1"):
        # all-gather in forward, again in backward (resharded after forward), one reduce-scatter.
        return 3 * (world - 1) * p // world
    if mode == "ddp":
        return 2 * (world - 1) * p // world
    return 0


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- one mode on one rank ------------------------------------------------------------------------
class Runner:
    """One mode's model, optimizer and data on this rank, and a way to time one step of it."""

    def __init__(self, mode: str, a: argparse.Namespace, ctx, rank: int) -> None:
        self.mode, self.ctx = mode, ctx
        engine, compile_backend = split_mode(mode)
        self.device = ctx.device
        self.dtype = DTYPES[a.dtype]
        torch.manual_seed(0)
        model, classes = build(a.model)
        self.num_params = sum(p.numel() for p in model.parameters())
        model = model.to(self.device)
        self.batches = make_batches(a.model, model, a.batch, a.seq, rank, self.device)
        self.wrapped = wrap(model, engine, ctx, classes, self.dtype)  # what shardkit's calls take
        self.model = self.wrapped  # what a step calls
        if compile_backend and compile_backend.endswith("-model"):
            self.model = compile_model(self.wrapped, compile_backend[:-len("-model")])
        elif compile_backend:
            compile_blocks(self.wrapped, classes, compile_backend)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.autocast = engine == "single" and self.dtype != torch.float32
        self.i = 0
        self.timed: list[float] = []  # seconds per step
        self.host: list[float] = []  # seconds until the host had queued the whole step

    def step(self) -> None:
        """zero_grad + forward + backward + optimizer step."""
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            loss = loss_of(self.model, x, y)
        loss.backward()
        self.opt.step()
        self.ctx.backend.step_boundary()

    def timed_steps(self, n: int) -> None:
        """Run `n` steps, recording each one's device time (events) and host time."""
        be, dev = self.ctx.backend, self.device
        streams = be.capabilities.has_streams
        for _ in range(n):
            be.synchronize(dev)
            t0 = time.perf_counter()
            if streams:
                start, end = be.new_event(), be.new_event()
                start = type(start)(enable_timing=True)
                end = type(end)(enable_timing=True)
                start.record(be.current_stream(dev))
            self.step()
            self.host.append(time.perf_counter() - t0)
            if streams:
                end.record(be.current_stream(dev))
                end.synchronize()
                self.timed.append(start.elapsed_time(end) / 1000)
            else:
                be.synchronize(dev)
                self.timed.append(time.perf_counter() - t0)


def _profile(runner: Runner, steps: int, out_dir: str, rank: int) -> dict:
    """Kernels per step, host time per step and shardkit:: range totals from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    runner.ctx.backend.synchronize(runner.device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            runner.step()
        runner.ctx.backend.synchronize(runner.device)
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA)
    ranges: dict[str, float] = {}
    for e in events:
        if e.key.startswith("shardkit::"):
            key = e.key.split("[")[0]
            ranges[key] = ranges.get(key, 0.0) + e.cpu_time_total / 1000 / steps
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        sort = "cuda_time_total" if len(acts) > 1 else "cpu_time_total"
        with open(os.path.join(out_dir, f"{runner.mode}.txt"), "w") as f:
            f.write(events.table(sort_by=sort, row_limit=40))
    return {"kernels_per_step": kernels / steps, "profiled_wall_ms": wall * 1000,
            "ranges_cpu_ms_per_step": ranges}


def bench_rank(rank: int, modes: list[str], args_dict: dict, interleave: bool) -> dict:
    """Build every mode on this rank; time them (round-robin if `interleave`); return figures."""
    import shardkit

    a = argparse.Namespace(**args_dict)
    ctx = shardkit.current_context()
    be = ctx.backend
    runners = {}
    for mode in modes:
        runners[mode] = Runner(mode, a, ctx, rank)
        if not interleave:
            be.reset_peak_memory(ctx.device)
    for r in runners.values():
        for _ in range(a.warmup):
            r.step()
    for mode in modes:
        if split_mode(mode)[0] in SHARDKIT_MODES:
            shardkit.comm_stats(runners[mode].wrapped, reset=True)
    if interleave:
        rounds = max(1, -(-a.steps // a.chunk))
        for k in range(rounds):
            order = modes[k % len(modes):] + modes[:k % len(modes)]
            for mode in order:
                runners[mode].timed_steps(a.chunk)
    else:
        for r in runners.values():
            r.timed_steps(a.steps)
    out = {}
    for mode, r in runners.items():
        engine = split_mode(mode)[0]
        if engine in SHARDKIT_MODES:
            comm, source = shardkit.comm_stats(r.wrapped)["total"] // len(r.timed), "measured"
        else:
            elem = 2 if r.dtype != torch.float32 else 4
            comm, source = _formula_bytes(engine, r.num_params, ctx.world_size, elem), "formula"
        out[mode] = {"times": r.timed, "host": r.host, "bytes_per_step": comm,
                     "bytes_source": source, "num_params": r.num_params,
                     "world": ctx.world_size}
    if not interleave:
        mem = be.memory_stats(ctx.device)
        out[modes[0]]["peak_rss"] = _peak_rss()
        out[modes[0]]["peak_device"] = mem.get("peak", 0) if ctx.device.type != "cpu" else 0
    if a.profile:
        for mode, r in runners.items():
            out[mode]["profile"] = _profile(r, a.profile_steps, a.profile, rank)
    return out


def run_modes(modes: list[str], args: argparse.Namespace, interleave: bool) -> list[dict]:
    """Spawn the ranks in this (fresh) process and run `modes` on them."""
    torch.set_num_threads(args.threads)
    import shardkit

    return shardkit.spawn(bench_rank, args.nproc, modes, vars(args), interleave,
                          backend=args.backend, threads_per_rank=args.threads)


# ---- driver ----------------------------------------------------------------------------------------
def _summarise(mode: str, ranks: list[dict]) -> dict:
    rows = [r[mode] for r in ranks]
    # Steps are lock-stepped by collectives; the slowest rank's time is the step time.
    per_step = [max(r["times"][i] for r in rows) for i in range(len(rows[0]["times"]))]
    host = [max(r["host"][i] for r in rows) for i in range(len(rows[0]["host"]))]
    res = {"mode": mode, "sec_per_step": statistics.median(per_step),
           "host_sec_per_step": statistics.median(host), "steps": len(per_step),
           "bytes_per_step": max(r["bytes_per_step"] for r in rows),
           "bytes_source": rows[0]["bytes_source"], "num_params": rows[0]["num_params"],
           "world": rows[0]["world"]}
    if "peak_rss" in rows[0]:
        res["peak_rss_mb"] = [r["peak_rss"] / MB for r in rows]
        res["peak_device_mb"] = max(r["peak_device"] for r in rows) / MB
    if "profile" in rows[0]:
        res["profile"] = rows[0]["profile"]
    return res


def _launch(modes: list[str], args: argparse.Namespace, interleave: bool) -> list[dict]:
    flag = "--worker-interleave" if interleave else "--worker"
    cmd = [sys.executable, os.path.abspath(__file__), flag, ",".join(modes)] + args.passthrough
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"[{','.join(modes)}] FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
              file=sys.stderr)
        return []
    ranks = json.loads(lines[-1][len("RESULT "):])
    rows = [_summarise(m, ranks) for m in modes]
    for res in rows:
        mem = (f", peak RSS {max(res['peak_rss_mb']):.0f} MB/rank, device {res['peak_device_mb']:.0f} MB"
               if "peak_rss_mb" in res else "")
        print(f"[{res['mode']}] {res['sec_per_step']:.4f} s/step (host {res['host_sec_per_step']:.4f})"
              f"{mem} ({time.perf_counter() - t0:.0f} s wall)", file=sys.stderr, flush=True)
    return rows


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.3f}" if value and base else "-"


def _peer_time(by_mode: dict[str, dict], mode: str, peer: str) -> float | None:
    """s/step of `peer` run the way `mode` ran (compiled with the same backend, or eager)."""
    backend = split_mode(mode)[1]
    row = by_mode.get(f"{peer}+{backend}" if backend else peer)
    return row["sec_per_step"] if row else None


def markdown_table(rows: list[dict], mem: dict[str, dict]) -> str:
    """Render results as a markdown table with ratios against FSDP2, FSDP1 and DDP (a compiled
    mode against the same peer compiled with the same backend) and against its own eager run."""
    by_mode = {r["mode"]: r for r in rows}
    compiled = any(split_mode(r["mode"])[1] for r in rows)
    out = ["| mode | s/step (median) | vs FSDP2 | vs FSDP1 | vs DDP |"
           + (" vs own eager |" if compiled else "")
           + " host s/step | peak RSS/rank (MB) | peak device (MB) | kernels/step "
           "| sent/rank/step (MB) | bytes |",
           "|---|---|---|---|---|" + ("---|" if compiled else "") + "---|---|---|---|---|---|"]
    for r in rows:
        m = mem.get(r["mode"], {})
        rss = " / ".join(f"{v:.0f}" for v in m.get("peak_rss_mb", [])) or "-"
        dev = f"{m['peak_device_mb']:.0f}" if m.get("peak_device_mb") else "-"
        kern = f"{r['profile']['kernels_per_step']:.0f}" if "profile" in r else "-"
        sec = r["sec_per_step"]
        ratios = " | ".join(_ratio(sec, _peer_time(by_mode, r["mode"], peer))
                            for peer in ("fsdp2", "fsdp1", "ddp"))
        if compiled:
            engine, backend = split_mode(r["mode"])
            eager = by_mode.get(engine)
            ratios += " | " + (_ratio(sec, eager["sec_per_step"]) if backend and eager else "-")
        out.append(
            f"| {r['mode']} | {sec:.4f} | {ratios} | {r['host_sec_per_step']:.4f} | {rss} | {dev} "
            f"| {kern} | {r['bytes_per_step'] / MB:.1f} | {r['bytes_source']} |")
    return "\n".join(out)


def target_lines(rows: list[dict], mem: dict[str, dict], device: str) -> list[str]:
    """The issue's targets (GPU or host set), checked against this run."""
    t = {r["mode"]: r["sec_per_step"] for r in rows}
    checks = []

    def time_check(name, a, b, limit):
        if a in t and b in t:
            checks.append((name, t[a] / t[b], limit))

    def mem_check(name, a, b):
        key = "peak_device_mb" if device != "cpu" else "peak_rss_mb"
        va, vb = mem.get(a, {}).get(key), mem.get(b, {}).get(key)
        if va and vb:
            va, vb = (max(va), max(vb)) if isinstance(va, list) else (va, vb)
            checks.append((name, va / vb, 1.0))

    for backend in sorted({split_mode(m)[1] for m in t} - {None}):
        full, fsdp2 = f"shardkit-full+{backend}", f"fsdp2+{backend}"
        time_check(f"FULL_SHARD compiled <= {0.95 if device != 'cpu' else 1.0} x FSDP2 compiled "
                   f"({backend})", full, fsdp2, 0.95 if device != "cpu" else 1.0)
        time_check(f"FULL_SHARD compiled < its eager ({backend})", full, "shardkit-full", 1.0)
    if device != "cpu":
        time_check("FULL_SHARD <= 0.95 x FSDP2", "shardkit-full", "fsdp2", 0.95)
        time_check("FULL_SHARD <= 1.0 x FSDP1", "shardkit-full", "fsdp1", 1.0)
        mem_check("peak device memory <= FSDP2", "shardkit-full", "fsdp2")
    else:
        time_check("FULL_SHARD <= 0.9 x FSDP2", "shardkit-full", "fsdp2", 0.9)
        time_check("FULL_SHARD <= 1.0 x FSDP1", "shardkit-full", "fsdp1", 1.0)
        time_check("SHARD_GRAD_OP <= 1.25 x DDP", "shardkit-grad-op", "ddp", 1.25)
        mem_check("peak RSS/rank <= FSDP2", "shardkit-full", "fsdp2")
    return [f"- {name}: {ratio:.3f} -> {'met' if ratio <= limit else 'MISSED'}"
            for name, ratio, limit in checks]


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; --worker / --worker-interleave are internal (modes in a fresh process)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "deep", "shallow") + GPT_MODELS, default="mlp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the cpu backend (gloo); cuda: the cuda backend (NCCL)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="compute dtype: bf16 = bf16 params / fp32 reduce (autocast for 'single')")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--chunk", type=int, default=2, help="steps of one mode per interleaved round")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--seq", type=int, default=512, help="tokens per sample (GPT models)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (world size)")
    p.add_argument("--modes", default="shardkit-full,shardkit-grad-op,fsdp2,fsdp1,ddp,single",
                   help=f"comma-separated subset of: {', '.join(ALL_MODES)}, or 'all'")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="also run every mode compiled (as '<mode>+BACKEND'): block.compile("
                        "backend=BACKEND) on every unit after wrapping, e.g. inductor")
    p.add_argument("--compile-model", default=None, metavar="BACKEND",
                   help="also run every mode with the whole wrapped model compiled (as "
                        "'<mode>+BACKEND-model'): torch.compile(model, backend=BACKEND)")
    p.add_argument("--no-isolated", dest="isolated", action="store_false",
                   help="skip the fresh-process-per-mode memory phase")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="skip the interleaved timing phase (times come from the isolated runs)")
    p.add_argument("--isolated-steps", type=int, default=3, help="timed steps in the memory phase")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile each mode after timing; per-mode tables written to DIR")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw s/step and peak memory per mode against FSDP2 (matplotlib)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-interleave", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = list(ALL_MODES) if args.modes == "all" else args.modes.split(",")
    unknown = sorted({split_mode(m)[0] for m in args.modes} - set(ALL_MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(ALL_MODES)}")
    args.backend = args.device
    args.passthrough = [f"--model={args.model}", f"--device={args.device}", f"--dtype={args.dtype}",
                        f"--warmup={args.warmup}", f"--chunk={args.chunk}", f"--batch={args.batch}",
                        f"--seq={args.seq}", f"--nproc={args.nproc}", f"--threads={args.threads}",
                        f"--profile-steps={args.profile_steps}"]
    eager_modes = list(args.modes)
    if args.compile:
        args.modes += [f"{m}+{args.compile}" for m in eager_modes]
    if args.compile_model:
        args.modes += [f"{m}+{args.compile_model}-model" for m in eager_modes]
    return args


def main(argv=None) -> int:
    """Run the memory phase (fresh processes) and the interleaved timing phase, then report."""
    args = parse_args(argv)
    if args.worker or args.worker_interleave:
        interleave = bool(args.worker_interleave)
        ranks = run_modes((args.worker_interleave or args.worker).split(","), args, interleave)
        print("RESULT " + json.dumps(ranks), flush=True)
        return 0
    mem: dict[str, dict] = {}
    isolated_rows: list[dict] = []
    if args.isolated:
        iso = argparse.Namespace(**vars(args))
        iso.passthrough = args.passthrough + [f"--steps={args.isolated_steps}"]
        for m in args.modes:
            isolated_rows += _launch([m], iso, interleave=False)
        mem = {r["mode"]: r for r in isolated_rows}
    rows = isolated_rows
    if args.interleave:
        inter = argparse.Namespace(**vars(args))
        inter.passthrough = args.passthrough + [f"--steps={args.steps}"]
        if args.profile:
            inter.passthrough.append(f"--profile={args.profile}")
        rows = _launch(args.modes, inter, interleave=True)
    if not rows:
        return 1
    params = rows[0]["num_params"]
    how = (f"interleaved in one process per rank, {args.steps} timed steps per mode in rounds of "
           f"{args.chunk}" if args.interleave else "one fresh process per mode")
    title = (f"{args.model} ({params / 1e6:.1f}M params) on {args.device}, {args.dtype}, "
             f"{args.nproc} rank(s), batch {args.batch}/rank"
             f"{f' x {args.seq} tokens' if args.model in GPT_MODELS else ''}, Adam, "
             f"{args.threads} thread(s)/rank, torch {torch.__version__}"
             f"{f', each also compiled (+{args.compile}: block.compile() per unit)' if args.compile else ''}"
             f"{f', each also compiled whole (+{args.compile_model}-model: torch.compile(model))' if args.compile_model else ''}"
             f"; {how}, "
             f"{args.warmup} warm-up")
    print(f"\n{title}\n")
    print(markdown_table(rows, mem))
    for r in rows:
        if "profile" in r:
            ranges = ", ".join(f"{k[10:]} {v:.2f}" for k, v in
                               sorted(r["profile"]["ranges_cpu_ms_per_step"].items()))
            print(f"- {r['mode']}: profiled {r['profile']['profiled_wall_ms']:.1f} ms/step, "
                  f"{r['profile']['kernels_per_step']:.0f} kernels/step"
                  f"{'; shardkit ranges (host ms/step): ' + ranges if ranges else ''}")
    targets = target_lines(rows, mem, args.device)
    if targets:
        print("\nTargets:\n" + "\n".join(targets))
    result = {"title": title, "rows": rows, "memory": list(mem.values())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        from plot_step import plot  # benchmarks/plot_step.py, beside this script

        plot(result, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
