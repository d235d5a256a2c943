"""Per-rank workers for the XLA lane (module-level so shardkit.spawn can pickle them).

Ranks are torch_xla device threads of one process here, so anything process-global (torch's
default RNG) is used under a lock, and the unsharded reference trains eagerly on the CPU.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit.sharding import get_state, iter_unit_full_params

from _models import Block, TinyNet, batch, global_batch
from _optim_state import local_optim

STEPS = 5
# XLA on the CPU client; lower LLVM optimisation halves the compile time; a spawn that hangs prints
# every thread's stack and fails after 540 s, inside the tests' 600 s cap.
XLA_TEST_ENV = {"PJRT_DEVICE": "CPU", "XLA_FLAGS": "--xla_backend_optimization_level=0",
                "SHARDKIT_XLA_SPAWN_TIMEOUT": "540"}


@pytest.fixture(autouse=True)
def cpu_pjrt(monkeypatch):
    """Every test of a module that imports this fixture runs XLA on the CPU client."""
    for key, value in XLA_TEST_ENV.items():
        monkeypatch.setenv(key, value)
def reference_and_copy(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager-CPU reference, identical copy to shard), built from one seed."""
    with shardkit.seeded(seed):  # device threads share torch's default generator
        ref = TinyNet()
    return ref, copy.deepcopy(ref)


