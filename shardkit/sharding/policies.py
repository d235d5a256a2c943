"""User-facing sharding policies as frozen values: strategy, mixed precision, and the full config."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ShardkitError
from ..suggest import did_you_mean


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks."""

    FULL_SHARD = "full_shard"  # ZeRO-3: params resharded after forward and after backward
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2-like: gathered params kept from forward to backward
    NO_SHARD = "no_shard"  # replicated params, gradients all-reduced (DDP semantics)
    HYBRID_SHARD = "hybrid_shard"  # shard inside groups of k ranks, replicate across groups

    @classmethod
    def parse(cls, value: "ShardingStrategy | str") -> "ShardingStrategy":
        """Accept a member or its name in any case ("full_shard", "FULL_SHARD")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        names = ", ".join(m.name for m in cls)
        hint = did_you_mean(value, [m.name for m in cls]) if isinstance(value, str) else ""
        raise ShardkitError(f"unknown sharding strategy {value!r}{hint or ';'} choose one of {names}")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers; the sharded parameters stay the master copy."""

    param_dtype: torch.dtype | None = None  # dtype params are gathered and computed in
    reduce_dtype: torch.dtype | None = None  # dtype gradients are reduced in (default: param_dtype)
    buffer_dtype: torch.dtype | None = None  # dtype buffers are cast to during forward
    cast_forward_inputs: bool = True  # cast floating-point forward inputs of every unit to param_dtype
    # dtype the model's floating-point outputs are cast to (e.g. fp32 logits for the loss). Only
    # the root's: inner units' outputs feed the root's own layers, which compute in param_dtype.
    output_dtype: torch.dtype | None = None


MIN_QUANT_BLOCK, MAX_QUANT_BLOCK = 8, 1 << 20  # Quantization.block_size's bounds


@dataclass(frozen=True)
class Quantization:
    """Which collectives travel as block-quantized int8 (ZeRO++ qwZ / qgZ); masters stay exact.

    weights: each unit's all-gather over the shard group sends int8 codes and one fp32 scale per
    `block_size` elements of compute-dtype weights (about 1/4 of fp32's bytes, 1/2 of bf16's);
    every rank decodes the same bytes. gradients: every gradient reduction that spans ranks (the
    shard group's, the replicas' all-reduce) sends int8 blocks through an all-to-all and each
    rank sums what it receives in fp32, so quantized values are never summed. Gathers for
    state_dict, checkpoints and summon-style full views stay exact, as does the intra-group
    re-gather of an integer reshard_after_forward.
    """

    weights: bool = False
    gradients: bool = False
    # 256: 4 scale bytes per 256 codes is 1.6 % on the wire, and one large value spoils at most
    # 256 neighbours' resolution (benchmarks/bench_quantize.py measures error per block size).
    block_size: int = 256

    def __post_init__(self) -> None:
        for name in ("weights", "gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ShardkitError(f"Quantization.{name} must be True or False, got "
                                    f"{getattr(self, name)!r}")
        block = self.block_size
        if (isinstance(block, bool) or not isinstance(block, int)
                or not MIN_QUANT_BLOCK <= block <= MAX_QUANT_BLOCK):
            raise ShardkitError(f"Quantization.block_size must be an int in [{MIN_QUANT_BLOCK}, "
                                f"{MAX_QUANT_BLOCK}] (elements per fp32 scale), got {block!r}")


