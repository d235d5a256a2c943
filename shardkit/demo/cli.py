"""`shardkit demo`: argument parsing and the printed summary around `run_demo`."""

from __future__ import annotations

import argparse
import time

from ..cli.args import ENVIRONMENT_HELP, STRATEGY_NAMES, positive_int
from ..errors import ShardkitError
from .config import DEFAULT_LR, IMAGE_MODELS, PRECISION_NAMES, STRATEGY_TRADE, DemoConfig

MB = 1024 * 1024


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `demo` subcommand on an argparse subparsers object."""
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo", help="train an MNIST-style CNN sharded across local processes",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=ENVIRONMENT_HELP,
        description="Train the seed tutorial's CNN on scikit-learn's handwritten digits "
                    "(upscaled to 28x28) across local ranks with shardkit.shard, printing "
                    "train loss, test accuracy and each rank's memory.")
    p.add_argument("--backend", default=None,
                   help="backend name (default: the best available one, see `shardkit info`)")
    p.add_argument("--nproc", type=positive_int, default=d.nproc,
                   help=f"number of local ranks (default: {d.nproc})")
    p.add_argument("--strategy", default=d.strategy, type=str.upper, choices=STRATEGY_NAMES,
                   help=f"how parameters, gradients and optimizer state are split (default: "
                        f"{d.strategy})")
    p.add_argument("--hybrid-group-size", type=positive_int, default=None, metavar="G",
                   help="HYBRID_SHARD: ranks per shard group, a divisor of --nproc; the groups "
                        "hold replicas (default: --nproc, i.e. one group)")
    p.add_argument("--model", default=d.model, choices=IMAGE_MODELS,
                   help=f"shallow: 1.2M params; deep: 94M params (slow on CPU); mlp: 4.8M "
                        f"(default: {d.model})")
    p.add_argument("--epochs", type=positive_int, default=d.epochs,
                   help=f"passes over the training images (default: {d.epochs})")
    p.add_argument("--mixed-precision", default=d.mixed_precision, choices=PRECISION_NAMES,
                   help=f"compute dtype; the sharded weights stay float32 (default: "
                        f"{d.mixed_precision})")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help=f"images per rank per step (default: {d.batch_size})")
    p.add_argument("--optimizer", default=d.optimizer, choices=sorted(DEFAULT_LR),
                   help=f"(default: {d.optimizer})")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 1.0 for adadelta, 1e-3 for adamw)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed for the model and the data order (default: {d.seed})")
    p.add_argument("--threads-per-rank", type=positive_int, default=None,
                   help="compute threads per rank (default: cores / nproc)")
    p.add_argument("--limit-train", type=positive_int, default=None,
                   help="train on only the first N training images (quick checks)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(run=run)
    return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Turn parsed flags into a DemoConfig."""
    if args.hybrid_group_size is not None:
        if args.strategy != "HYBRID_SHARD":
            raise ShardkitError("--hybrid-group-size applies to --strategy HYBRID_SHARD only")
        if args.nproc % args.hybrid_group_size:
            divisors = [g for g in range(1, args.nproc + 1) if args.nproc % g == 0]
            raise ShardkitError(f"--hybrid-group-size {args.hybrid_group_size} does not divide "
                                f"--nproc {args.nproc}; HINT: use one of {divisors}")
    return DemoConfig(model=args.model, strategy=args.strategy, epochs=args.epochs,
                      hybrid_group_size=args.hybrid_group_size,
                      batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr,
                      mixed_precision=args.mixed_precision, seed=args.seed, nproc=args.nproc,
                      backend=args.backend, threads_per_rank=args.threads_per_rank,
                      limit_train=args.limit_train, progress=not args.no_progress)


def summary(results: list[dict], seconds: float) -> str:
    """The closing lines: accuracy, time and the per-rank memory table."""
    first = results[0]
    cfg, last = first["config"], first["history"][-1]
    from .memory import memory_report

    device_kind = first["device"].split(":")[0]
    return (f"{cfg['model']} ({first['num_params']:,} params), {cfg['strategy']} on "
            f"{first['world_size']} ranks ({first['device']}): final test accuracy "
            f"{last['test_accuracy'] * 100:.2f}%, train loss {last['train_loss']:.4f}, "
            f"{seconds:.1f} s in total\n" + memory_report(results, device_kind) + "\n"
            + traffic_report(first) + f"\n{cfg['strategy']}: {STRATEGY_TRADE[cfg['strategy']]}")


def traffic_report(result: dict) -> str:
    """One line: what a rank sent per training step, by collective, and how its groups are laid out."""
    sent, groups = result["sent_per_step"], result["groups"]
    kinds = ", ".join(f"{kind.replace('_', '-')} {sent[kind] / MB:.2f}"
                      for kind in ("all_gather", "reduce_scatter", "all_reduce"))
    return (f"sent per rank per training step, MB: {kinds} (total {sent['total'] / MB:.2f}); "
            f"shard groups of {groups['shard']} rank(s) x {groups['replicas']} replica(s)")


def _runs_on_host(backend: str | None) -> bool:
    """True when the demo's ranks would compute on the CPU (the named or the auto-chosen backend)."""
    from ..job.selection import get_backend

    try:
        return get_backend(backend).device_type == "cpu"
    except Exception:  # noqa: BLE001 - an unusable backend is reported by the ranks, with its hint
        return False


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed flags and print its summary; return the exit code."""
    from ..cli.interrupts import deferred_ctrl_c

    with deferred_ctrl_c():  # torch and scikit-learn import whole, or not at all
        from .data import require_scikit_learn
        from .train import run_demo

        require_scikit_learn()  # one line here, not each rank's chained traceback after spawning
    cfg = config_from_args(args)
    print(f"shardkit demo: {cfg.model} on digits 28x28, {cfg.nproc} ranks, {cfg.strategy}, "
          f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}, batch {cfg.batch_size}/rank, "
          f"{cfg.optimizer}, "
          f"mixed precision {cfg.mixed_precision}", flush=True)
    if cfg.mixed_precision == "fp16" and _runs_on_host(cfg.backend):
        print("shardkit demo: note: CPUs have no fast float16 kernels; fp16 trains about 20x "
              "slower than fp32 here (use --mixed-precision bf16 or none on CPU)", flush=True)
    t0 = time.perf_counter()
    results = run_demo(cfg)
    print(summary(results, time.perf_counter() - t0), flush=True)
    return 0
