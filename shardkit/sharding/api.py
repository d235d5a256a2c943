"""`shardkit.shard()`: turn a model into a sharded data-parallel model, in place.

shard() runs five named steps: _decide (options, the unit plan, the same on every rank),
_make_runtime (groups, from the user's DeviceMesh where one is given, the model's ShardState,
the parameter form and its DeviceMesh),
_shard_parameters (materialise, buffers, rank 0's values where asked, a ShardedParam per
parameter), _make_units (units and their hooks), and _hand_over (torch's idioms see whole
parameters; the model becomes sharded), with the replica check between the last two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..backend import Backend
from ..errors import ShardkitError
from ..handles import Group
from ..logs import logger
from ..job.runtime import DistContext, require_context
from .wrap_policies import WrapPolicy, as_policy
from .step import hooks
from .setup.fingerprint import check_same_model, describe
from .setup.stale_optimizer import remember_replaced
from .step.verify import maybe_wrap
from .setup.groups import GroupMaker, make_groups, make_node_hops, shard_group_size
from .setup.mesh import (all_shard_groups, check_mesh, check_tensor_parallel_options, describe_mesh,
                         groups_from_mesh, tensor_parallel_meshes)
from .setup.materialize import has_meta, materialize
from .surface.module_api import STATE_ATTR, sharded_class
from .surface.param_access import is_sharded_param, remember_params
from .step.whole_view import ParamForm, choose_form, forget_released_meshes, is_dtensor
from .surface import state_dict_hooks, torch_norms
from .step.param import ShardedParam
from .setup.plan import ParamPlan, UnitPlan, all_param_plans, plan_units
from .policies import FaultTolerance, MixedPrecision, Quantization, ShardConfig, ShardingStrategy
from .setup.report import log_sharding
from .setup.replicas import broadcast_from_first, check_replicas
from .setup.reshard import ReshardSpec, frees_without_backward, make_reshard_groups, resolve
from .step.state import ShardState
from .step.unit import ShardUnit


def _config(strategy, mixed_precision, cpu_offload, prefetch, hybrid_group_size,
            param_init_fn, backend: Backend, quantize: Quantization | None = None) -> ShardConfig:
    config = ShardConfig.build(strategy, mixed_precision, cpu_offload, prefetch,
                               hybrid_group_size, param_init_fn, quantize)
    _check_quantization(config, backend)
    mp = config.mixed_precision
    for field_name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
        dtype = getattr(mp, field_name)
        if dtype is not None and not backend.devices.supports_dtype(dtype):
            raise ShardkitError(f"backend {backend.name!r} does not support {dtype} "
                                f"(MixedPrecision.{field_name}); HINT: use one of "
                                f"{sorted(str(d) for d in backend.capabilities.supported_dtypes)}")
    return config


def _check_quantization(config: ShardConfig, backend: Backend) -> None:
    check_quantization_support(config.quantization, type(backend))


def check_quantization_support(quantization: Quantization, backend_cls: type[Backend]) -> None:
    """Refuse quantized reductions where the backend has no all-to-all to move them with.

    One check for shard() and the planner (which passes the target's registered class, never
    started): a plan must not count bytes that shard() would refuse to send."""
    # A pair's collectives are its collective side's class's (composed.py).
    collectives_cls = getattr(backend_cls, "collectives_class", backend_cls)
    inherited = getattr(collectives_cls, "all_to_all_single", None) is Backend.all_to_all_single
    if (quantization.gradients and inherited
            and not backend_cls.capabilities.torch_process_group):
        raise ShardkitError(
            f"Quantization(gradients=True) moves int8 blocks with an all-to-all, and backend "
            f"{backend_cls.name!r} has none (its collectives do not run on a torch process group "
            "and it does not override Backend.all_to_all_single); HINT: quantize the weights only "
            "(Quantization(weights=True)), or implement all_to_all_single in the backend plugin")


def _check_not_sharded(model: nn.Module, mesh: object = None) -> None:
    for name, module in model.named_modules():
        if STATE_ATTR in module.__dict__:
            where = f"submodule {name!r}" if name else "the model"
            raise ShardkitError(f"{where} is already sharded; call shardkit.shard() once, on the "
                                "root model, and choose units with auto_wrap_policy=")
    for name, param in model.named_parameters():
        if is_sharded_param(param):  # a part of a model sharded before (e.g. model[0])
            raise ShardkitError(f"parameter {name!r} of this {type(model).__name__} already "
                                "belongs to a sharded model (the module is part of one); call "
                                "shardkit.shard() once, on the root model, and make this module "
                                "a unit with auto_wrap_policy=")
        if is_dtensor(param) and mesh is None:
            # torch's tensor parallelism (parallelize_module) or FSDP2's fully_shard made it: the
            # engine would copy a DTensor into plain rows (torch: "got mixed torch.Tensor and
            # DTensor"). Composing with them is issue 51's work.
            placements = tuple(getattr(param, "placements", ()))
            raise ShardkitError(
                f"parameter {name!r} is already a DTensor (placements {placements}, on "
                f"{getattr(param, 'device_mesh', 'a DeviceMesh')}): the model was sharded by "
                "torch's tensor parallelism (parallelize_module) or FSDP2 (fully_shard), which "
                "shard() composes with only when given the data-parallel mesh. HINT: for tensor "
                "parallel x data parallel pass mesh=mesh['dp'] (the other dimension of the mesh "
                "you gave parallelize_module); after fully_shard, pass shard() the plain model")


def _fault_tolerant_group(config: FaultTolerance | None, strategy, hybrid_group_size: int | None,
                          ctx: DistContext) -> int | None:
    """The shard group size under fault tolerance (the whole job: one replica group); checks the config."""
    if config is None:
        return hybrid_group_size
    if not isinstance(config, FaultTolerance):
        raise ShardkitError(f"fault_tolerance must be a shardkit.FaultTolerance (e.g. "
                            f"FaultTolerance(replica_group=0)), got {type(config).__name__}")
    if ShardingStrategy.parse(strategy) is not ShardingStrategy.HYBRID_SHARD:
        raise ShardkitError(
            f"fault_tolerance= needs strategy HYBRID_SHARD (shard inside this replica group, "
            f"replicate across groups), got {ShardingStrategy.parse(strategy).name}. HINT: pass "
            "strategy='hybrid_shard'; each replica group is its own launch")
    n = ctx.world.size
    if hybrid_group_size not in (None, n):
        raise ShardkitError(
            f"with fault_tolerance= each launched job is one replica group and shards across all "
            f"of its {n} ranks, so hybrid_group_size must be left out (or be {n}), got "
            f"{hybrid_group_size}. HINT: launch one job per replica group")
    return n


def _sync_module_states(requested: bool | None, backend: Backend) -> bool:
    if not backend.capabilities.holds_values:
        return False  # no values to copy
    if requested is not None:
        if not isinstance(requested, bool):
            raise ShardkitError(f"sync_module_states must be True, False or None, got "
                                f"{requested!r}")
        return requested
    if backend.capabilities.ranks_share_process:
        # Ranks that are threads share torch's RNG: the same seed in every rank still races,
        # so rank 0's values are copied instead of compared.
        logger.info("shard(): ranks share one process (%s): copying rank 0's parameters and "
                    "buffers to every rank (sync_module_states=True)", backend.name)
        return True
    return False


def shard(model: nn.Module, strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
          auto_wrap_policy: WrapPolicy | Callable[[nn.Module], bool] | None = None,
          mixed_precision: MixedPrecision | None = None, device_id=None,
          backend: str | Backend | None = None, cpu_offload: bool = False,
          param_init_fn: Callable[[nn.Module], object] | None = None, prefetch: int = 1,
          hybrid_group_size: int | None = None, verify: bool | None = None,
          reshard_after_forward: ReshardSpec = None,
          sync_module_states: bool | None = None,
          quantize: Quantization | None = None,
          fault_tolerance: FaultTolerance | None = None, mesh=None) -> nn.Module:
    """Shard `model` in place over the data-parallel ranks and return it (names unchanged).

    - strategy: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (gathered params kept from forward to
      backward), NO_SHARD (replicated, grads all-reduced), HYBRID_SHARD (shard inside groups of
      `hybrid_group_size` ranks, default the local world size; replicate across groups).
    - auto_wrap_policy: which submodules become units (shardkit.wrap.* or any callable(module)
      -> bool); the rest belongs to the root unit. A parameter shared by several units (tied
      weights) belongs to their nearest common unit, which stays gathered while they run.
    - mixed_precision: compute/reduce/buffer dtypes; the sharded params stay the master copy.
    - device_id: the compute device (int, "type", "type:i" or torch.device; the backend
      normalises it). cpu_offload=True keeps shards and grads on the host (the optimizer steps
      there). A model on the meta device is materialised module by module on that device with
      param_init_fn(module) or module.reset_parameters(), and sharded as it goes.
    - prefetch: how many next units' all-gathers may be in flight ahead of use (0: none);
      model.set_forward_prefetch / set_backward_prefetch(unit, [units]) override it per unit.
    - reshard_after_forward: None (the strategy's: FULL_SHARD/HYBRID True, SHARD_GRAD_OP False),
      True (free gathered params after forward), False (keep them for backward), or an int k
      dividing the shard group size N: keep a 1/k slice after forward and all-gather inside
      groups of k consecutive ranks in backward (ZeRO++ hpZ; k == N is True, k == 1 False).
      Per unit: a dict {unit name: value} ("<root>" for the root) or a callable(name, module).
      Left to the default under FULL_SHARD and HYBRID_SHARD, the root unit keeps its parameters
      from forward to backward (as FSDP2's root: one all-gather of the root fewer per step, no
      higher peak), and frees them after a forward under no_grad.
    - verify: check before every collective that all ranks issue the same one, and raise naming
      the first difference instead of hanging (default: on when SHARDKIT_DEBUG=1; costs a store
      round trip per collective).
    - sync_module_states: True copies rank 0's parameters (before sharding; after
      materialisation from meta) and buffers to every rank, so the model is exactly rank 0's.
      False (the default where ranks are processes) instead compares everything replicated
      (each parameter's shard across its replicas, every buffer across all ranks) and raises,
      naming the first difference, if ranks built different values. None: True where ranks are
      threads of one process (Capabilities.ranks_share_process), else False.
    - quantize: shardkit.Quantization(weights=..., gradients=..., block_size=256): send the
      parameter all-gathers and/or the gradient reductions as block-quantized int8 (ZeRO++
      qwZ / qgZ), for jobs bound by a slow link; the sharded master weights stay exact.
    - fault_tolerance: shardkit.FaultTolerance(replica_group=N, lighthouse=...) with
      HYBRID_SHARD: this job is one replica group (sharded across its ranks); the gradient
      all-reduce across groups runs through torchft, so the other groups keep training when one
      fails and a restarted group rejoins live. Wrap the optimizer with
      shardkit.fault_tolerant_optimizer(model, optimizer).
    - mesh: a torch DeviceMesh for the data-parallel dimension(s), as FSDP2's mesh=: one
      dimension for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, two (replicate, shard) for
      HYBRID_SHARD. Over every rank (in init_device_mesh's rank order), or, for a model torch's
      tensor parallelism made (parallelize_module on mesh["tp"]), the other dimension(s) of the
      same mesh (mesh["dp"]): TP stays inside, shardkit shards across. The collectives run on its
      process groups and the parameters are DTensors on it (and TP's dimension). None (the
      default): shardkit makes the groups.
    Afterwards each of model.parameters() (what the optimizer owns) is a DTensor of the whole
    parameter whose local tensor is this rank's rows (dim-0 Shard over the shard group;
    Replicate where a shard group is one rank: NO_SHARD, a world of one), wherever the backend's
    groups are torch process groups; on a backend without them (XLA), the plain tensor of this
    rank's rows (dimensions kept, zero padding rows);
    model.no_sync(), model.set_requires_gradient_sync() and model.unshard() are available, and
    the model's context (backend, groups) lives on the model, not in process-global state.
    """
    if not isinstance(model, nn.Module):
        raise ShardkitError(f"shard() needs an nn.Module, got {type(model).__name__}")
    _check_not_sharded(model, mesh)
    forget_released_meshes()  # torch's op caches may still hold a dead model's mesh
    ctx = require_context(backend)
    hybrid_group_size = _fault_tolerant_group(fault_tolerance, strategy, hybrid_group_size, ctx)
    choices = _decide(model, ctx, strategy, auto_wrap_policy, mixed_precision, device_id,
                      cpu_offload, param_init_fn, prefetch, hybrid_group_size,
                      reshard_after_forward, sync_module_states, quantize, mesh,
                      fault_tolerance is not None)
    state, reshard_groups, form = _make_runtime(ctx, choices, verify)
    if fault_tolerance is not None:
        from ..fault_tolerance.cross_groups import start
        state.cross_groups = start(fault_tolerance, ctx.backend, ctx, state)
    by_param = _shard_parameters(model, ctx, choices, state, form)
    _make_units(state, choices, by_param, reshard_groups)
    if not choices.sync and ctx.backend.capabilities.holds_values:
        check_replicas([(sp.fqn, sp.local) for sp in state.iter_params()], state.replica_group,
                       list(model.named_buffers()), ctx.world, ctx.backend, choices.device)
    _hand_over(model, state, form)
    return model


@dataclass(frozen=True)
class _Choices:
    """What shard() decided from its arguments, the backend and the model, before any group."""

    device: torch.device
    config: ShardConfig
    units: list[UnitPlan]
    hybrid_group_size: int | None
    reshard: list[bool | int]
    free_without_backward: list[bool]
    sync: bool
    mesh: object = None  # the user's DeviceMesh, or None
    tp_mesh: object = None  # the mesh of the model's tensor-parallel parameters, or None


def _decide(model: nn.Module, ctx: DistContext, strategy, auto_wrap_policy, mixed_precision,
            device_id, cpu_offload, param_init_fn, prefetch, hybrid_group_size,
            reshard_after_forward, sync_module_states, quantize=None, mesh=None,
            fault_tolerant: bool = False) -> _Choices:
    """Resolve every option and the unit plan; check that every rank decided the same."""
    be = ctx.backend
    device = ctx.device if device_id is None else be.devices.normalize_device(device_id, ctx.local_rank)
    tp_meshes = tensor_parallel_meshes(model) if mesh is not None else []
    if mesh is not None:
        hybrid_group_size = check_mesh(mesh, ShardingStrategy.parse(strategy), hybrid_group_size,
                                       fault_tolerant, ctx.world, be, device.type, tp_meshes)
    config = _config(strategy, mixed_precision, cpu_offload, prefetch, hybrid_group_size,
                     param_init_fn, be, quantize)
    units = plan_units(model, as_policy(auto_wrap_policy))
    if mesh is not None and config.strategy is not ShardingStrategy.NO_SHARD:
        n_shard = int(mesh.shape[-1])  # the mesh's shard dimension: beside TP, less than the world
    else:
        n_shard = shard_group_size(config.strategy, hybrid_group_size, ctx.env.local_world_size,
                                   ctx.world.size)
    reshard = resolve(reshard_after_forward, units, config, n_shard)
    sync = _sync_module_states(sync_module_states, be)
    if tp_meshes:
        # (a rehearsal's meta model is its own device, nothing to initialise)
        check_tensor_parallel_options(config.strategy, sync,
                                      has_meta(model) and be.capabilities.holds_values,
                                      config.cpu_offload, bool(config.quantization.weights
                                                               or config.quantization.gradients))
    if be.capabilities.holds_values:  # a rehearsal has no peers to ask
        check_same_model(describe(units, config) + [f"reshard_after_forward: {reshard}",
                                                    f"sync_module_states: {sync}",
                                                    describe_mesh(mesh)],
                         ctx.world)  # before any group
    if not any(u.params for u in units):
        raise ShardkitError(f"shard() got a model with no parameters ({type(model).__name__}): "
                            "there is nothing to shard or train. HINT: pass the model whose "
                            "parameters you train, with its layers already built")
    return _Choices(device, config, units, hybrid_group_size, reshard,
                    frees_without_backward(reshard_after_forward, units, config), sync, mesh,
                    tp_meshes[0] if tp_meshes else None)


def _make_runtime(ctx: DistContext, choices: _Choices,
                  verify: bool | None) -> tuple[ShardState, dict[int, Group], ParamForm]:
    """The model's groups (released with it), its runtime state, and its parameter form."""
    be = ctx.backend
    maker = GroupMaker(be)
    if choices.mesh is not None:  # the user's groups: not made here, not released with the model
        shard_group, replica_group = groups_from_mesh(choices.mesh, choices.config.strategy,
                                                      ctx.world)
    else:
        shard_group, replica_group = make_groups(maker, ctx.world, choices.config.strategy,
                                                 choices.hybrid_group_size,
                                                 ctx.env.local_world_size)
    shard_groups = None if choices.tp_mesh is None else all_shard_groups(choices.mesh,
                                                                         [choices.tp_mesh])
    reshard_groups = make_reshard_groups(maker, ctx.world, shard_group, choices.reshard,
                                         shard_groups)
    state = ShardState(maybe_wrap(be, verify, ctx.timeout), choices.device, ctx.world, shard_group,
                       replica_group, choices.config,
                       ranks_per_node=ctx.env.local_world_size or None)
    if choices.config.quantization.gradients:
        state.node_hops = make_node_hops(maker, ctx.world, shard_group,
                                         ctx.env.local_world_size or None)
    maker.release_with(state)
    form = choose_form(ctx.world, shard_group, replica_group, choices.device.type,
                       be.capabilities.torch_process_group, choices.mesh, choices.tp_mesh)
    form.release_with(state)
    return state, reshard_groups, form


def _shard_device(choices: _Choices, backend: Backend) -> torch.device:
    return backend.devices.host_device() if choices.config.cpu_offload else choices.device


def _shard_parameters(model: nn.Module, ctx: DistContext, choices: _Choices, state: ShardState,
                      form: ParamForm) -> dict[int, ShardedParam]:
    """Materialise a meta model, move buffers, copy rank 0's values where asked, and turn every
    parameter into its ShardedParam (each drops the module's reference to the full tensor)."""
    be, device, sync = ctx.backend, choices.device, choices.sync
    by_param: dict[int, ShardedParam] = {}

    def make(plan: ParamPlan, value: nn.Parameter) -> None:
        if sync:
            value = nn.Parameter(broadcast_from_first(value, be, ctx.world, device),
                                 requires_grad=value.requires_grad)
        sp = ShardedParam(plan.fqns, plan.owners, value, state.shard_group,
                          be.capabilities.shard_alignment, _shard_device(choices, be), device,
                          choices.config.compute_dtype(value.dtype), be, form)
        sp.register(unsharded=False)  # drops the module's reference to the full tensor
        by_param[id(plan.param)] = sp

    plans = {id(p.param): p for p in all_param_plans(choices.units)}
    remember_replaced(list(plans.values()))
    if has_meta(model):
        materialize(model, device, choices.config.param_init_fn, be.capabilities.holds_values,
                    lambda meta, real: make(plans[id(meta)], real))
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf = buf.to(device)
    if sync:  # in place: a buffer registered on several modules stays one tensor
        with torch.no_grad():
            for _, buf in model.named_buffers():
                buf.copy_(broadcast_from_first(buf, be, ctx.world, device))
    for plan in plans.values():
        if id(plan.param) not in by_param:
            make(plan, plan.param)
    return by_param


def _make_units(state: ShardState, choices: _Choices, by_param: dict[int, ShardedParam],
                reshard_groups: dict[int, Group]) -> None:
    """One ShardUnit per planned unit (root last), each with its hooks installed."""
    for up, after_forward, free_alone in zip(choices.units, choices.reshard,
                                             choices.free_without_backward):
        unit = ShardUnit(state, up.module, up.name, [by_param[id(p.param)] for p in up.params],
                         up.buffers, after_forward,
                         None if isinstance(after_forward, bool) else reshard_groups[after_forward],
                         free_without_backward=free_alone)
        state.units.append(unit)
    state.root_unit = state.units[-1]
    for unit in state.units:
        hooks.install(unit)


def _hand_over(model: nn.Module, state: ShardState, form: ParamForm) -> None:
    """Make the model a sharded model: torch's idioms see whole parameters, state on the model."""
    remember_params(state)
    torch_norms.install()  # torch's clip_grad_norm_ now sees whole parameters
    form.hand_over()
    state_dict_hooks.install(model)
    model.__dict__[STATE_ATTR] = state
    log_sharding(model, state)
    model.__class__ = sharded_class(type(model))
