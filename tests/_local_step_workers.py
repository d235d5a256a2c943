"""Per-rank workers for the optimizer's local-tensor step (sharding/surface/local_step.py).

Each run trains the same sharded TinyNet twice in one process: once as shipped (an elementwise
optimizer steps the DTensors' local tensors) and once with SHARDKIT_LOCAL_STEP=0 (every op
through DTensor's dispatch, what every step did before), and returns what a test compares:
parameters and optimizer state bit for bit, the state's types, and whether the local step ran.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

import shardkit
from shardkit.sharding.surface import local_step

from _models import TinyNet, batch

STEPS = 4


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), written from outside torch: elementwise, state exp_avg only."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One Lion update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


class ShapeRecorder(torch.optim.SGD):
    """SGD that notes the shapes its step sees (not declared elementwise: a subclass)."""

    seen: list = []

    def step(self, closure=None):
        """Record every parameter's shape, then SGD's step."""
        ShapeRecorder.seen = [tuple(p.shape) for g in self.param_groups for p in g["params"]]
        return super().step(closure)


class Boom(torch.optim.SGD):
    """SGD that raises after its update while `armed` (declared elementwise by the worker)."""

    armed = False

    def step(self, closure=None):
        """SGD's step, then an error while armed."""
        out = super().step(closure)
        if Boom.armed:
            raise RuntimeError("boom")
        return out


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer `name` over `model`, with weight decay on matrices only (two groups)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    if name == "adamw-fused":
        return torch.optim.AdamW(groups, lr=1e-2, fused=True)
    if name == "adam-foreach-amsgrad":
        return torch.optim.Adam(groups, lr=1e-2, foreach=True, amsgrad=True)
    if name == "sgd-nesterov":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=1e-2)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5)
    if name == "lion":
        return Lion(groups, lr=1e-3)
    if name == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    if name == "shape-recorder":
        return ShapeRecorder(model.parameters(), lr=1e-2)
    raise ValueError(name)


def _shard(world: int, config: dict) -> nn.Module:
    torch.manual_seed(0)
    model = TinyNet()
    if config.get("frozen"):
        model.conv.weight.requires_grad_(False)
    kwargs: dict = {}
    if config.get("strategy", "FULL_SHARD") == "HYBRID_SHARD":
        kwargs["hybrid_group_size"] = world // 2
    if config.get("bf16"):
        kwargs["mixed_precision"] = shardkit.MixedPrecision(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)
    if config.get("quantize"):
        kwargs["quantize"] = shardkit.Quantization(weights=True, gradients=True)
    if config.get("cpu_offload"):
        kwargs["cpu_offload"] = True
    if config.get("reshard") is not None:
        kwargs["reshard_after_forward"] = config["reshard"]
    return shardkit.shard(model, strategy=shardkit.ShardingStrategy[config.get("strategy", "FULL_SHARD")],
                          auto_wrap_policy=shardkit.wrap.transformer_layers(
                              (type(model.blocks[0]),)), **kwargs)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return F.cross_entropy(model(x).float(), y)


def _train(rank: int, world: int, config: dict, local: bool, steps: int = STEPS) -> dict:
    os.environ["SHARDKIT_LOCAL_STEP"] = "1" if local else "0"
    if config.get("optimizer") == "lion":
        shardkit.elementwise_optimizer(Lion)
    model = _shard(world, config)
    opt = make_optimizer(config.get("optimizer", "adamw"), model)
    ran_local = []
    for step in range(steps):
        if config.get("closure"):
            def closure(step=step):
                opt.zero_grad()
                loss = _loss(model, step, rank)
                loss.backward()
                return loss
            returned = opt.step(closure)
            assert returned is not None
        else:
            _loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        ran_local.append(local_step.last_step_was_local(opt))
    return {"model": model, "opt": opt, "ran_local": ran_local}


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    params = {n: p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
              for n, p in model.named_parameters()}
    state = {}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for key, value in opt.state.get(p, {}).items():
            local = value.to_local() if hasattr(value, "to_local") else value
            state[f"{i}.{key}"] = (type(value).__name__,
                                   local.detach().clone() if torch.is_tensor(local) else local)
    return {"params": params, "state": state,
            "param_types": sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]})}


def _bitwise(a: dict, b: dict) -> list[str]:
    """Names whose values differ by even one bit (or whose state types differ)."""
    bad = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    if a["state"].keys() != b["state"].keys():
        return bad + ["state keys"]
    for key, (kind, value) in a["state"].items():
        other_kind, other = b["state"][key]
        same = torch.equal(value, other) if torch.is_tensor(value) else value == other
        if kind != other_kind or not same:
            bad.append(f"state {key}")
    return bad