def max_diff_to(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest |sharded - reference| over every parameter (gathers: every rank must call it)."""
    full: dict[str, torch.Tensor] = {}
    for _, tensors in iter_unit_full_params(model):
        full.update({k: v.detach().cpu() for k, v in tensors.items()})
    return max((full[k] - p.detach()).abs().max().item() for k, p in ref.named_parameters())


def compile_count() -> int:
    """Graphs torch_xla has compiled in this process so far (all device threads together)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def engine_parity(rank: int, world: int, strategy: str, optimizer: str,
                  quantize: bool = False) -> dict:
    """Train sharded on XLA and unsharded on CPU (global batch) side by side; per-step differences.

    quantize: gathers and reductions as int8 blocks (shardkit.Quantization, both).
    """
    ctx = shardkit.current_context()
    ref, model = reference_and_copy(seed=0)
    model = shardkit.shard(model, strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           quantize=shardkit.Quantization(weights=True, gradients=True)
                           if quantize else None)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    out = {"init_diff": max_diff_to(model, ref), "diffs": [], "losses": [], "ref_losses": [],
           "devices": sorted({str(p.device) for p in model.parameters()}),
           "device": str(ctx.device), "world": ctx.world_size, "step_s": [],
           "compiles": []}
    for step in range(STEPS):
        started = time.perf_counter()
        x, y = (t.to(ctx.device) for t in batch(step, rank))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # no step_boundary(): the backend's optimizer post-hook cuts the graph
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        ref_loss = F.cross_entropy(ref(gx), gy)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
        out["step_s"].append(round(time.perf_counter() - started, 2))
        out["compiles"].append(compile_count())
        out["diffs"].append(max_diff_to(model, ref))
    return out


def replicate_parity(rank: int, world: int) -> dict:
    """DDP through shardkit.replicate on XLA vs the unsharded CPU reference."""
    ref, model = reference_and_copy(seed=1)
    ddp = shardkit.replicate(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    dev = shardkit.current_context().device
    out = {"gradient_as_bucket_view": ddp.gradient_as_bucket_view, "diffs": []}
    for step in range(STEPS):
        x, y = (t.to(dev) for t in batch(step, rank))
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        F.cross_entropy(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["diffs"].append(max((p.detach().cpu() - q.detach()).abs().max().item()
                                for p, q in zip(ddp.module.parameters(), ref.parameters())))
    return out


def replicate_refused(rank: int) -> str:
    """What shardkit.replicate raises when the XLA ranks are threads of one process."""
    try:
        shardkit.replicate(TinyNet())
    except Exception as exc:  # noqa: BLE001 - the type and text are the result
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


# ---- checkpoints across backends and world sizes, loss parity across backends ----------------------
# One global batch per step, split evenly over 1, 2 or 3 ranks, so runs at different world sizes
# (and on different backends) do the same arithmetic up to rounding.
GLOBAL_BATCH = 6
SAVE_STEP, NEXT_STEPS = 3, 2


def global_step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step (every rank takes its equal slice)."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(GLOBAL_BATCH, 1, 4, 4, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


def sharded_tinynet(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyNet from `seed`, FULL_SHARD with a unit per Block, and AdamW over its shards."""
    with shardkit.seeded(seed):
        model = TinyNet()
    model = shardkit.shard(model, auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, count: int) -> list[float]:
    """`count` steps from step `first` on this rank's slice of each global batch; this rank's losses."""
    ctx = shardkit.current_context()
    n = GLOBAL_BATCH // ctx.world_size
    losses = []
    for step in range(first, first + count):
        x, y = global_step_batch(step)
        mine = slice(ctx.rank * n, (ctx.rank + 1) * n)
        loss = F.cross_entropy(model(x[mine].to(ctx.device)), y[mine].to(ctx.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every full parameter on the host (gathers: every rank must call it)."""
    out: dict[str, torch.Tensor] = {}
    for _, tensors in iter_unit_full_params(model):
        out.update({k: v.detach().cpu().clone() for k, v in tensors.items()})
    return out


def save_then_train(rank: int, root: str, background: bool = False) -> dict:
    """Train SAVE_STEP steps, save (and export), then NEXT_STEPS more; what the loaders must match.

    background=True: the save is written from a thread while the NEXT_STEPS steps run.
    """
    import shardkit.checkpoint as ck

    ctx = shardkit.current_context()
    model, opt = sharded_tinynet(seed=0)
    before = train_steps(model, opt, 0, SAVE_STEP)
    started = time.perf_counter()
    handle = ck.save(f"{root}/ckpt", model, opt, background=background,
                     extra={"step": SAVE_STEP, "saved_on": ctx.backend.name})
    save_s = time.perf_counter() - started
    params, optim = full_params(model), local_optim(model, opt)
    if background:
        after = train_steps(model, opt, SAVE_STEP, NEXT_STEPS)
        handle.wait(timeout=300)
        return {"backend": ctx.backend.name, "after": after, "params": params, "optim": optim}
    ck.export(f"{root}/export", model)
    after = train_steps(model, opt, SAVE_STEP, NEXT_STEPS)
    return {"backend": ctx.backend.name, "device": str(ctx.device), "before": before,
            "after": after, "params": params, "optim": optim, "save_s": save_s}


def load_then_train(rank: int, path: str) -> dict:
    """Load the checkpoint into a differently initialised model, then train NEXT_STEPS steps."""
    import shardkit.checkpoint as ck

    ctx = shardkit.current_context()
    model, opt = sharded_tinynet(seed=7)
    started = time.perf_counter()
    extra = ck.load(path, model, opt)
    load_s = time.perf_counter() - started
    params, optim = full_params(model), local_optim(model, opt)
    after = train_steps(model, opt, SAVE_STEP, NEXT_STEPS)
    return {"backend": ctx.backend.name, "device": str(ctx.device), "extra": extra,
            "params": params, "optim": optim, "after": after, "load_s": load_s}


def loss_parity_run(rank: int, steps: int) -> dict:
    """`steps` AdamW steps of the sharded TinyNet from seed 0; this rank's losses and the final params."""
    model, opt = sharded_tinynet(seed=0)
    losses = train_steps(model, opt, 0, steps)
    return {"backend": shardkit.current_context().backend.name, "losses": losses,
            "params": full_params(model)}


def subgroups_refused(rank: int) -> dict[str, str]:
    """What shard() raises on 4 XLA device threads for HYBRID_SHARD in groups of 2 and for reshard_after_forward=2."""
    cases = {"hybrid": dict(strategy="HYBRID_SHARD", hybrid_group_size=2),
             "reshard_int": dict(strategy="FULL_SHARD", reshard_after_forward=2)}
    out = {}
    for name, kwargs in cases.items():
        try:
            shardkit.shard(TinyNet(), **kwargs)
            out[name] = "nothing raised"
        except Exception as exc:  # noqa: BLE001 - the type and text are the result
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def hang_on_rank_one(rank: int) -> int:
    """Rank 1 blocks forever (a collective that never completes, as far as the watchdog knows)."""
    if rank == 1:
        threading.Event().wait()
    return rank


def seeding_trials(rank: int, trials: int) -> list[dict]:
    """First `trials` builds under shardkit.seeded(t) (every thread's draws go through the
    lock), then the documented pattern in racing device threads `trials` times:
    torch.manual_seed(t); TinyNet() in every rank, then shard() (sync_module_states defaults to
    True on thread ranks)."""
    seeded_builds = []
    for trial in range(trials):
        with shardkit.seeded(trial):
            seeded_builds.append({n: p.detach().clone() for n, p in TinyNet().named_parameters()})
    ctx = shardkit.current_context()  # no thread starts racing before every thread built
    ctx.backend.all_reduce(torch.zeros(1, device=ctx.device), ctx.world).wait()
    out = []
    for trial in range(trials):
        torch.manual_seed(trial)
        model = TinyNet()  # other threads may reseed or draw meanwhile
        own = {n: p.detach().clone() for n, p in model.named_parameters()}
        model = shardkit.shard(model, auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
        out.append({"gathered": full_params(model), "own": own, "seeded": seeded_builds[trial]})
    return out


def compile_refusals(rank: int) -> dict[str, str]:
    """The error compiling a unit raises on XLA, by how: .compile(), compile_layers, openxla."""
    _, model = reference_and_copy(seed=0)
    model = shardkit.shard(model, auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    block = next(m for m in model.modules() if isinstance(m, Block))
    attempts = {"method": block.compile,
                "compile_layers": lambda: shardkit.wrap.compile_layers(model, Block),
                "openxla": lambda: block.compile(backend="openxla")}
    out = {}
    for how, attempt in attempts.items():
        try:
            attempt()
            out[how] = "no error"
        except shardkit.ShardkitError as exc:
            out[how] = str(exc)
    return out


def dropped_models(rank: int, rounds: int) -> list[int]:
    """`rounds` times: shard a TinyNet on this device thread, train 2 steps, drop it; how many of
    the model, its shards and its optimizer were still alive after each gc.collect()."""
    import gc
    import time
    import weakref

    alive = []
    for r in range(rounds):
        model, opt = sharded_tinynet(r)
        train_steps(model, opt, 0, 2)
        refs = [weakref.ref(model), weakref.ref(opt)] + [weakref.ref(p) for p in model.parameters()]
        del model, opt
        # The device threads share one collector, and a gc.collect() that meets another
        # thread's collection in progress returns at once without collecting: try again.
        for _ in range(40):
            gc.collect()
            if all(ref() is None for ref in refs):
                break
            time.sleep(0.05)
        alive.append(sum(ref() is not None for ref in refs))
    return alive


def torch_idioms(rank: int, world: int, steps: int = 3) -> dict:
    """torch's clip_grad_norm_ and load_state_dict on XLA device threads, against CPU unsharded."""
    import warnings

    ctx = shardkit.current_context()
    ref, model = reference_and_copy(seed=0)
    full = copy.deepcopy(ref.state_dict())
    model = shardkit.shard(model, auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    out: dict = {"norms": [], "ref_norms": [], "diffs": []}
    for step in range(steps):
        x, y = (t.to(ctx.device) for t in batch(step, rank))
        F.cross_entropy(model(x), y).backward()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        F.cross_entropy(ref(gx), gy).backward()
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        ref_opt.zero_grad()
        out["diffs"].append(max_diff_to(model, ref))
    model.load_state_dict(full)  # the unsharded model's dict: each thread keeps its rows
    gathered = full_params(model)
    out["loaded_diff"] = max((gathered[k] - full[k]).abs().max().item() for k in gathered)
    # warnings.catch_warnings is process-wide: with ranks as threads of one process one thread's
    # record can take the other's warning, so the model's own flag says whether this rank warned.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.state_dict()
    out["warned"] = get_state(model).warned_state_dict
    return out


def global_means(rank: int) -> list:
    """shardkit.global_mean on XLA device threads: a float and a device tensor per rank."""
    ctx = shardkit.current_context()
    return [shardkit.global_mean(float(rank + 1)),
            shardkit.global_mean(torch.tensor(rank + 1.0, device=ctx.device))]
