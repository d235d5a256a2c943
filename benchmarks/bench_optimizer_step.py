"""The optimizer step of a sharded model against the same optimizer over plain tensors (issue 53).

Per rank, in one process, for each model and optimizer:

- plain: the optimizer over plain tensors of this rank's shard sizes (the local tensors of
  shardkit's parameters, copied), with gradients: the speed a step cannot beat;
- shardkit: the sharded model's own optimizer as the user builds it (the local-tensor step);
- shardkit-dispatch: the same with SHARDKIT_LOCAL_STEP=0 (every op through DTensor's dispatch,
  what every step cost before);
- fsdp2: torch's fully_shard on the same model, the same optimizer.

Only `optimizer.step()` is timed: each variant has its gradients from one backward and its state
from one step, then the variants take turns (`--rounds` rounds of `--steps` steps each, so a
noisy moment lands on all of them) and the median step is reported, with its ratio to plain.

    python benchmarks/bench_optimizer_step.py --models mlp104 gpt2-small deep --nproc 2

Run it on as many idle cores as ranks (one thread per rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shardkit

VARIANTS = ("plain", "shardkit", "shardkit-dispatch", "fsdp2")
OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused", "adam", "sgd-momentum", "lion")


def build_model(name: str) -> tuple[nn.Module, tuple[type, ...]]:
    """The model and the module classes that become units."""
    if name == "mlp104":  # 52 Linear 64x64: 104 small tensors, where per-tensor costs show
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(52)]), (nn.Linear,)
    from bench_step import build

    return build(name)


def make_optimizer(name: str, params: list) -> torch.optim.Optimizer:
    """The optimizer `name` over `params`, as a user builds it."""
    if name == "lion":
        from lion_pytorch import Lion

        shardkit.elementwise_optimizer(Lion)  # from outside torch: declared elementwise
        return Lion(params, lr=1e-4, weight_decay=0.1)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=0.1)
    kwargs = {"adamw-foreach": {"foreach": True}, "adamw-fused": {"fused": True}}.get(name, {})
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=1e-3, weight_decay=0.1, **kwargs)


def _sharded(model_name: str, variant: str, ctx) -> nn.Module:
    torch.manual_seed(0)
    model, unit_classes = build_model(model_name)
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        model.to(ctx.device)
        for layer in [m for m in model.modules() if isinstance(m, unit_classes)]:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return shardkit.shard(model, auto_wrap_policy=shardkit.wrap.transformer_layers(unit_classes),
                          backend=ctx.backend)


def _backward(model_name: str, model: nn.Module, rank: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(rank)
    if model_name == "mlp104":
        out = model(torch.randn(8, 64, generator=gen).to(device))
    elif model_name.startswith("gpt"):
        vocab = model.config.vocab_size if hasattr(model, "config") else model.wte.num_embeddings
        out = model(torch.randint(0, vocab, (1, 32), generator=gen).to(device))
        out = out.logits if hasattr(out, "logits") else out
    else:
        out = model(torch.randn(2, 1, 28, 28, generator=gen).to(device))
    out.float().square().mean().backward()


def _variant(model_name: str, variant: str, opt_name: str, rank: int, ctx) -> tuple:
    """(what keeps the variant alive, its optimizer), gradients present and state made."""
    os.environ["SHARDKIT_LOCAL_STEP"] = "1" if variant == "shardkit" else "0"
    source = "shardkit" if variant == "plain" else variant
    model = _sharded(model_name, "shardkit" if source.startswith("shardkit") else source, ctx)
    _backward(model_name, model, rank, ctx.device)
    if variant == "plain":
        params = []
        for p in model.parameters():
            local = p.to_local().detach().clone().requires_grad_(p.requires_grad)
            if p.grad is not None:
                local.grad = p.grad.to_local().clone()
            params.append(local)
        del model
        model = params
    opt = make_optimizer(opt_name, list(model.parameters()) if isinstance(model, nn.Module)
                         else model)
    opt.step()  # makes the state (and adopts the optimizer where it may step locally)
    return model, opt


def bench_rank(rank: int, args_dict: dict) -> dict:
    """Median seconds per optimizer step of each variant, per model and optimizer."""
    a = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)
    ctx = shardkit.current_context()
    results: dict = {}
    for model_name in a.models:
        for opt_name in a.optimizers:
            live = {v: _variant(model_name, v, opt_name, rank, ctx) for v in a.variants}
            times: dict[str, list[float]] = {v: [] for v in a.variants}
            for _ in range(a.rounds):
                for variant in a.variants:
                    opt = live[variant][1]
                    ctx.backend.barrier(ctx.world)
                    began = time.perf_counter()
                    for _ in range(a.steps):
                        opt.step()
                    times[variant].append((time.perf_counter() - began) / a.steps)
            results[f"{model_name}/{opt_name}"] = {v: statistics.median(t) for v, t in times.items()}
            if rank == 0:
                print(f"{model_name}/{opt_name}: " + ", ".join(
                    f"{v} {t * 1e3:.3f} ms" for v, t in results[f"{model_name}/{opt_name}"].items()),
                    file=sys.stderr, flush=True)
            del live
            gc.collect()  # sharded models hold reference cycles: free them before the next
    return results


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(results: list[dict], variants: list[str]) -> str:
    """One row per model and optimizer: ms per step of each variant (slowest rank), x plain."""
    head = "| model / optimizer | " + " | ".join(f"{v}: ms (x plain)" for v in variants) + " |"
    lines = [head, "|---|" + "---|" * len(variants)]
    for key in results[0]:
        slowest = {v: max(r[key][v] for r in results) for v in variants}
        base = slowest.get("plain")
        cells = [f"{slowest[v] * 1e3:.3f}" + (f" ({slowest[v] / base:.2f})" if base else "")
                 for v in variants]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a markdown table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp104"])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", default=None,
                        help="shardkit backend (default: the best available; 'cuda+gloo' puts "
                             "several ranks on one GPU, without FSDP2: gloo has no reduce-scatter)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write the raw medians here")
    args = parser.parse_args(argv)
    results = shardkit.spawn(bench_rank, args.nproc, vars(args), threads_per_rank=1,
                             backend=args.backend)
    print(f"{platform.node()} {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, shardkit {_commit()}, {args.nproc} ranks, 1 thread each, "
          f"backend {args.backend or 'default'}")
    print(markdown(results, args.variants))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
