"""The gradient all-reduce across replica groups, through a torchft Manager; and what a recovering group is sent.

Why torchft's Manager and not a shardkit group: a torch process group is fixed at creation, so a
dead member breaks it for good and every rank must restart. The Manager instead asks the
lighthouse for a quorum of the groups alive at each step, rebuilds its own process group when the
quorum changes, swallows a collective's failure into "this step is not committed" (every rank of
every group in the quorum then skips the optimizer step), and lets a group that (re)joins behind
the others fetch the state of a healthy one over HTTP before its first step counts.

Inside a group nothing changes: shard() shards across the group's ranks (its whole job) and
averages gradients over them as HYBRID_SHARD does inside a shard group; the mean across groups is
the Manager's (a sum over the participating groups divided by their number: the mean of equal-size
means is the mean over every sample that took part). A group that is still recovering contributes
zeros and is not counted.

The state a recovering rank receives is its own rank's: each group shards the same model the
same way over the same number of ranks, so rank r of one group holds exactly the rows rank r of
another holds. It is the sharded parameters (exact master values), the model's buffers, the
optimizer's state_dict and whatever else the user registered (an LR scheduler), never a gathered
model.
"""

from __future__ import annotations

import datetime
import os
import weakref
from typing import Any, Callable

import torch

from ..errors import ShardkitError
from ..logs import logger
from .requirement import require_torchft

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# Keys torchft's Manager writes into the group's store; a restarted group's ranks would otherwise
# read the dead incarnation's values before rank 0 writes the new ones.
_MANAGER_KEYS = ("manager_addr", "replica_id")


def replica_id(group: int) -> str:
    """The replica id torchft is given: it reads a group's number from the id's trailing digits."""
    return f"shardkit_replica_group_{group}"


