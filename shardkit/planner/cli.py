"""`shardkit plan`: print a model's per-rank memory and traffic before launching anything."""

from __future__ import annotations

import argparse
import json
import sys
import math
from typing import Any

from ..cli.args import ENVIRONMENT_HELP, STRATEGY_NAMES, positive_int
from ..errors import ShardkitError
from .optimizers import STATE_TENSORS_PER_PARAM

PRECISION_NAMES = ("bf16", "fp16", "fp32")
LINK_NAMES = ("nvlink", "ib", "ethernet")  # steptime.LINKS' keys, torch-free for the parser
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# Quantization.block_size's bounds, spelled out so that parsing needs no torch (a test keeps
# them equal to shardkit.sharding.policies').
MIN_QUANT_BLOCK, MAX_QUANT_BLOCK = 8, 1 << 20


def _quant_block(text: str) -> int:
    """--quantize-block N: checked as it is parsed, naming the flag (not Quantization's field)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not MIN_QUANT_BLOCK <= value <= MAX_QUANT_BLOCK:
        raise argparse.ArgumentTypeError(f"expected {MIN_QUANT_BLOCK} to {MAX_QUANT_BLOCK} "
                                         f"elements per fp32 scale, got {text}")
    return value


def quantization(which: str | None, block: int | None) -> Any:
    """The shard() option --quantize names (None: exact collectives)."""
    if which is None:
        if block is not None:
            raise ShardkitError("--quantize-block sets the block size of --quantize, which is not "
                                "given: the plan would be exact. HINT: add --quantize weights, "
                                "gradients or both")
        return None
    from ..sharding.policies import Quantization

    return Quantization(weights=which in ("weights", "both"),
                        gradients=which in ("gradients", "both"),
                        block_size=256 if block is None else block)

def _number(text: str) -> float:
    """`text` as a float; NaN (which every range check refuses) when it is not a number."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def memory_size(text: str) -> int:
    """Parse a memory size: 80GiB, 80 GB (10^9), 81920MiB or plain bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower() or "b"
    value = _number(number)
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 80GiB, 80GB or 81920MiB, got {text!r} (units: "
            f"{', '.join(['B', 'KB', 'MB', 'GB', 'TB', 'KiB', 'MiB', 'GiB', 'TiB'])})")
    return int(value * _UNITS[unit])


def positive_float(text: str) -> float:
    """A finite number > 0 (a bandwidth)."""
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a latency)."""
    value = _number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def headroom(text: str) -> float:
    """A fraction such as 0.2 or a percentage such as 20%, from 0 to 1000%."""
    stripped = text.strip()
    value = _number(stripped[:-1]) / 100 if stripped.endswith("%") else _number(stripped)
    if not math.isfinite(value) or not 0 <= value < 10:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.2 or a percentage such "
                                         f"as 20%, got {text!r}")
    return value


def world_size(text: str) -> int | str:
    """A positive int, or "auto" (the fewest ranks that fit; needs --device-memory)."""
    return "auto" if text.lower() == "auto" else positive_int(text)


def mixed_precision(name: str) -> Any:
    """The MixedPrecision a --mixed-precision name stands for: compute in it, reduce in fp32."""
    import torch

    from ..sharding.policies import MixedPrecision

    if name == "fp32":
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)


