"""A measured training step of tensor parallel inside, shardkit across, for
tests/test_planner_tensor_parallel.py: what the planner's `tp=` predicts, taken from a real run.

Two models and their TP plans: torchtitan's tiny Llama with its `apply_tp` (SequenceParallel
norms, loss_parallel) and transformers' Llama with the model's own `tp_plan` (colwise / rowwise
projections, an all-reduce after each block's attention and MLP), as the planner maps its names.
Per rank, over the second training step (forward, backward, optimizer.step): torch's CPU allocator
high-water mark (the profiler's memory events, from before the model exists), shardkit's own
comm_stats, and TP's collectives counted two ways here: torch's CommDebugMode for the calls and
a ring-model byte count of each functional collective's tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _planner_act_workers import WINDOW, peak_in_window
from shardkit.planner.measure import host_memory_profiler

TINY_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256)


def case(name: str) -> tuple[Callable[[], torch.nn.Module], type, Callable[[Any, Any], Any]]:
    """(model factory, its block class, fn(model, tp_mesh) applying its TP plan)."""
    if name == "titan":
        from _tp_model import Block, TinyLlama, apply_tp

        return TinyLlama, Block, apply_tp
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardkit.planner.tensor_parallel import resolve

    config = transformers.LlamaConfig(**TINY_HF)

    def parallelize(model, tp_mesh):
        # The planner's own reading of the model's tp_plan: what `plan(tp=)` applies by default.
        resolve(tp_mesh.size(), None, model, tp_mesh.size()).apply(model, tp_mesh)
    return (lambda: transformers.LlamaForCausalLM(config)), LlamaDecoderLayer, parallelize


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF's own loss, else cross-entropy of the logits (sharded ones under loss_parallel)."""
    if hasattr(model, "config"):
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    logits = model(ids)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long))


class RingBytes(TorchDispatchMode):
    """Bytes this rank sends in torch's functional collectives, by the ring model: an all-gather
    sends its input n-1 times, a reduce-scatter n-1 chunks of its output, an all-reduce
    2(n-1)/n of its tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        if DTensor in types:
            return NotImplemented  # DTensor runs it as local ops and collectives, seen here
        from torch.distributed.distributed_c10d import _resolve_process_group

        op = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and op not in ("wait_tensor",
                                                                "_wrap_tensor_autograd"):
            nbytes = args[0].numel() * args[0].element_size()
            if op == "all_gather_into_tensor":
                self.sent["all_gather"] += (args[1] - 1) * nbytes
            elif op == "reduce_scatter_tensor":
                self.sent["reduce_scatter"] += (args[2] - 1) * nbytes / args[2]
            elif op in ("all_reduce", "all_reduce_"):
                n = dist.get_world_size(_resolve_process_group(args[2]))
                self.sent["all_reduce"] += 2 * (n - 1) * nbytes / n
            else:
                raise AssertionError(f"a collective this count does not know: {op}")
        return func(*args, **(kwargs or {}))


def tp_step(rank: int, world: int, tp: int, name: str, batch: int, seq: int, ac: bool) -> dict:
    """This rank's second step of the TP x DP model: peak, DP and TP traffic."""
    import shardkit
    from shardkit.wrap import checkpoint_layers, transformer_layers
    from torch.autograd.profiler import record_function
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    make, block, parallelize = case(name)
    with host_memory_profiler() as prof:
        torch.manual_seed(0)
        model = make()
        if tp > 1:
            parallelize(model, mesh["tp"])
        # tp 1: the same model without TP, on shardkit's own groups (the baseline)
        model = shardkit.shard(model, mesh=mesh["dp"] if tp > 1 else None,
                               auto_wrap_policy=transformer_layers({block}))
        if ac:
            checkpoint_layers(model, block)
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(rank))

        def step() -> None:
            with loss_parallel():
                loss_of(model, ids).backward()
            opt.step()

        step()
        opt.zero_grad()
        shardkit.comm_stats(model, reset=True)
        with record_function(WINDOW), CommDebugMode() as calls, RingBytes() as ring:
            step()
    held_before, peak = peak_in_window(prof)
    counts = calls.get_comm_counts()
    by_kind = {kind: sum(n for op, n in counts.items() if op.__name__.startswith(prefix))
               for kind, prefix in (("all_gather", "all_gather"),
                                    ("reduce_scatter", "reduce_scatter"),
                                    ("all_reduce", "all_reduce"))}
    return {"peak": peak, "held_before": held_before, "dp": shardkit.comm_stats(model),
            "tp_bytes": {k: int(round(v)) for k, v in ring.sent.items()}, "tp_calls": by_kind}
