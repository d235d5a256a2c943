"""Planning tensor parallel inside, shardkit across: `plan(tp=N)`, `shardkit plan --tp N`.

The planner does not describe tensor parallelism by hand, for the reason it does not describe the
engine by hand (rehearsal.py): which parameters a TP plan splits, along which dimension, what
each rank keeps of an uneven split, and which activations its collectives move are decided by
torch's ParallelStyles, and a hand-made table of them would drift from torch and err where it
forgot a case. So the plan's own TP plan (the user's `parallelize_module` recipe, or a
transformers model's `tp_plan`) is applied to a meta copy of the model on a mesh of torch's
"fake" process groups: one process stands for all of the job's ranks, every collective returns at
once, and nothing is allocated. The data-parallel layout is then shardkit's on what TP left each
rank (a DTensor's local part), and a rehearsed step runs the real DTensor collectives, each one
counted here as it is issued (`TensorParallelTraffic`).

A fake world is a default process group for the length of one `with`: a process that already has
one (a running job) cannot plan TP here, and is told to plan from the command line. The mesh is
(data parallel..., tp) over consecutive ranks, as torchtitan lays it out: TP inside a node.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from ..errors import ShardkitError
from ..sharding.step.traffic import CommStats
from .activations import on_dtensors

TPPlan = Callable[[nn.Module, Any], Any] | Mapping[str, Any]

def _hf_style(name: str) -> Any:
    """transformers' name for a tensor-parallel style (a model's `tp_plan`), as torch's style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
    }
    if name not in styles:
        raise ShardkitError(
            f"tensor-parallel style {name!r} is not one the planner maps to torch's styles "
            f"({', '.join(styles)}). HINT: pass tp_plan=fn(model, tp_mesh) that calls "
            "parallelize_module as your training script does (`--tp-plan MODULE:FUNCTION`)")
    return styles[name]()


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel side of a plan: its degree and how to parallelize a model."""

    size: int
    apply: Callable[[nn.Module, Any], Any]  # fn(model, tp_mesh), parallelize_module inside
    source: str  # said in the plan: where the TP plan came from


def resolve(tp: int | None, tp_plan: TPPlan | None, model: nn.Module,
            world_size: int) -> TensorParallel | None:
    """The plan's tensor parallelism (None: none), its TP plan checked; refused with what to do."""
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ShardkitError(f"tp must be a positive int (ranks per tensor-parallel group), got {tp!r}")
    if tp is None or tp == 1:
        if tp_plan is not None:
            raise ShardkitError("tp_plan= needs tp= of 2 or more (the tensor-parallel degree)")
        return None
    if world_size % tp:
        raise ShardkitError(
            f"world_size {world_size} is not a multiple of tp={tp}: every data-parallel rank is a "
            f"group of {tp} tensor-parallel ranks. HINT: a world size of {tp} x the "
            "data-parallel degree")
    if tp_plan is None:
        found = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
        if not found:
            raise ShardkitError(
                f"tp={tp} needs the model's tensor-parallel plan, and {type(model).__name__} "
                "declares none (a transformers model's tp_plan). HINT: pass tp_plan=fn(model, "
                "tp_mesh) that calls torch's parallelize_module as your training script does, or "
                "a dict {module path: ParallelStyle} (`--tp-plan MODULE:FUNCTION`)")
        return TensorParallel(tp, _from_mapping(dict(found)), "the model's own tp_plan")
    if callable(tp_plan):
        name = getattr(tp_plan, "__qualname__", type(tp_plan).__name__)
        return TensorParallel(tp, tp_plan, f"{getattr(tp_plan, '__module__', '')}:{name}")
    if isinstance(tp_plan, Mapping):
        return TensorParallel(tp, _from_mapping(dict(tp_plan)), "the tp_plan dict")
    raise ShardkitError(f"tp_plan must be fn(model, tp_mesh) or a dict {{module path: "
                        f"ParallelStyle or style name}}, got {type(tp_plan).__name__}")


def _from_mapping(styles: dict[str, Any]) -> Callable[[nn.Module, Any], Any]:
    """fn(model, tp_mesh) applying {module path (with '*'): ParallelStyle or HF style name}."""
    resolved = {path: _hf_style(style) if isinstance(style, str) else style
                for path, style in styles.items()}

    def apply(model: nn.Module, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, resolved)
    return apply


