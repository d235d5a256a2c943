"""ShardkitFabricStrategy: Lightning Fabric on shardkit's engine (`Fabric(strategy="shardkit")`).

Fabric hands the strategy the user's module (and optimizers built before it, as
`fabric.setup(model, optimizer)` allows): the module is sharded in place, and since sharding
replaces each parameter by its shard, an optimizer made before is pointed at the shards by
parameter name (it must not have state yet). Checkpoints are shardkit's sharded ones with the
other entries of Fabric's `state` dict as their `extra`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from typing_extensions import override

from ..errors import ShardkitError
from .common import RankPlace, join_job, shard_module


class _NoSync(_BackwardSyncControl):
    """fabric.no_backward_sync(model): shardkit's no_sync (gradients kept unreduced, then summed)."""

    @override
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Any:
        return module.no_sync() if enabled else nullcontext()  # type: ignore[operator]


class ShardkitFabricStrategy(RankPlace, ParallelStrategy):
    """Fabric(strategy=ShardkitFabricStrategy(...)) or Fabric(strategy="shardkit"): shard() the module."""

    def __init__(self, strategy: Any = "FULL_SHARD", auto_wrap_policy: Any = None,
                 backend: str | None = None, timeout: float | timedelta | None = None,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision: Any = None, **shard_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision)
        # Fabric sets num_nodes from Fabric(num_nodes=) afterwards.
        self._keep_options("ShardkitFabricStrategy", strategy, auto_wrap_policy, backend,
                           timeout, shard_options)
        self._backward_sync_control = _NoSync()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                       self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        join_job(self, self._backend, self._timeout)

    # ---- module and optimizers --------------------------------------------------------------
    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return shard_module(module, self._shard_options, self.precision.precision,
                            self._backend, self.root_device)

    @override
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list, scheduler: Any = None):
        names = {id(p): n for n, p in module.named_parameters()}
        for opt in optimizers:
            if opt.state:
                raise ShardkitError(
                    "fabric.setup(model, optimizer): the optimizer has already stepped, and "
                    "sharding replaces each parameter by its shard. HINT: set the model up first "
                    "(model = fabric.setup_module(model)), then make the optimizer from "
                    "model.parameters() and fabric.setup_optimizers(optimizer)")
        module = self.setup_module(module)
        shards = dict(module.named_parameters())
        for opt in optimizers:
            for group in opt.param_groups:
                try:
                    group["params"] = [shards[names[id(p)]] for p in group["params"]]
                except KeyError:
                    raise ShardkitError("fabric.setup(model, optimizer): the optimizer holds a "
                                        "parameter that is not the model's") from None
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: torch.nn.Module) -> None:
        pass  # shard() puts the shards on the backend's device

    @override
    def module_init_context(self, empty_init: bool | None = None) -> Any:
        # fabric.init_module(empty_init=True): layers on the meta device, materialised by
        # shard() unit by unit straight into shards.
        return self._meta_init(empty_init)

    @contextmanager
    def _meta_init(self, empty_init: bool | None) -> Generator[None, None, None]:
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision.module_init_context():
            yield

    @override
    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        from ..sharding.surface.clip import clip_grad_norm_

        self.precision.unscale_gradients(optimizer)
        norm = clip_grad_norm_(module, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm.item()}; "
                               "error_if_nonfinite=True")
        return norm

    # ---- collectives for Fabric's own use ---------------------------------------------------
    @override
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- checkpoints ------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict | None = None) -> None:
        from ..checkpoint import save

        if storage_options is not None or filter is not None:
            raise TypeError("fabric.save with strategy='shardkit' takes no storage_options or "
                            "filter: shardkit writes its sharded checkpoint itself")
        module, optimizer, rest = _split_state(state)
        save(self.broadcast(str(path)), module, optimizer, extra=rest)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        from ..checkpoint import load

        if not isinstance(state, dict) or not state:
            raise ShardkitError("fabric.load with strategy='shardkit' loads into the objects it "
                                "is given: pass the state dict you saved (model, optimizer, ...)")
        module, optimizer, rest = _split_state(state)
        extra = dict(load(self.broadcast(str(path)), module, optimizer, strict=strict) or {})
        for key in rest:
            if key in extra:
                state[key] = extra.pop(key)
            elif strict:
                raise ShardkitError(f"fabric.load: {key!r} is not in the checkpoint {path} "
                                    f"(it has {sorted(extra)})")
        return extra

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "shardkit", cls, description="shardkit: sharded data parallel on any shardkit backend",
            override=True)


def _split_state(state: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer | None, dict]:
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    if len(modules) != 1 or len(optimizers) > 1:
        raise ShardkitError(
            f"a shardkit checkpoint holds one sharded model and at most one optimizer; this state "
            f"has models {sorted(modules)} and optimizers {sorted(optimizers)}")
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return next(iter(modules.values())), next(iter(optimizers.values()), None), rest


# Registered here as well: imported before Lightning, this module is what loads Lightning's
# strategies, and the registration hook (registration.py) then finds the class not yet defined.
from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: E402 - complete by now: this module's imports loaded it

ShardkitFabricStrategy.register_strategies(STRATEGY_REGISTRY)