class CrossGroups:
    """One sharded model's fault-tolerant all-reduce across replica groups (dies with the model)."""

    def __init__(self, manager: Any, process_group: Any, lighthouse: str, config: Any,
                 state_ref: Callable[[], Any], group_rank: int = 0, relaunch: int = 0) -> None:
        self.manager = manager
        self.group_rank = group_rank  # this rank within its replica group's own job
        self.relaunch = relaunch  # the launcher's restart count of this group (torchrun's)
        self.voted = False  # this incarnation's first vote is behind it
        self.process_group = process_group
        self.lighthouse = lighthouse
        self.config = config
        self.quorum_started = False  # zero_grad() of the wrapped optimizer starts each step's quorum
        self.registered: set[str] = set()  # keys of the state a rejoining group is sent
        self.first_bucket = False  # the step's first all-reduce still to come
        self.state_ref = state_ref  # the model's ShardState, weakly

    # ---- what the engine calls ------------------------------------------------------------------
    def all_reduce_mean(self, tensor: torch.Tensor) -> int:
        """Average `tensor` over the groups in this step's quorum, in place; returns how many took part.

        A failure (a group died mid-step) does not raise: the Manager records it, the tensor's
        value is then meaningless, and the step is not committed (FaultTolerantOptimizer.step).
        """
        if not self.quorum_started:
            raise ShardkitError(
                "a fault-tolerant model's backward ran before this step's quorum was started. "
                "HINT: wrap the optimizer, optimizer = shardkit.fault_tolerant_optimizer(model, "
                "optimizer), and call optimizer.zero_grad() at the start of every step (it joins "
                "the quorum) and optimizer.step() at its end (it commits or skips the step)")
        self.wait_quorum()
        if self.first_bucket:
            self.first_bucket = False
            if self.manager.current_step() == 0 and not self.manager.errored():
                self._check_same_start(tensor.device)
        participants = self.manager.num_participants()
        self.manager.allreduce(tensor).wait()
        return participants

    def _check_same_start(self, device: torch.device) -> None:
        """Raise on every rank of this group if its initial weights differ from another group's.

        The Manager is told init_sync=False: with init_sync it copies, per rank position, one
        group's initial rows into the others during the first step, and each position may copy
        from another group, so the first step's mean would stitch rows of different groups'
        gradients together. Instead every group starts from its own weights, which must then be
        equal: an elementwise max and min of this rank's rows across the groups (exact), once, at
        the first step of a job.
        """
        state = self.state_ref()
        if state is None:
            return
        rows = [sp.local.detach().reshape(-1).float() for sp in state.iter_params()]
        mine = torch.cat(rows).to(device) if rows else torch.zeros(0, device=device)
        from torch.distributed import ReduceOp

        high, low = mine.clone(), -mine
        self.manager.allreduce(high, reduce_op=ReduceOp.MAX).wait()
        self.manager.allreduce(low, reduce_op=ReduceOp.MAX).wait()
        differs = torch.tensor([float(not torch.equal(high, -low))], device=device)
        state.backend.collectives.all_reduce(differs, state.world, op="max").wait()
        if differs.item() and not self.manager.errored():
            raise ShardkitError(
                f"replica group {self.config.replica_group} starts from other initial weights "
                "than another replica group: each group would train its own model. HINT: build "
                "the model from the same seed in every group (torch.manual_seed(s) before "
                "constructing it), or load the same checkpoint in every group before training")

    def wait_quorum(self) -> None:
        """Block until this step's quorum is formed; a clear error if the lighthouse never answers."""
        try:
            self.manager.wait_quorum()
        except Exception as exc:  # torchft's RPC errors name neither the lighthouse nor the fix
            raise ShardkitError(
                f"replica group {self.config.replica_group} got no quorum from the torchft "
                f"lighthouse at {self.lighthouse} within quorum_timeout_s="
                f"{self.config.quorum_timeout_s:g} ({type(exc).__name__}: {exc}). Training "
                "cannot go on without it: the lighthouse decides which groups take part in each "
                "step. HINT: check that the lighthouse runs and is reachable from this host "
                "(torchft_lighthouse --min_replicas 1 --bind [::]:29510); restart it and then "
                "this group (the launcher's --max-restarts does), which rejoins from a healthy "
                "group or from its last checkpoint") from exc

    # ---- the state a recovering group is sent ---------------------------------------------------
    def register_state(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """Send `save()` to a recovering group and `load` it there (e.g. an LR scheduler's state)."""
        if key in self.registered:
            raise ShardkitError(f"state {key!r} is already registered for recovery; give each "
                                "piece of training state its own key")
        self.manager.register_state_dict_fn(key, load, save)
        self.registered.add(key)

    def start_quorum(self) -> None:
        """Ask the lighthouse for this step's quorum (asynchronously; the backward waits for it)."""
        self.manager.start_quorum()
        self.quorum_started = True
        self.first_bucket = True

    def should_commit(self) -> bool:
        """Whether every rank of every group in the quorum finished this step (a collective vote)."""
        try:
            committed = bool(self.manager.should_commit())
        finally:
            self.quorum_started = False
        if not self.voted:
            self.voted = True
            self._say_if_relaunched_into_a_new_run(committed)
        return committed

    def _say_if_relaunched_into_a_new_run(self, committed: bool) -> None:
        """A relaunched group heals from a group further along in its first quorum; where none was
        (every group it trained with had finished or was gone), its first committed step took it
        from step 0: it trains a new run from its initial weights, and nothing else would say so
        (issue 57: two groups relaunched 10.5 s after the kill, the survivor finished in 8.6)."""
        if not (committed and self.relaunch and self.group_rank == 0
                and int(self.manager.current_step()) == 1):
            return
        logger.warning(
            "replica group %d was relaunched (restart %d) and no group in its first quorum was past "
            "step 0: it trains from the weights it started with, as a new run, not from where the "
            "job was (the groups it trained with have finished or are gone). HINT: to continue "
            "the job instead, load its last checkpoint before the training loop",
            self.config.replica_group, self.relaunch)

    def shutdown(self) -> None:
        """Stop the Manager's servers and threads and drop its process group (never raises)."""
        try:
            self.manager.shutdown(wait=False)
            self.process_group.shutdown()
        except Exception as exc:  # noqa: BLE001 - runs from a finalizer
            logger.debug("torchft manager shutdown: %s", exc)


def _model_state_fns(state_ref: Callable[[], Any]) -> tuple[Callable[[Any], None], Callable[[], Any]]:
    """(load, save) of a model's sharded parameters and buffers, holding the model weakly."""

    def save() -> dict[str, Any]:
        state = state_ref()
        if state is None:
            return {}
        root = state.root_unit.module
        return {"shards": {sp.fqn: sp.local.detach() for sp in state.iter_params()},
                "buffers": {name: buf for name, buf in root.named_buffers()}}

    def load(received: dict[str, Any]) -> None:
        state = state_ref()
        if state is None:
            return
        shards = received["shards"]
        with torch.no_grad():
            for sp in state.iter_params():
                sp.local.copy_(shards[sp.fqn])
            buffers = dict(state.root_unit.module.named_buffers())
            for name, value in received["buffers"].items():
                buffers[name].copy_(value)
        for unit in state.units:  # anything gathered before the load holds the old values
            unit.to_sharded()

    return load, save


def clear_manager_keys(master_addr: str, master_port: int) -> None:
    """Remove a previous incarnation's Manager address from a group's store (its rank 0, before
    any rank of the group creates a Manager).

    Through a client of its own, as the Manager's: the store a launcher hands its workers may be
    prefixed per restart (torchrun's agent store), which would delete other keys than it reads.
    """
    from torch.distributed import TCPStore

    store = TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False)
    for key in _MANAGER_KEYS:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - absent on a first start
            pass


