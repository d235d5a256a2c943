"""ShardkitStrategy: Lightning's Trainer training on shardkit's engine, on any shardkit backend.

The LightningModule is sharded in place (parameter names unchanged), so Lightning's model and
its LightningModule stay one object: Lightning calls `training_step` and the other step methods
directly, and each is registered as a forward method so that it runs inside the root unit's
gather/reshard hooks (a `self(x)` inside it does not run them twice). Checkpoints are shardkit's
sharded ones (a directory; reload at any world size), with Lightning's own state (loops,
callbacks, schedulers) as the checkpoint's `extra`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.fabric.utilities.seed import reset_seed
from typing_extensions import override

from ..errors import ShardkitError
from .common import RankPlace, join_job, shard_module
from .precision import clip_over_shards

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class ShardkitStrategy(RankPlace, ParallelStrategy):
    """Trainer(strategy=ShardkitStrategy(...)) or Trainer(strategy="shardkit"): shardkit.shard() the LightningModule."""

    strategy_name = "shardkit"

    def __init__(self, strategy: Any = "FULL_SHARD", auto_wrap_policy: Any = None,
                 backend: str | None = None, timeout: float | timedelta | None = None,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, **shard_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._keep_options("ShardkitStrategy", strategy, auto_wrap_policy, backend, timeout,
                           shard_options)

    # ---- where this rank is -----------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Lightning adds a DistributedSampler when this is True."""
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shardkit loads into the sharded model and its optimizer

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                       self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # As the Trainer's DDP and FSDP strategies do: back to the seed_everything() seed, so
        # random draws from here on (dropout) are DDP's, whatever building the model consumed.
        reset_seed()
        self.set_world_ranks()
        join_job(self, self._backend, self._timeout)

    # ---- the model --------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._setup_model(self.model)
        clip_over_shards(self.precision_plugin, self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from ..sharding.surface.forward_methods import register_forward_method

        model = shard_module(model, self._shard_options, self.precision_plugin.precision,
                             self._backend, self.root_device)
        for name in STEP_METHODS:
            if callable(getattr(model, name, None)):
                register_forward_method(model, name)
        return model

    @override
    def model_to_device(self) -> None:
        pass  # shard() puts the shards on the backend's device

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Layers made in configure_model (or under trainer.init_module()) go on the meta device
        # unless empty_init=False: shard() then materialises them unit by unit, straight into
        # shards, so no rank ever holds the whole model.
        device = nullcontext() if empty_init is False else torch.device("meta")
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """accumulate_grad_batches: backward without reducing, as shardkit's no_sync does."""
        no_sync = getattr(self.model, "no_sync", None)
        with no_sync() if no_sync is not None else nullcontext():
            yield

    # ---- collectives for Lightning's own use (metrics, logging, decisions) -------------------
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- checkpoints ------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights go into the sharded checkpoint, not into Lightning's dict

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        from ..checkpoint import save

        if storage_options is not None:
            raise TypeError("ShardkitStrategy.save_checkpoint(storage_options=...) is not "
                            "supported: shardkit writes its sharded checkpoint itself")
        path = self.broadcast(os.fspath(filepath))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save(path, self.model, self._the_optimizer(), extra=meta)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from ..checkpoint import load

        path = self.broadcast(os.fspath(checkpoint_path))
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        meta = load(path, self.model, self._the_optimizer() if fitting else None,
                    strict=module.strict_loading)
        return dict(meta or {})

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint() loaded the weights into the shards

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def _the_optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise ShardkitError(
                f"strategy='shardkit' checkpoints one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}. HINT: use one optimizer with several param groups")
        return self.optimizers[0] if self.optimizers else None

    # ---- registration ------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "shardkit", cls, description="shardkit: sharded data parallel on any shardkit backend",
            override=True)


# Registered here as well: imported before Lightning, this module is what loads Lightning's
# strategies, and the registration hook (registration.py) then finds the class not yet defined.
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402 - complete by now: this module's imports loaded it

ShardkitStrategy.register_strategies(StrategyRegistry)
