"""`shardkit plan`: print a model's per-rank memory and traffic before launching anything."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..cli.args import ENVIRONMENT_HELP, STRATEGY_NAMES, positive_int
from ..errors import ShardkitError
from .optimizers import STATE_TENSORS_PER_PARAM

PRECISION_NAMES = ("bf16", "fp16", "fp32")


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
                    "activations included, simulated on meta) and the bytes each rank sends per "
                    "step.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("target", nargs="?", metavar="MODULE:FACTORY",
                     help="a callable returning an nn.Module (called under torch.device('meta'))")
    src.add_argument("--hf-config", metavar="NAME_OR_JSON",
                     help="a transformers model type (gpt2, llama, t5, ...) or a config.json path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a --hf-config setting (repeatable), e.g. --set n_layer=24")
    p.add_argument("--world-size", type=positive_int, required=True)
    p.add_argument("--strategy", default="FULL_SHARD", type=str.upper,
                   choices=STRATEGY_NAMES)
    p.add_argument("--hybrid-group-size", type=positive_int, default=None,
                   help="HYBRID_SHARD shard group size (default: the world size)")
    p.add_argument("--wrap", default=None, metavar="CLASSNAME[,CLASSNAME]",
                   help="module classes that become units (default for --hf-config: the "
                        "model's _no_split_modules; otherwise only the root unit)")
    p.add_argument("--mixed-precision", default="fp32", choices=PRECISION_NAMES,
                   help="bf16/fp16: compute in that dtype, reduce in fp32")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--optimizer", default="adam", choices=sorted(STATE_TENSORS_PER_PARAM))
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--reshard-after-forward", type=_reshard, default=None,
                   metavar="default|true|false|K")
    p.add_argument("--backend", default=None,
                   help="take the shard alignment from this backend's capabilities")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="per-rank batch: simulate one forward + backward on the meta device so "
                        "the peak includes activations (token models: input_ids of batch x seq)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per sample (with --batch)")
    p.add_argument("--ac", action="store_true",
                   help="with --batch: activation checkpointing on every unit below the root "
                        "(shardkit.wrap.checkpoint_layers)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Build the model, plan it and print the table (or JSON)."""
    from .build import plan
    from .models import (default_hf_wrap, from_factory, from_hf_config, hf_config,
                         wrap_by_class_names)

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
    result = plan(model, world_size=args.world_size, strategy=args.strategy,
                  auto_wrap_policy=wrap_by_class_names(model, wrap_names),
                  mixed_precision=mixed_precision(args.mixed_precision), cpu_offload=args.cpu_offload,
                  optimizer=args.optimizer, hybrid_group_size=args.hybrid_group_size,
                  backend=args.backend, prefetch=args.prefetch,
                  reshard_after_forward=args.reshard_after_forward, batch=args.batch,
                  seq=args.seq, activation_checkpointing=args.ac)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"model: {type(model).__name__}; units: "
              f"{', '.join(sorted(wrap_names)) or 'the root module only'}")
        print(result.table())
    return 0