def parity_run(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """Per config: local step vs dispatch, bit for bit, and whether the local step ran."""
    out = []
    for config in configs:
        fast = _train(rank, world, config, local=True)
        slow = _train(rank, world, config, local=False)
        a, b = _snapshot(fast["model"], fast["opt"]), _snapshot(slow["model"], slow["opt"])
        initial = _initial(world, config)
        moved = max((a["params"][n].float() - initial[n].float()).abs().max().item()
                    for n in a["params"])
        out.append({"config": config, "differ": _bitwise(a, b), "ran_local": fast["ran_local"],
                    "dispatch_local": slow["ran_local"], "param_types": a["param_types"],
                    "moved": moved})
    return out


def _initial(world: int, config: dict) -> dict:
    model = _shard(world, config)
    return {n: p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
            for n, p in model.named_parameters()}


def checkpoint_run(rank: int, world: int, directory: str) -> dict:
    """A checkpoint written by one step path loads into the other and trains on alike."""
    out = {}
    for writer, reader in ((False, True), (True, False)):
        path = os.path.join(directory, f"ckpt-{int(writer)}")
        first = _train(rank, world, {}, local=writer, steps=2)
        shardkit.checkpoint.save(path, first["model"], first["opt"])
        # The writer trains on; the reader loads and trains the same steps the other way.
        for step in range(2, 4):
            _loss(first["model"], step, rank).backward()
            first["opt"].step()
            first["opt"].zero_grad()
        os.environ["SHARDKIT_LOCAL_STEP"] = "1" if reader else "0"
        model = _shard(world, {})
        opt = make_optimizer("adamw", model)
        shardkit.checkpoint.load(path, model, opt)
        ran = []
        for step in range(2, 4):
            _loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
            ran.append(local_step.last_step_was_local(opt))
        out[f"{int(writer)}->{int(reader)}"] = {
            "differ": _bitwise(_snapshot(first["model"], first["opt"]), _snapshot(model, opt)),
            "ran_local": ran}
    return out


def dcp_state_run(rank: int, world: int) -> dict:
    """DCP's get_optimizer_state_dict sees the same keys, types and values either way."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    found = {}
    for local in (True, False):
        run = _train(rank, world, {}, local=local)
        osd = get_optimizer_state_dict(run["model"], run["opt"])
        flat = {f"{k}.{key}": (type(v).__name__, v.to_local() if hasattr(v, "to_local") else v)
                for k, st in osd["state"].items() for key, v in st.items()}
        found[local] = (flat, osd["param_groups"])
    (fast, fast_groups), (slow, slow_groups) = found[True], found[False]
    differ = [k for k in fast if k not in slow or fast[k][0] != slow[k][0]
              or not torch.equal(torch.as_tensor(fast[k][1]), torch.as_tensor(slow[k][1]))]
    return {"keys": sorted(fast), "types": sorted({t for t, _ in fast.values()}),
            "differ": differ, "groups_equal": fast_groups == slow_groups}


def edge_run(rank: int, world: int) -> dict:
    """What the user's code sees around a step: errors inside it, hooks, schedulers, shapes,
    state reset between steps, a parameter group added later, and the optimizer's lifetime."""
    out: dict = {}
    shardkit.elementwise_optimizer(Boom)

    # 1. An error inside the step leaves the optimizer as it was, and training goes on alike.
    results = {}
    for local in (True, False):
        os.environ["SHARDKIT_LOCAL_STEP"] = "1" if local else "0"
        model = _shard(world, {})
        opt = Boom(model.parameters(), lr=1e-2, momentum=0.9)
        params = list(model.parameters())
        for step in range(STEPS):
            _loss(model, step, rank).backward()
            grads = [p.grad for p in params]
            Boom.armed = step == 2
            try:
                opt.step()
            except RuntimeError as exc:
                assert str(exc) == "boom"
                out.setdefault("after_error", []).append({
                    "params_are_model_params": all(a is b for a, b in zip(opt.param_groups[0]["params"], params)),
                    "grads_kept": all(p.grad is g for p, g in zip(params, grads)),
                    "state_keys_are_params": all(any(k is p for p in params) for k in opt.state),
                    "state_types": sorted({type(v).__name__ for st in opt.state.values() for v in st.values()}),
                })
            Boom.armed = False
            opt.zero_grad()
            assert all(p.grad is None for p in params)
        results[local] = _snapshot(model, opt)
    out["error_differ"] = _bitwise(results[True], results[False])

    # 2. Per-optimizer step hooks see the DTensors: that optimizer steps through the dispatch.
    os.environ["SHARDKIT_LOCAL_STEP"] = "1"
    model = _shard(world, {})
    opt = make_optimizer("adamw", model)
    hook_saw = []
    opt.register_step_post_hook(lambda o, a, k: hook_saw.append(
        sorted({type(p).__name__ for g in o.param_groups for p in g["params"]})))
    for step in range(2):
        _loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    out["hook_saw"] = hook_saw
    out["hooked_local"] = local_step.last_step_was_local(opt)

    # 3. LR schedulers, made before the first step and after it: no order warning, same numbers.
    results = {}
    for local in (True, False):
        os.environ["SHARDKIT_LOCAL_STEP"] = "1" if local else "0"
        model = _shard(world, {})
        opt = make_optimizer("adamw", model)
        before = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                _loss(model, step, rank).backward()
                opt.step()
                opt.zero_grad()
                before.step()
                if step == 0:
                    after = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
                else:
                    after.step()
        results[local] = _snapshot(model, opt)
        out[f"scheduler_warnings_{local}"] = [str(w.message) for w in caught
                                              if "lr_scheduler" in str(w.message)]
        out[f"scheduler_local_{local}"] = local_step.last_step_was_local(opt)
        out[f"lr_{local}"] = [g["lr"] for g in opt.param_groups]
    out["scheduler_differ"] = _bitwise(results[True], results[False])

    # 4. Optimizers that are not elementwise (or not declared) step the DTensors and see whole shapes.
    # (torch's Adafactor reads param.norm().item(): shardkit refuses that partial value.)
    out["adafactor_elementwise"] = local_step.is_elementwise(
        torch.optim.Adafactor([torch.zeros(2, 2, requires_grad=True)]))
    run = _train(rank, world, {"optimizer": "shape-recorder"}, local=True, steps=2)
    out["shape-recorder_local"] = run["ran_local"]
    out["recorder_shapes"] = ShapeRecorder.seen
    out["full_shapes"] = [tuple(p.shape) for p in TinyNet().parameters()]

    # 5. State reset between steps and a parameter group added after the first step.
    results = {}
    for local in (True, False):
        os.environ["SHARDKIT_LOCAL_STEP"] = "1" if local else "0"
        model = _shard(world, {})
        head = list(model.head.parameters())
        opt = torch.optim.AdamW([p for p in model.parameters() if all(p is not h for h in head)],
                                lr=1e-2)
        ran = []
        for step in range(STEPS + 2):
            _loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
            ran.append(local_step.last_step_was_local(opt))
            if step == 1:
                opt.state.clear()  # a user's optimizer reset
            if step == 2:
                opt.add_param_group({"params": head, "lr": 5e-3})
        results[local] = _snapshot(model, opt)
        out[f"reset_ran_{local}"] = ran
    out["reset_differ"] = _bitwise(results[True], results[False])

    # 6. The optimizer and model go with the user's last reference to them.
    os.environ["SHARDKIT_LOCAL_STEP"] = "1"
    run = _train(rank, world, {}, local=True, steps=2)
    refs = (weakref.ref(run["model"]), weakref.ref(run["opt"]))
    out["adopted_before_delete"] = run["opt"] in local_step._adopted
    del run
    gc.collect()
    out["freed"] = [r() is None for r in refs]

    # 7. shutdown()'s uninstall puts back the step it stood in front of (here an LR scheduler's).
    model = _shard(world, {})
    opt = make_optimizer("adamw", model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        _loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    out["local_before_uninstall"] = local_step.last_step_was_local(opt)
    local_step.uninstall()
    out["scheduler_step_back"] = hasattr(opt.step, "_wrapped_by_lr_sched") and not hasattr(
        opt.step, "_shardkit_local_step")
    _loss(model, 0, rank).backward()
    opt.step()
    out["local_after_uninstall"] = local_step.last_step_was_local(opt)

    # 8. A bad declaration is refused with what to do.
    try:
        shardkit.elementwise_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    except shardkit.ShardkitError as exc:
        out["bad_declaration"] = str(exc)
    return out


def compiled_step_run(rank: int, world: int) -> dict:
    """`opt.step()` inside torch.compile (eager backend: dynamo traces it) trains as the dispatch does."""
    found = {}
    for local in (True, False):
        os.environ["SHARDKIT_LOCAL_STEP"] = "1" if local else "0"
        model = _shard(world, {})
        opt = make_optimizer("adamw", model)

        @torch.compile(backend="eager")
        def step(optimizer):
            optimizer.step()

        for i in range(3):
            _loss(model, i, rank).backward()
            step(opt)
            opt.zero_grad()
        found[local] = _snapshot(model, opt)
    return {"differ": _bitwise(found[True], found[False])}