def data_parallel_shape(strategy: str, dp_world: int, hybrid_group_size: int | None
                        ) -> tuple[int, ...]:
    """The data-parallel mesh's shape beside TP, as shard(mesh=) takes it: (ranks,), or
    (replicas, shard group) for HYBRID_SHARD."""
    if strategy != "HYBRID_SHARD":
        return (dp_world,)
    group = hybrid_group_size or dp_world
    return (dp_world // group, group)


@contextlib.contextmanager
def fake_world(world_size: int, dp_shape: tuple[int, ...], tp: int) -> Iterator[Any]:
    """A mesh (data parallel..., tp) of torch's fake process groups, for one `with`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ShardkitError(
            "plan(tp=...) stands one process in for every rank of the job with torch's fake "
            "process groups, and this process already has a default process group (a running "
            "job). HINT: plan before init, or from the command line: shardkit plan ... --tp N")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # torchtitan's names, data parallel first: TP's ranks are consecutive, inside a node.
        names = ("dp_replicate", "dp_shard", "tp") if len(dp_shape) == 2 else ("dp", "tp")
        # "cpu": DTensor's ops need a device type torch knows; the tensors stay on meta.
        yield init_device_mesh("cpu", (*dp_shape, tp), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
        _forget_cached_shardings()


def _forget_cached_shardings() -> None:
    # DTensor caches sharding decisions by value (its C++ fast path and Python's LRU): a later
    # fake world's equal mesh would be answered with this one's, whose process groups are gone
    # (a second TP plan with a batch in one process failed: its parameters named group "3",
    # the live mesh's was "9").
    from torch.distributed.tensor import DTensor

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagate = getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)
    clear_python = getattr(propagate, "cache_clear", None)
    if clear_python is not None:
        clear_python()


def data_parallel_mesh(mesh: Any) -> Any:
    """The mesh's data-parallel dimension(s), as shard(mesh=) takes them."""
    names = mesh.mesh_dim_names[:-1]
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def parallelized(model: nn.Module, tensor_parallel: TensorParallel, mesh: Any) -> nn.Module:
    """A meta copy of `model` with the TP plan applied on the mesh's "tp" dimension."""
    with torch.device("meta"):
        twin = copy.deepcopy(model).to("meta")
    try:
        out = tensor_parallel.apply(twin, mesh["tp"])
    except ShardkitError:
        raise
    except Exception as exc:
        raise ShardkitError(
            f"applying the tensor-parallel plan ({tensor_parallel.source}) to "
            f"{type(model).__name__} failed: {type(exc).__name__}: {exc}. HINT: the plan is "
            "called as fn(model, tp_mesh) on a meta copy of the model, as your training script "
            "calls it on the real one") from exc
    twin = out if isinstance(out, nn.Module) else twin
    if not any(getattr(p, "device_mesh", None) is not None for p in twin.parameters()):
        raise ShardkitError(
            f"the tensor-parallel plan ({tensor_parallel.source}) split no parameter of "
            f"{type(model).__name__}: its module paths name none of the model's modules. HINT: "
            "check the paths against model.named_modules()")
    return twin


_GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_out",
            "all_gather_into_tensor_coalesced")
_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")
_ALL_REDUCES = ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_")
_NOT_SENDING = ("wait_tensor", "_wrap_tensor_autograd")


class TensorParallelTraffic(TorchDispatchMode):
    """Counts DTensor's collectives (torch's functional c10d ops) as CommStats counts shardkit's:
    the bytes one rank sends per kind in a ring, and the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CommStats()
        self.largest_input = 0  # bytes: the largest tensor (list) one collective took

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """Run the op; note it where it is a collective of torch's functional c10d."""
        if on_dtensors(types):
            # DTensor then runs it as local ops and collectives, each seen here: a redistribution
            # inside an op (loss_parallel's reductions, an input in the wrong layout) is counted.
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            raise ShardkitError(
                f"the tensor-parallel step issued torch's c10d.{func.__name__}, a collective "
                "outside torch's functional collectives that the planner does not count (it "
                "would err low). HINT: plan without tp= and count that collective by hand")
        if func.namespace == "_c10d_functional":
            self._note(func.__name__.split(".")[0], args)
        return func(*args, **kwargs)

    def _note(self, op: str, args: tuple) -> None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if op not in _NOT_SENDING:
            self.largest_input = max(self.largest_input, nbytes)
        if op in _GATHERS:  # (input, group_size, group_name): each rank's input is its shard
            self.stats.all_gather(nbytes, int(args[1]))
        elif op in _REDUCE_SCATTERS:  # (input, op, group_size, group_name): output = input / n
            size = int(args[2])
            self.stats.reduce_scatter(nbytes // size, size)
        elif op in _ALL_REDUCES:  # (input, op, group_name)
            self.stats.all_reduce(nbytes, _resolve_process_group(args[2]).size())
        elif op == "all_to_all_single":  # (input, output splits, input splits, group_name)
            size = _resolve_process_group(args[3]).size()
            self.stats.all_to_all("all_to_all", nbytes // size, size)
        elif op in ("broadcast", "broadcast_"):  # (input, src, group_name): the source sends it once per peer
            self.stats.all_to_all("broadcast", nbytes, _resolve_process_group(args[2]).size())
        elif op not in _NOT_SENDING:
            raise ShardkitError(
                f"the tensor-parallel plan issued torch's {op!r}, a collective the planner does "
                "not count (it would err low). HINT: plan without tp= and count that "
                "collective by hand")

    def snapshot(self) -> dict[str, Any]:
        """Bytes sent per kind, their total and the calls (CommStats' form, nodes left out)."""
        snap = self.stats.snapshot()
        out = {k: snap[k] for k in ("all_gather", "reduce_scatter", "all_reduce")}
        for kind in ("all_to_all", "broadcast"):  # rare in TP plans: named only where issued
            if self.stats.bytes.get(kind):
                out[kind] = int(round(self.stats.bytes[kind]))
        return {**out, "total": sum(out.values()), "calls": snap["calls"]}
