"""`shardkit.replicate()`: torch's DistributedDataParallel, configured for the backend in use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ShardkitError

if TYPE_CHECKING:  # torch is imported on the first call: `import shardkit` stays cheap
    import torch

    from .backend import Backend


def replicate(model: torch.nn.Module, backend: str | Backend | None = None,
              **ddp_kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """Move `model` to this rank's device and wrap it in DDP with the backend's required options.

    The backend supplies what DDP needs on its device (device_ids on GPUs,
    gradient_as_bucket_view on XLA, nothing on CPU); keyword arguments given here win over it.
    Initialises shardkit from the launcher's environment if nobody has yet.
    """
    from torch.nn.parallel import DistributedDataParallel

    from .job.runtime import require_context

    if "quantize" in ddp_kwargs:  # shard()'s option; DDP would answer with a TypeError of its own
        raise ShardkitError(
            "replicate() is torch's DDP and sends exact gradients; quantized collectives are "
            "shard()'s. HINT: shardkit.shard(model, strategy='NO_SHARD', "
            "quantize=shardkit.Quantization(gradients=True)) replicates the model and sends its "
            "gradient all-reduce as int8 blocks")

    ctx = require_context(backend)
    model = model.to(ctx.device)
    options = {**ctx.backend.devices.ddp_kwargs(ctx.device), **ddp_kwargs}
    if "process_group" not in options and ctx.world.handle is not None:
        options["process_group"] = ctx.world.handle
    return DistributedDataParallel(model, **options)
