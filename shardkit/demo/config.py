"""What a demo run is made of, without torch: the CLI builds its --help from these in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

# What `shardkit demo --model` offers: the models that take the digits images. The GPT shapes in
# models.py are for benchmarks/ (token inputs); the demo has no text task to feed them.
IMAGE_MODELS = ("shallow", "deep", "mlp")
PRECISION_NAMES = ("none", "bf16", "fp16")
DEFAULT_LR = {"adadelta": 1.0, "adamw": 1e-3}
# What each strategy trades, printed under the demo's figures so the runs can be told apart.
STRATEGY_TRADE = {
    "FULL_SHARD": "parameters, gradients and optimizer state sharded; each unit is gathered for "
                  "forward and again for backward",
    "SHARD_GRAD_OP": "as FULL_SHARD, but a unit's gathered parameters stay from forward to "
                     "backward: one gather per unit per step, more memory at the peak",
    "NO_SHARD": "every rank holds everything; gradients are all-reduced (DDP)",
    "HYBRID_SHARD": "FULL_SHARD inside each shard group, replicated across groups: gradients "
                    "are reduce-scattered in the group, then all-reduced across replicas",
}


@dataclass
class DemoConfig:
    """Everything one demo run needs; it is pickled to every rank."""

    model: str = "shallow"
    strategy: str = "FULL_SHARD"
    hybrid_group_size: int | None = None  # HYBRID_SHARD: ranks per shard group
    epochs: int = 6
    batch_size: int = 32
    optimizer: str = "adadelta"
    lr: float | None = None
    mixed_precision: str = "none"
    seed: int = 1
    nproc: int = 2
    backend: str | None = None
    threads_per_rank: int | None = None
    limit_train: int | None = None
    progress: bool = True
