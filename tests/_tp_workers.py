"""Per-rank workers for tensor parallel inside, shardkit across (`shard(model, mesh=mesh["dp"])` on a
model torch's `parallelize_module` made TP on `mesh["tp"]`), beside FSDP2 with the same TP plan and
the one-process model on the global batch, in one run."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

import shardkit

from _tp_model import Block, TinyLlama, apply_tp, tokens

CLIP = 1.0


def _value(t: torch.Tensor) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def _dp_mean(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _global(step: int, micro: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [tokens(step * 10 + micro, rank) for rank in range(dp)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _engine(name: str, base: TinyLlama, mesh, dp_mesh, strategy: str, mp: bool,
            checkpointing: bool, reshard: int | None, compile_backend: str | None = None
            ) -> torch.nn.Module:
    model = apply_tp(copy.deepcopy(base), mesh["tp"])
    if checkpointing:
        shardkit.wrap.checkpoint_layers(model, Block)
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mp else MixedPrecisionPolicy()
        after = strategy != "SHARD_GRAD_OP" if reshard is None else reshard
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=after)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=after)
        return _compiled(model, compile_backend)
    precision = shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mp else None
    model = shardkit.shard(model, strategy=strategy, mesh=dp_mesh, mixed_precision=precision,
                           reshard_after_forward=reshard,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    return _compiled(model, compile_backend)


def _compiled(model: TinyLlama, backend: str | None) -> TinyLlama:
    """Each block compiled in place as torchtitan does (`block.compile()`), when asked."""
    if backend is not None:
        for block in model.layers:
            block.compile(backend=backend)
    return model


def _train(model, dp: int, dp_rank: int, dp_group, steps: int, micro: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for j in range(micro):
            skip_sync = j < micro - 1 and hasattr(model, "no_sync")
            with (model.no_sync() if skip_sync else contextlib.nullcontext()), loss_parallel():
                x, y = tokens(step * 10 + j, dp_rank)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
                loss.backward()
            total += _value(loss)
        losses.append(_dp_mean(total, dp_group))
        norms.append(_value(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms}


def _reference(base: TinyLlama, dp: int, steps: int, micro: int) -> tuple[dict, TinyLlama]:
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for j in range(micro):
            x, y = _global(step, j, dp)
            loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(0, 1))
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms}, ref


def _whole(model) -> dict[str, torch.Tensor]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.float() for k, v in full.items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def tp_dp(rank: int, world: int, strategy: str, steps: int, options: dict | None = None) -> dict:
    """TP 2 x DP (world / 2): shardkit and FSDP2 with torchtitan's TP plan, and one process.
    HYBRID_SHARD: DP is (2 replicas, world / 4 ranks per shard group). options: micro (batches
    per step, all but the last under no_sync), mp (bf16 compute), checkpointing, reshard (an
    int reshard_after_forward), compile (a torch.compile backend for every block)."""
    options = options or {}
    micro, mp = options.get("micro", 1), options.get("mp", False)
    checkpointing, reshard = options.get("checkpointing", False), options.get("reshard")
    compiled = options.get("compile")
    dp = world // 2
    if strategy == "HYBRID_SHARD":
        mesh = init_device_mesh("cpu", (2, dp // 2, 2),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        flat = dp_mesh._flatten("dp")
    else:
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = flat = mesh["dp"]
    dp_group, dp_rank = flat.get_group(), flat.get_local_rank()
    torch.manual_seed(0)
    base = TinyLlama()
    out: dict = {}
    ours = _engine("shardkit", base, mesh, dp_mesh, strategy, mp, checkpointing, reshard,
                   compiled)
    out["placements"] = {n: str(tuple(p.placements)) for n, p in ours.named_parameters()
                         if n in ("tok_embeddings.weight", "layers.0.attention.wq.weight",
                                  "layers.0.attention.wo.weight", "norm.weight")}
    out["meshes"] = sorted({p.device_mesh.mesh_dim_names or () for p in ours.parameters()})
    out["shardkit"] = _train(ours, dp, dp_rank, dp_group, steps, micro)
    out["reference"], ref = _reference(base, dp, steps, micro)
    mine = _whole(ours)
    ref_weights = {k: v.detach().float() for k, v in ref.state_dict().items()}
    out["vs_reference"] = _distance(mine, ref_weights)
    if reshard is None:
        # (FSDP2 with an int reshard_after_forward on a data-parallel sub-mesh hangs in
        # fully_shard: each TP rank's dp group builds its post-forward DeviceMesh with new_group
        # over its own ranks, which every rank of the world must call alike; seen with py-spy.)
        theirs = _engine("fsdp2", base, mesh, dp_mesh, strategy, mp, checkpointing, reshard,
                         compiled)
        out["fsdp2"] = _train(theirs, dp, dp_rank, dp_group, steps, micro)
        fsdp2 = _whole(theirs)
        out["fsdp2_vs_reference"] = _distance(fsdp2, ref_weights)
        out["vs_fsdp2"] = _distance(mine, fsdp2)
    dead = weakref.ref(ours)
    del ours
    gc.collect()
    out["freed"] = dead() is None
    return out


def tp_refusals(rank: int, world: int) -> dict:
    """What each unsupported use of a tensor-parallel model says (2 ranks: DP 2 x TP 1, and a
    TP 2 model given a data-parallel mesh over the same ranks)."""
    said: dict = {}
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    across = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (2,))

    def tp_model(tp_mesh=None) -> TinyLlama:
        torch.manual_seed(0)
        return apply_tp(TinyLlama(), mesh["tp"] if tp_mesh is None else tp_mesh)

    def attempt(name: str, call) -> None:
        try:
            call()
            said[name] = None
        except shardkit.ShardkitError as exc:
            said[name] = str(exc)

    attempt("no_mesh", lambda: shardkit.shard(tp_model()))
    attempt("overlapping_meshes", lambda: shardkit.shard(tp_model(across["tp"]), mesh=flat))
    # The shard group is the data-parallel mesh's (1 rank here), not the world's 2.
    attempt("reshard_wider_than_dp", lambda: shardkit.shard(
        tp_model(across["tp"]), mesh=across["dp"], reshard_after_forward=2))
    attempt("sync", lambda: shardkit.shard(tp_model(), mesh=mesh["dp"], sync_module_states=True))
    attempt("quantize", lambda: shardkit.shard(
        tp_model(), mesh=mesh["dp"], quantize=shardkit.Quantization(weights=True)))
    model = shardkit.shard(tp_model(), mesh=mesh["dp"])
    said["full_shape"] = tuple(shardkit.full_shape(model.tok_embeddings.weight))
    attempt("full_state_dict_in", lambda: shardkit.checkpoint.load_full_state_dict(
        model, {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}))
    attempt("local_shard", lambda: shardkit.local_shard(
        model.output.weight, torch.zeros(model.output.weight.shape)))
    attempt("full_tensor_plain", lambda: shardkit.full_tensor(
        model.output.weight, model.output.weight.to_local()))
    said["full_tensor_dtensor"] = tuple(shardkit.full_tensor(model.output.weight).shape)
    return said


class MlpBlock(torch.nn.Module):
    """The docs' Block: a LayerNorm, then an MLP (Linear, GELU, Linear), residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def tp_beside_plain_layers(rank: int, world: int) -> dict:
    """TP on each block's MLP only (the docs' recipe): the first and last Linear and the norms stay
    plain, replicated over TP. 5 AdamW steps with torch's clip_grad_norm_ against one process."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), MlpBlock(32), MlpBlock(32), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    for block in (model[1], model[2]):
        parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model = shardkit.shard(model, mesh=mesh["dp"],
                           auto_wrap_policy=shardkit.wrap.transformer_layers({MlpBlock}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    norms = []
    for step in range(5):
        xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + d))
              for d in range(world // 2)]
        model(xs[mesh.get_local_rank("dp")]).pow(2).mean().backward()
        ours = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref(torch.cat(xs)).pow(2).mean().backward()
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        norms.append((_value(ours), float(theirs)))
    return {"norms": norms, "meshes": {p.device_mesh.mesh_dim_names for p in model.parameters()},
            "placements": sorted({str(tuple(p.placements)) for p in model.parameters()}),
            "vs_reference": max((p.full_tensor() - r).abs().max().item()
                                for p, r in zip(model.parameters(), ref.parameters()))}


def _tp_step(model, opt, step: int, dp_rank: int) -> float:
    with loss_parallel():
        x, y = tokens(step, dp_rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
        loss.backward()
    opt.step()
    opt.zero_grad()
    return _value(loss)


def _tp_shardkit(base: TinyLlama, mesh) -> torch.nn.Module:
    return shardkit.shard(apply_tp(copy.deepcopy(base), mesh["tp"]), mesh=mesh["dp"],
                          auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))


def tp_checkpoints(rank: int, world: int, directory: str) -> dict:
    """shardkit.checkpoint.save of TP 2 x DP 2 (model + AdamW after 3 steps) loaded into DP 4
    without TP, into TP 4 x DP 1, into one process (consolidated), and back into TP 2 x DP 2 to
    resume; full_state_dict; FSDP2 + TP's DCP folder into shardkit + TP, and shardkit's folder
    into FSDP2 + TP through torch's dcp.load. Distances to the saved model's whole weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    base = TinyLlama()
    ours = _tp_shardkit(base, mesh)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(3):
        _tp_step(ours, opt, step, dp_rank)
    saved = _whole(ours)
    path = os.path.join(directory, "tp2dp2")
    shardkit.checkpoint.save(path, ours, opt, background=True).wait()
    out: dict = {}
    full = shardkit.checkpoint.full_state_dict(ours)
    out["full_state_dict"] = _distance({k: v.float() for k, v in full.items()}, saved) \
        if rank == 0 else 0.0
    out["continued"] = [_tp_step(ours, opt, step, dp_rank) for step in range(3, 5)]

    dp4 = shardkit.shard(copy.deepcopy(base), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    shardkit.checkpoint.load(path, dp4)
    out["into_dp4"] = _distance(_whole(dp4), saved)
    tp4 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    wide = _tp_shardkit(base, tp4)
    shardkit.checkpoint.load(path, wide)
    out["into_tp4"] = _distance(_whole(wide), saved)
    again = _tp_shardkit(base, mesh)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    shardkit.checkpoint.load(path, again, again_opt)
    out["resumed"] = [_tp_step(again, again_opt, step, dp_rank) for step in range(3, 5)]
    if rank == 0:
        from safetensors.torch import load_file

        from shardkit.checkpoint.offline import consolidate

        consolidated = consolidate(path, os.path.join(directory, "one-process"))
        one = TinyLlama()
        one.load_state_dict({k: v for f in sorted(os.listdir(consolidated))
                             if f.endswith(".safetensors")
                             for k, v in load_file(os.path.join(consolidated, f)).items()})
        out["into_one_process"] = _distance({k: v.float() for k, v in one.state_dict().items()},
                                            saved)
    # FSDP2 + TP's DCP folder (torchtitan's layout: {"model": ...}) into shardkit + TP.
    theirs = apply_tp(copy.deepcopy(base), mesh["tp"])
    for block in theirs.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(theirs, mesh=mesh["dp"])
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(3):
        _tp_step(theirs, theirs_opt, step, dp_rank)
    fsdp2_path = os.path.join(directory, "fsdp2-tp")
    dcp.save({"model": get_model_state_dict(theirs)}, checkpoint_id=fsdp2_path)
    from_fsdp2 = _tp_shardkit(base, mesh)
    shardkit.checkpoint.load(fsdp2_path, from_fsdp2)
    out["fsdp2_into_shardkit"] = _distance(_whole(from_fsdp2), _whole(theirs))
    # shardkit's folder read by torch's own dcp.load into FSDP2 + TP.
    state = get_model_state_dict(theirs)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(theirs, state)
    out["shardkit_into_fsdp2"] = _distance(_whole(theirs), saved)
    return out


def tp_uneven(rank: int, world: int) -> dict:
    """Layers whose width does not split evenly over TP 2 x DP 2 (13, 5, 3 and 1 rows: some
    ranks short, some empty): each whole parameter read back through DTensor after shard(), and
    after a checkpoint round trip, per width. (Only the layout: torch's RowwiseParallel cannot
    run a forward on an uneven width, its DTensor.from_local infers the even global shape.)"""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for rows in (13, 5, 3, 1):
        torch.manual_seed(rows)
        model = nn.Sequential(nn.Linear(8, rows), nn.ReLU(), nn.Linear(rows, 8))
        ref = copy.deepcopy(model)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model = shardkit.shard(model, mesh=mesh["dp"])
        out[rows] = max((p.full_tensor() - r).abs().max().item()
                        for p, r in zip(model.parameters(), ref.parameters()))
        out[f"{rows} full_state_dict"] = max(
            (v - ref.state_dict()[k]).abs().max().item()
            for k, v in shardkit.checkpoint.full_state_dict(model, rank0_only=False).items())
    return out
