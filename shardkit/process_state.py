"""Everything shardkit keeps for the life of the process, in one table, with one reset().

What belongs to a model lives on the model and dies with it: its engine state, units, shards,
gathered buffers, streams and the subgroups shard() created (destroyed by a finalizer when the
model is collected; sharding/setup/groups.py). Nothing process-wide may hold a model strongly: the
registries below that map modules, parameters or units to shardkit objects are weak on both
sides, because a weak-key map whose value refers back to its key keeps the key alive forever
(the leak of issue 33: every sharded model stayed in memory for the life of the process).

Everything else that outlives a model is listed in HELD, with what it is, why it is
process-wide, when it is installed and how it goes. `reset()` (called by
shardkit.testing.reset_state()) puts all of it back as a new process has it, in the table's
order; an entry whose `reset` is empty says in `removed` why it stays. tests/test_lifetimes.py
scans every module for module-level state and fails on one the table does not list.

The table names holders as "module:attribute" strings and imports a module only when reset()
finds it already imported, so this module imports nothing of shardkit and costs nothing to load.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Held:
    """One thing shardkit keeps process-wide."""

    holders: tuple[str, ...]  # "module:attribute" of each global that holds it
    what: str
    why: str  # why it is process-wide rather than the model's or the job's
    installed: str  # when it comes into being
    removed: str  # how it goes again
    reset: str = ""  # "module:function" that reset() calls; "" where it stays (see `removed`)


HELD: tuple[Held, ...] = (
    Held(("shardkit.checkpoint.background:_pending",),
         "handles of background checkpoint saves still being written",
         "the next save, load, shutdown() and the end of the process wait for them",
         "save(..., background=True)",
         "each handle leaves once its write finished; reset() forgets them (their daemon "
         "writer threads end on their own)",
         "shardkit.checkpoint.background:forget_pending"),
    Held(("shardkit.job.runtime:_process_context", "shardkit.job.runtime:_thread_local",
          "shardkit.job.runtime:_live_contexts"),
         "the job this process (or XLA device thread) joined: backend, world group, device; how "
         "many contexts are live (the job-wide hooks go with the last); an atexit entry that "
         "shuts the job down at a normal exit if the script did not",
         "torch's default process group is process-wide; device threads keep their own",
         "init() (or the first shard()/replicate() without one)",
         "shutdown()", "shardkit.job.runtime:reset_context"),
    Held(("shardkit.launch_env:_replaced_environ",),
         "the values of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and "
         "MASTER_PORT that init() replaced when it exported the job's launch variables",
         "os.environ is the process's; torch's env:// rendezvous reads it",
         "init() of a job with a rendezvous",
         "shutdown() puts the previous values back (a variable that was unset is removed)",
         "shardkit.launch_env:restore_environ"),
    Held(("shardkit.failure:_watchdog", "shardkit.failure:_previous_excepthook",
          "shardkit.failure:_original_excepthook", "shardkit.failure:_in_excepthook",
          "shardkit.failure:_parent_at_start"),
         "the watchdog thread that names a failed peer, and in launched ranks the sys.excepthook, "
         "SIGTERM handler and atexit stop() it installs; the launcher's pid at start",
         "a failure report speaks for the process: one watchdog per rank",
         "init() in jobs of two or more ranks",
         "shutdown() (failure.stop: the thread finishes, the hook, handler and atexit entry are "
         "put back)", "shardkit.failure:reset"),
    Held(("shardkit.failure.interrupt:_interrupted",),
         "whether a Ctrl-C reached this launched rank, and the SIGINT handler that notes it",
         "a signal handler is the process's; the Ctrl-C ends the whole process",
         "init() in a launched rank (failure.install_report_hooks)",
         "shutdown() puts Python's handler back (failure.stop); the note stays until the "
         "process ends", "shardkit.failure.interrupt:reset"),
    Held(("shardkit.failure.where:_where", "shardkit.failure.where:_forward_stack"),
         "where training is (unit and phase), for failure reports",
         "read by the watchdog thread and the exception hook, which know no model",
         "the engine's hooks, on every step", "init() and reset() clear it",
         "shardkit.failure.where:reset"),
    Held(("shardkit.job.step_boundary:_handle", "shardkit.job.step_boundary:_context_of_thread"),
         "a torch.optim post-step hook that cuts a lazy device's graph after each step",
         "torch.optim's step hooks are global",
         "init() with a backend whose capabilities set needs_step_boundary",
         "shutdown()", "shardkit.job.step_boundary:remove_step_hook"),
    Held(("shardkit.sharding.setup.stale_optimizer:_hook", "shardkit.sharding.setup.stale_optimizer:_replaced",
          "shardkit.sharding.setup.stale_optimizer:_checked"),
         "torch.optim pre/post-step hooks that refuse an optimizer built before shard(); weak "
         "references to the replaced parameters and to optimizers already checked",
         "torch.optim's step hooks are global",
         "the first shard()", "shutdown() removes the hooks (the next shard() adds them again); "
         "entries die with their parameters and optimizers",
         "shardkit.sharding.setup.stale_optimizer:uninstall"),
    Held(("shardkit.sharding.surface.local_step:_adopted", "shardkit.sharding.surface.local_step:_enabled"),
         "weak references to the optimizers whose step was put in front of (each holds an "
         "instance-level step that hands an elementwise step the DTensors' local tensors)",
         "an optimizer is adopted at its first step by the global step hook, which knows no model",
         "an optimizer's first step after shard()", "shutdown() turns every adopted step back into "
         "the class's (entries die with their optimizers)",
         "shardkit.sharding.surface.local_step:uninstall"),
    Held(("shardkit.sharding.surface.local_step:_declared",),
         "the optimizer classes a user declared elementwise (shardkit.elementwise_optimizer)",
         "a declaration about a class, made once where the class is defined",
         "shardkit.elementwise_optimizer(cls)", "reset() forgets them; entries die with their classes",
         "shardkit.sharding.surface.local_step:forget_declared"),
    Held(("shardkit.sharding.step.whole_view:_released_meshes",),
         "how many dead models' DeviceMeshes torch's DTensor op-sharding caches may still hold",
         "torch's caches are process-wide (and clearing them inside a finalizer is not safe)",
         "a sharded model with a mesh is collected",
         "the next shard(), shutdown() and reset() clear torch's caches",
         "shardkit.sharding.step.whole_view:forget_released_meshes"),
    Held(("shardkit.sharding.surface.torch_norms:_installed", "shardkit.sharding.surface.torch_norms:_replaced_clip"),
         "torch.nn.utils.clip_grad._get_total_norm and torch.nn.utils.get_total_norm replaced "
         "by a version that counts a sharded gradient as its whole parameter's (and, where a "
         "vendor library replaced torch.nn.utils.clip_grad_norm_, a function in front of it)",
         "torch's clip_grad_norm_ looks its total-norm function up in its module on every call",
         "the first shard()", "shutdown() puts torch's function back (the next shard() "
         "replaces it again)", "shardkit.sharding.surface.torch_norms:uninstall"),
    Held(("shardkit.sharding.step.whole_view:_item_op",
          "shardkit.sharding.step.whole_view:_previous_item_handler"),
         "a handler in torch's DTensor dispatcher that refuses .item()/float() of a Partial "
         "DTensor (p.grad.norm() of a sharded parameter) instead of returning this rank's part",
         "torch's DTensor dispatcher is one object for the process",
         "the first shard() that makes DTensor parameters",
         "shutdown() puts torch's behaviour back (the next such shard() installs it again)",
         "shardkit.sharding.step.whole_view:allow_partial_items"),
    Held(("shardkit.sharding.step.hooks:_UNIT_OF",),
         "module -> weak reference to the unit whose hooks it carries",
         "torch's module hooks and the recipe helpers (compile_layers) get a module, not a model",
         "shard()", "weak on both sides: an entry dies with its module",
         "shardkit.sharding.step.hooks:forget_units"),
    Held(("shardkit.sharding.surface.param_access:_REGISTRY",),
         "id(parameter) -> weak references to the shard, its ShardedParam and engine state",
         "full_shape/full_tensor/local_shard get a bare parameter",
         "shard()", "weak: dead entries are dropped at the next shard()",
         "shardkit.sharding.surface.param_access:forget_params"),
    Held(("shardkit.sharding.step.traced:_UNITS",),
         "graph key -> weak reference to the unit (the custom ops take strings, not objects)",
         "a compiled graph names units by key", "shard()", "weak: an entry dies with its unit",
         "shardkit.sharding.step.traced:forget_units"),
    Held(("shardkit.sharding.step.traced:_NEXT_KEY",),
         "the counter that names units for compiled graphs",
         "keys are baked into compiled graphs, which outlive a reset",
         "import", "never: a key reused after a reset could let a stale graph reach a new "
         "model's unit"),
    Held(("shardkit.sharding.step.traced:gather_unit", "shardkit.sharding.step.traced:reduce_unit"),
         "the torch.library custom ops shardkit::gather_unit and shardkit::reduce_unit",
         "torch's operator registry is process-wide", "import of shardkit.sharding.step.traced",
         "never: torch offers no way to unregister an operator; they hold no model"),
    Held(("shardkit.sharding.step.hooks:_never_a_graph_of_their_own",),
         "dynamo's skip list entries for the engine's two hook functions",
         "dynamo's skip list is process-wide", "the first shard()",
         "never: dynamo offers no way to remove one; they hold no model"),
    Held(("shardkit.sharding.setup.fingerprint:_calls",),
         "how many models this process sharded (the n-th shard() on each rank compares the same "
         "model's description in the job's store)",
         "every rank shards its models in the same order", "shard()",
         "reset() starts it again at 0, as a new process does",
         "shardkit.sharding.setup.fingerprint:reset_counter"),
    Held(("shardkit.sharding.step.verify:_models_made",),
         "how many models this process sharded with verify=True (each one's collective sequence "
         "keys in the job's store carry its number)",
         "every rank shards its models in the same order", "shard(verify=True)",
         "reset() starts it again at 0, as a new process does",
         "shardkit.sharding.step.verify:reset_counter"),
    Held(("shardkit.sharding.surface.module_api:_SHARDED_CLASSES",),
         "model class -> weak reference to its Sharded subclass (one per class)",
         "models of one class share a class", "shard()",
         "weak on both sides: an entry dies with the class or the last model of it",
         "shardkit.sharding.surface.module_api:forget_classes"),
    Held(("shardkit.lightning.precision:_SUBCLASSES",),
         "Lightning precision plugin class -> weak reference to its clipping subclass",
         "plugins of one class share a class", "the Lightning strategy's setup",
         "weak on both sides", "shardkit.lightning.precision:forget_subclasses"),
    Held(("shardkit.plugin.manager:_state",),
         "the plugins discovered through entry points, with their load failures",
         "entry points are read once per process", "the first backend lookup",
         "reset() (after each plugin's shardkit_reset_state hook)",
         "shardkit.plugin.manager:reset_plugins"),
    Held(("shardkit.job.selection:_instances",),
         "one Backend object per backend name", "a backend is chosen once per process",
         "the first get_backend()/init()", "reset()",
         "shardkit.job.selection:forget_backend_instances"),
    Held(("shardkit_backends.xla.threads:_GROUP_BARRIERS",),
         "barriers the XLA device threads of one run share", "the ranks are threads of one process",
         "init() in each device thread", "the xla plugin's shardkit_reset_state hook (reset_plugins)"),
    Held(("shardkit_backends.xla.backend:_local",),
         "per device thread: how many subgroups that thread made", "thread-local",
         "new_group() in a device thread", "dies with its thread"),
    Held(("shardkit.lightning.registration:install",),
         "a sys.meta_path finder that registers strategy='shardkit' when Lightning's strategy "
         "modules load", "Lightning reads no entry point for strategies",
         "import shardkit, while Lightning's strategies are not imported yet",
         "never: Lightning may be imported after any reset; it finds only those two modules"),
    Held(("shardkit.logs:configure_from_env",),
         "a stderr handler on the 'shardkit' logger", "SHARDKIT_LOG is a process setting",
         "import shardkit with SHARDKIT_LOG set", "never: logging is the application's to change"),
    Held(("shardkit.job.parent_death:die_with_parent",),
         "PR_SET_PDEATHSIG and a thread watching the launcher",
         "a rank of `shardkit launch` must die with its launcher for its whole life",
         "import shardkit (and init()) in a rank started by `shardkit launch`",
         "never: it ends with the process"),
    Held(("shardkit.checkpoint.background:_finish_at_exit",),
         "an atexit handler that waits for background saves", "the end of the process",
         "import shardkit.checkpoint.background",
         "never: it does nothing when no save is pending"),
    Held(("shardkit.testing.conformance:CHECKS",),
         "the conformance suite's checks by name", "filled once, as the module is imported",
         "import", "never changes after import"),
)


def holders() -> set[str]:
    """Every "module:attribute" the table lists."""
    return {h for held in HELD for h in held.holders}


def reset() -> None:
    """Put every process-wide thing back as a new process has it (for tests and long-lived services).

    Models sharded before are unusable afterwards (their job is shut down); their own state is
    left to the garbage collector with them.
    """
    for held in HELD:
        if not held.reset:
            continue
        module_name, function = held.reset.split(":")
        module = sys.modules.get(module_name)
        if module is not None:  # never imported: nothing of it to reset
            getattr(module, function)()


__all__ = ["HELD", "Held", "holders", "reset"]