def _reshard(text: str) -> bool | int | None:
    lowered = text.lower()
    if lowered in ("none", "default"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected default, true, false or an int, got {text!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "plan", help="predict per-rank memory and bytes per step of a model before launching",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=ENVIRONMENT_HELP,
        description="Build the model on the meta device (no memory, no download) and print "
                    "what shardkit.shard() would make of it: units, padded shards, persistent "
                    "bytes per rank, the largest gathered unit, the peak (with --batch/--seq: "
                    "activations included: the engine rehearsed on meta) and the bytes each rank sends per "
                    "step.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("target", nargs="?", metavar="MODULE:FACTORY",
                     help="a callable returning an nn.Module (called under torch.device('meta'))")
    src.add_argument("--hf-config", metavar="NAME_OR_JSON",
                     help="a transformers model type (gpt2, llama, t5, ...) or a config.json path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a --hf-config setting (repeatable), e.g. --set n_layer=24")
    p.add_argument("--world-size", type=world_size, required=True, metavar="N|auto",
                   help="ranks; auto: the fewest that fit --device-memory per rank (at --batch)")
    p.add_argument("--device-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory per rank, e.g. 80GiB: without --batch, the largest batch that fits "
                        "for each strategy, with and without --ac and --cpu-offload (needs --seq); "
                        "with --batch, whether it fits")
    p.add_argument("--headroom", type=headroom, default=None, metavar="FRACTION|PERCENT",
                   help="with --device-memory: what the device's allocator holds above the "
                        "planned peak, e.g. 0.3 or 30%%; planned peaks must fit "
                        "device-memory / (1 + headroom) (default: the backend's declared "
                        "allocator headroom: 45%% on cuda and xpu, 0 on cpu)")
    p.add_argument("--strategy", default="FULL_SHARD", type=str.upper,
                   choices=STRATEGY_NAMES)
    p.add_argument("--hybrid-group-size", type=positive_int, default=None,
                   help="HYBRID_SHARD shard group size (default: the ranks per node with "
                        "--nodes, else the world size)")
    p.add_argument("--nodes", type=positive_int, default=None,
                   help="spread the ranks over this many nodes (node by node, as torchrun): "
                        "also print the bytes each rank sends to another node per step")
    p.add_argument("--wrap", default=None, metavar="CLASSNAME[,CLASSNAME]",
                   help="module classes that become units (default for --hf-config: the "
                        "model's _no_split_modules; otherwise only the root unit)")
    p.add_argument("--mixed-precision", default="fp32", choices=PRECISION_NAMES,
                   help="bf16/fp16: compute in that dtype, reduce in fp32")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--quantize", default=None, choices=("weights", "gradients", "both"),
                   help="send the weight all-gathers and/or gradient reductions as int8 blocks "
                        "(shardkit.Quantization)")
    p.add_argument("--quantize-block", type=_quant_block, default=None, metavar="N",
                   help=f"elements per fp32 scale of --quantize, {MIN_QUANT_BLOCK} to "
                        f"{MAX_QUANT_BLOCK} (default 256); needs --quantize")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="HYBRID_SHARD with shard(..., fault_tolerance=...): add the copy of its "
                        "state a rejoining rank receives (see Plan.recovery_bytes)")
    p.add_argument("--optimizer", default="adam", choices=sorted(STATE_TENSORS_PER_PARAM))
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--reshard-after-forward", type=_reshard, default=None,
                   metavar="default|true|false|K")
    p.add_argument("--backend", default=None,
                   help="plan for this backend (cuda, xpu, xla, cpu or a plugin's), from its "
                        "declared capabilities: shard alignment, direct collectives, which "
                        "attention calls run fused; its device need not be here")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="per-rank batch: simulate one forward + backward on the meta device so "
                        "the peak includes activations (token models: input_ids of batch x seq)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per sample (with --batch)")
    p.add_argument("--ac", action="store_true",
                   help="with --batch: activation checkpointing on every unit below the root "
                        "(shardkit.wrap.checkpoint_layers)")
    p.add_argument("--threads-per-rank", type=positive_int, default=None, metavar="N",
                   help="intra-op threads per rank, for kernels whose scratch grows with them "
                        "(default: this process's torch threads)")
    p.add_argument("--measure", action="store_true",
                   help="with --batch: also train the planned step here (--world-size ranks on "
                        "--backend's devices) and print each rank's measured peak beside the "
                        "plan; exit status 1 if a rank exceeded it")
    t = p.add_argument_group("step time at scale (alpha-beta model)")
    t.add_argument("--step-time", metavar="FWD_MS[,BWD_MS[,OPT_MS]]", default=None,
                   help="compute of one step at one rank (the per-rank batch): forward ms, "
                        "backward ms (default 2 x forward), optimizer ms; prints the predicted "
                        "step per world size of --scale")
    t.add_argument("--scale", default=None, metavar="N[,N...]",
                   help="world sizes for --step-time (default: --world-size, 8, 64, 512, 1024)")
    t.add_argument("--link", default="ib", choices=sorted(LINK_NAMES),
                   help="the link between nodes (default ib); inside a node: nvlink")
    t.add_argument("--intra-link", default="nvlink", choices=sorted(LINK_NAMES))
    t.add_argument("--ranks-per-node", type=positive_int, default=8)
    t.add_argument("--link-gbps", type=positive_float, default=None,
                   help="measured bandwidth between nodes, GB/s per rank (overrides --link's)")
    t.add_argument("--link-latency-us", type=non_negative_float, default=None,
                   help="measured latency per ring step between nodes, microseconds")
    tp = p.add_argument_group("tensor parallel inside, shardkit across")
    tp.add_argument("--tp", type=positive_int, default=None, metavar="N",
                    help="torch's tensor parallelism over N consecutive ranks (inside a node); "
                         "--world-size counts every rank, --strategy is the data-parallel one")
    tp.add_argument("--tp-plan", default=None, metavar="MODULE:FUNCTION",
                    help="fn(model, tp_mesh) calling parallelize_module as the training script "
                         "does (default: a transformers model's own tp_plan)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Build the model, plan it and print the table (or JSON)."""
    from .build import plan
    from .models import (default_hf_wrap, from_factory, from_hf_config, hf_config,
                         import_callable, wrap_by_class_names)

    quantize = quantization(args.quantize, args.quantize_block)  # before building the model
    if args.hf_config is not None:
        model = from_hf_config(hf_config(args.hf_config, args.set))
        present = {type(m).__name__ for m in model.modules()}
        wrap_names = [n for n in default_hf_wrap(model) if n in present]
    else:
        if args.set:
            raise ShardkitError("--set overrides a --hf-config setting; with MODULE:FACTORY "
                                "pass arguments through your factory instead")
        model = from_factory(args.target)
        wrap_names = []
    if args.wrap is not None:
        wrap_names = args.wrap.split(",")
    options = dict(auto_wrap_policy=wrap_by_class_names(model, wrap_names),
                   mixed_precision=mixed_precision(args.mixed_precision), optimizer=args.optimizer,
                   hybrid_group_size=args.hybrid_group_size, backend=args.backend,
                   prefetch=args.prefetch, nodes=args.nodes, threads_per_rank=args.threads_per_rank,
                   quantize=quantize)
    heading = (f"model: {type(model).__name__}; units: "
               f"{', '.join(sorted(wrap_names)) or 'the root module only'}")
    if args.step_time is not None and (args.device_memory is not None or args.world_size == "auto"):
        raise ShardkitError("--step-time predicts time at the world sizes of --scale; ask what "
                            "fits (--device-memory, --world-size auto) in a separate command")
    if args.headroom is not None and args.device_memory is None:
        raise ShardkitError("--headroom is the allocator's share of --device-memory; give "
                            "--device-memory too (e.g. --device-memory 80GiB --headroom 30%)")
    if args.measure and (args.batch is None or args.world_size == "auto"
                         or args.device_memory is not None or args.step_time is not None):
        raise ShardkitError("--measure checks one plan with its step: give --batch (and --seq) "
                            "and a number for --world-size, without --device-memory or --step-time")
    if args.tp_plan is not None and args.tp is None:
        raise ShardkitError("--tp-plan needs --tp N (the tensor-parallel degree)")
    if args.tp is not None and (args.device_memory is not None or args.world_size == "auto"
                                or args.step_time is not None or args.measure):
        raise ShardkitError("--tp plans one layout at one --world-size: --device-memory, "
                            "--world-size auto, --step-time and --measure do not take it yet. "
                            "HINT: plan each layout in its own command")
    if args.tp is not None:
        options.update(tp=args.tp, tp_plan=None if args.tp_plan is None else import_callable(
            args.tp_plan, "MODULE:FUNCTION"))
    if args.device_memory is not None or args.world_size == "auto":
        return _fit(args, model, options, heading)
    if args.step_time is not None:
        return _step_time(args, model, options, heading)
    result = plan(model, world_size=args.world_size, strategy=args.strategy,
                  cpu_offload=args.cpu_offload, reshard_after_forward=args.reshard_after_forward,
                  batch=args.batch, seq=args.seq, activation_checkpointing=args.ac,
                  fault_tolerant=args.fault_tolerant, **options)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(heading)
        print(result.table())
    return _measure(args, result, wrap_names) if args.measure else 0


def _measure(args: argparse.Namespace, result: Any, wrap_names: list[str]) -> int:
    """Train the planned step on this machine's devices; print planned vs measured per rank."""
    from ..job.spawn import spawn
    from .measure import MeasureSpec, ModelSource, compare, measured_peak

    if args.cpu_offload and (args.backend or "cpu").split("+")[0] == "cpu":
        raise ShardkitError("--measure with --cpu-offload needs a device apart from the host: "
                            "on the cpu backend the offloaded shards and the device's tensors "
                            "share one memory. HINT: --backend cuda (or xpu) on a machine with "
                            "one")
    source = ModelSource(args.hf_config, tuple(args.set), args.target, tuple(wrap_names))
    shard_kwargs = dict(strategy=args.strategy, cpu_offload=args.cpu_offload,
                        reshard_after_forward=args.reshard_after_forward,
                        mixed_precision=mixed_precision(args.mixed_precision),
                        hybrid_group_size=args.hybrid_group_size, prefetch=args.prefetch,
                        quantize=quantization(args.quantize, args.quantize_block))
    spec = MeasureSpec(source, shard_kwargs, args.ac, args.optimizer, args.batch,
                       args.seq or 1)
    measured = spawn(measured_peak, args.world_size, spec, backend=args.backend,
                     threads_per_rank=args.threads_per_rank)
    report, held = compare(result.peak_bytes, measured, args.backend or "default backend")
    print(report, file=sys.stderr if args.json else sys.stdout)
    return 0 if held else 1


def _step_time(args: argparse.Namespace, model: Any, options: dict[str, Any], heading: str) -> int:
    """--step-time: the alpha-beta model at each world size of --scale."""
    import dataclasses

    from .scale import scale_table, scale_text
    from .steptime import LINKS, Topology

    try:
        parts = [float(v) / 1e3 for v in args.step_time.split(",")]
        worlds = (sorted({args.world_size, 8, 64, 512, 1024}) if args.scale is None
                  else [positive_int(v) for v in args.scale.split(",")])
    except (ValueError, argparse.ArgumentTypeError):
        raise ShardkitError(f"--step-time takes FWD_MS[,BWD_MS[,OPT_MS]] and --scale N[,N...], got "
                            f"{args.step_time!r} and {args.scale!r}") from None
    if not 1 <= len(parts) <= 3 or min(parts) < 0:
        raise ShardkitError(f"--step-time takes one to three non-negative ms values, got {args.step_time!r}")
    forward = parts[0]
    backward = parts[1] if len(parts) > 1 else 2 * forward
    optimizer = parts[2] if len(parts) > 2 else 0.0
    inter = LINKS[args.link]
    if args.link_gbps is not None:
        inter = dataclasses.replace(inter, name="given", bandwidth=args.link_gbps * 1e9)
    if args.link_latency_us is not None:
        inter = dataclasses.replace(inter, name="given", latency_s=args.link_latency_us * 1e-6)
    topology = Topology(LINKS[args.intra_link], inter, args.ranks_per_node)
    rows = scale_table(model, worlds, topology, forward, backward, optimizer,
                       strategy=args.strategy, cpu_offload=args.cpu_offload,
                       reshard_after_forward=args.reshard_after_forward, **options)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        return 0
    print(heading)
    print(scale_text(rows, topology))
    return 0


def _fit(args: argparse.Namespace, model: Any, options: dict[str, Any], heading: str) -> int:
    """--device-memory / --world-size auto: what fits, searched with the recorded step."""
    from .fit import fit_table, largest_batch, smallest_world_size
    from .result import _size

    budget = args.device_memory
    if budget is None:
        raise ShardkitError("--world-size auto finds the fewest ranks that fit a memory budget: "
                            "give --device-memory, e.g. --device-memory 80GiB")
    if args.headroom is not None:
        options = {**options, "headroom": args.headroom}
    one = dict(strategy=args.strategy, cpu_offload=args.cpu_offload,
               activation_checkpointing=args.ac, seq=args.seq,
               reshard_after_forward=args.reshard_after_forward, **options)
    if args.world_size == "auto":
        fits = [smallest_world_size(model, budget, args.batch, **one)]
    elif args.batch is not None:
        fits = [largest_batch(model, args.world_size, budget, **one)]
    else:
        if args.seq is None:
            raise ShardkitError("--device-memory without --batch searches the batch per rank at a "
                                "fixed sequence length: give --seq (tokens per sample), e.g. "
                                "--seq 4096 (--seq 1 for a model without one)")
        if args.reshard_after_forward is not None:
            raise ShardkitError("the what-fits table compares strategies at their own "
                                "--reshard-after-forward defaults: drop it, or give --batch to "
                                "check one configuration")
        strategies = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") + (
            ("HYBRID_SHARD",) if args.hybrid_group_size else ())
        fits = fit_table(model, args.world_size, budget, args.seq, strategies=strategies, **options)
    if args.json:
        print(json.dumps([f.to_dict() for f in fits], indent=2))
        return 0
    print(heading)
    if args.world_size == "auto" or args.batch is not None:
        fit = fits[0]
        if args.batch is not None and args.world_size != "auto":
            verdict = (f"batch {args.batch} fits" if fit.batch >= args.batch else
                       f"batch {args.batch} does NOT fit; the largest that does is {fit.batch}")
            print(f"{verdict} in {_size(budget)} per rank ({fit.summary()})")
            if fit.batch < args.batch:
                return 1
        else:
            print(f"fewest ranks: {fit.summary()}")
        print(fit.plan.table())
        return 0 if fit.fits else 1
    shape = f"x seq {args.seq}" if args.seq else ""
    margin = fits[0].headroom
    kept = (f" ({_size(fits[0].usable_memory)} planned: {margin:.0%} allocator headroom, "
            f"--headroom to change)" if margin else "")
    print(f"largest batch per rank {shape} in {_size(budget)} per rank{kept} on "
          f"{args.world_size} rank(s), {args.mixed_precision}, optimizer {args.optimizer}:")
    print(f"{'strategy':<14} {'act. ckpt':<9} {'cpu_offload':<11} {'batch':>6} {'peak':>10}")
    for fit in fits:
        print(f"{fit.strategy:<14} {'yes' if fit.activation_checkpointing else 'no':<9} "
              f"{'yes' if fit.cpu_offload else 'no':<11} {fit.batch:>6} "
              f"{_size(fit.plan.peak_bytes):>10}")
    print("batch 0: not even one sample fits (peak shown at batch 1). Each row is shardkit.plan "
          "at that batch; one more sample goes over.")
    return 0