@dataclass(frozen=True)
class FaultTolerance:
    """HYBRID_SHARD that keeps training when a replica group fails (torchft; `pip install 'shardkit[ft]'`).

    Each replica group is its own job (its own launcher, its own shardkit.init()), sharding the
    model across its ranks; the gradient all-reduce across groups runs through a torchft Manager,
    which forms a quorum of the live groups each step (through the lighthouse), commits a step
    only if every rank of every group in it succeeded, and hands a restarted group the current
    weights and optimizer state from a healthy group over the network.

    replica_group: this group's number (0, 1, ...), the same on every rank of the group;
    lighthouse: the torchft lighthouse's address ("http://host:29510"; None reads
    TORCHFT_LIGHTHOUSE); min_replica_groups: the fewest groups a step may commit with; timeout_s:
    how long a collective, a commit vote or a recovery may take before the step is dropped;
    quorum_timeout_s: how long to wait for a quorum (the lighthouse unreachable ends the job
    after it); connect_timeout_s: how long shard() waits for the lighthouse to answer at the
    start (at most quorum_timeout_s), before it says it cannot reach it.
    """

    replica_group: int
    lighthouse: str | None = None
    min_replica_groups: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        group = self.replica_group
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise ShardkitError(f"FaultTolerance.replica_group must be this group's number, an "
                                f"int >= 0, got {group!r}")
        low = self.min_replica_groups
        if isinstance(low, bool) or not isinstance(low, int) or low < 1:
            raise ShardkitError(f"FaultTolerance.min_replica_groups must be an int >= 1, got "
                                f"{low!r}")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ShardkitError(f"FaultTolerance.{name} must be a number of seconds > 0, "
                                    f"got {value!r}")
        if self.lighthouse is not None and not isinstance(self.lighthouse, str):
            raise ShardkitError(f"FaultTolerance.lighthouse must be an address such as "
                                f"'http://host:29510', got {self.lighthouse!r}")


@dataclass(frozen=True)
class ShardConfig:
    """Everything shard() was asked for, normalised; one per sharded model."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision
    cpu_offload: bool
    prefetch: int  # unshards allowed in flight ahead of the one being used; 0 disables prefetch
    hybrid_group_size: int | None
    param_init_fn: Callable[[torch.nn.Module], Any] | None = None
    quantization: Quantization = Quantization()

    @classmethod
    def build(cls, strategy: "ShardingStrategy | str", mixed_precision: MixedPrecision | None,
              cpu_offload: bool, prefetch: int, hybrid_group_size: int | None,
              param_init_fn: Callable[[torch.nn.Module], Any] | None = None,
              quantization: "Quantization | None" = None) -> "ShardConfig":
        """Check and normalise what shard() (or plan()) was given; raise a clear error on bad values."""
        mp = mixed_precision or MixedPrecision()
        if not isinstance(mp, MixedPrecision):
            raise ShardkitError(f"mixed_precision must be a shardkit.MixedPrecision, got "
                                f"{type(mp).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ShardkitError(f"prefetch must be an int >= 0 (0 disables prefetch), got "
                                f"{prefetch!r}")
        if quantization is None:
            quantization = Quantization()
        elif not isinstance(quantization, Quantization):  # 0, "" or False would mean "exact"
            raise ShardkitError(f"quantize must be a shardkit.Quantization (e.g. "
                                f"Quantization(weights=True, gradients=True)) or None for exact "
                                f"collectives, got {quantization!r}")
        parsed = ShardingStrategy.parse(strategy)
        if parsed is ShardingStrategy.NO_SHARD and quantization.weights:
            raise ShardkitError("Quantization(weights=True) under NO_SHARD quantizes nothing: "
                                "NO_SHARD keeps whole weights on every rank and gathers none. "
                                "HINT: Quantization(gradients=True) quantizes its gradient "
                                "all-reduce; FULL_SHARD or SHARD_GRAD_OP gather weights")
        return cls(parsed, mp, bool(cpu_offload), prefetch, hybrid_group_size, param_init_fn,
                   quantization)

    @property
    def reshard_after_forward(self) -> bool:
        """FULL_SHARD and HYBRID_SHARD free gathered params after forward; the others keep them."""
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype a parameter is gathered and used in during forward and backward."""
        return self.mixed_precision.param_dtype or master

    def reduce_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype a gradient is reduced in."""
        mp = self.mixed_precision
        return mp.reduce_dtype or mp.param_dtype or master