def start(config: Any, backend: Any, ctx: Any, state: Any) -> CrossGroups:
    """Create the Manager for `state`'s model on this rank (collective over the group's ranks)."""
    require_torchft()
    from torchft.manager import Manager

    lighthouse = config.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise ShardkitError(
            "FaultTolerance needs the torchft lighthouse's address. HINT: start one "
            "(torchft_lighthouse --min_replicas 1 --bind [::]:29510) and pass "
            f"FaultTolerance(lighthouse='http://HOST:29510', ...) or set {LIGHTHOUSE_ENV}")
    env = ctx.env
    if env.master_port is None:
        raise ShardkitError("FaultTolerance needs this replica group's own job store (a launcher "
                            "such as torchrun or `shardkit launch`, even for one rank)")
    timeout = datetime.timedelta(seconds=config.timeout_s)
    process_group = backend.collectives.fault_tolerant_process_group(timeout)
    if ctx.world.rank == 0:
        clear_manager_keys(env.master_addr, env.master_port)
    backend.collectives.barrier(ctx.world)  # no rank reads the store before the stale keys are gone
    connect_s = min(config.connect_timeout_s, config.quorum_timeout_s)
    try:
        manager = Manager(
            pg=process_group, load_state_dict=None, state_dict=None,
            min_replica_size=config.min_replica_groups, timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=datetime.timedelta(seconds=connect_s),
            rank=ctx.world.rank, world_size=ctx.world.size, store_addr=env.master_addr,
            store_port=env.master_port, lighthouse_addr=lighthouse,
            replica_id=replica_id(config.replica_group), init_sync=False)
    except Exception as exc:  # torchft's words name a connect_timeout FaultTolerance calls otherwise
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ShardkitError(
            f"replica group {config.replica_group} could not start torchft's Manager: it reaches "
            f"the torchft lighthouse at {lighthouse}, which did not answer within "
            f"connect_timeout_s={connect_s:g} ({type(exc).__name__}: {said}). HINT: start the "
            "lighthouse first (torchft_lighthouse --min_replicas 1 --bind [::]:29510) on that "
            f"host, check the address (FaultTolerance(lighthouse=...) or {LIGHTHOUSE_ENV}), or give "
            "it longer with FaultTolerance(connect_timeout_s=...)") from exc
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    cross = CrossGroups(manager, process_group, lighthouse, config, weakref.ref(state),
                        group_rank=ctx.world.rank, relaunch=int(restarts) if restarts.isdigit() else 0)
    load, save = _model_state_fns(cross.state_ref)
    cross.register_state("shardkit_model", load, save)
    finalizer = weakref.finalize(state, cross.shutdown)
    finalizer.atexit = False
    return cross
