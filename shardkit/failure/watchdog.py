"""A per-rank watchdog: heartbeats and a failure board in the job's store, so a rank that dies or
raises is named, and the ranks left waiting for it exit within the timeout instead of hanging.

Every rank runs one daemon thread. Each tick it bumps its heartbeat counter and reads the board.
A peer counts as failed when it posted to the board (it raised), when its process is gone (peers
on this node, as node.py defines it: checked by pid, so a SIGKILL is seen within a tick), or when its heartbeat has not
moved for `timeout` seconds (peers elsewhere). A survivor then prints who failed and where it was
itself (unit and phase), and exits: its training thread may be blocked inside a collective that
no Python code can interrupt.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from . import interrupt, launcher_record, where
from .node import node_identity, pid_alive

# The exit status of a rank that stops because another rank failed (not because of itself).
PEER_FAILED_EXIT = 75
_DONE = -(1 << 40)  # added to a heartbeat counter when its rank shuts down cleanly
_DIED = "died (its process is gone: killed, or it exited without reporting an error)"
_SILENT = "stopped responding"  # a peer whose heartbeat stopped: hung, or its machine is gone
_UNREACHABLE = "is unreachable"  # the job's store host (rank 0 under spawn) stopped answering
_PREFIX = "shardkit/failure/"
# Posted by a rank as it ends by SIGTERM: its peers read that it was stopped, not that it died.
_STOPPED = "was terminated by SIGTERM"
TERMINATED = (f"{_STOPPED} (from its launcher or a scheduler: scancel, a time limit, a requeue, "
              "or a kill)")
ORPHANED = f"{_STOPPED} (the process that launched it ended)"
_FINISHED = ("finished: it shut down cleanly (shardkit.shutdown() or the end of its script) while "
             "this rank still expected it in a collective")


def abandon_background_saves(reason: str) -> None:
    """Give up this process's background checkpoint saves: it is ending after a failure, and
    waiting for them would wait for peers that may be dead (the write timeout: 30 minutes)."""
    writer = sys.modules.get("shardkit.checkpoint.background")
    if writer is not None:
        writer.abandon_pending(reason)


@dataclass(frozen=True)
class Failure:
    """One failed rank and what is known about why."""

    rank: int
    cause: str
    posted: bool = False  # the rank posted this itself: it is alive and reading the store

    @property
    def stopped(self) -> bool:
        """The rank was ended by a SIGTERM (posted as it ended), not by a failure of its own."""
        return self.cause.startswith(_STOPPED)

    @override
    def __str__(self) -> str:
        return f"rank {self.rank} {self.cause}"


class Watchdog:
    """Heartbeat, failure board and dead-peer detection for one rank of a process-group job."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float,
                 may_exit: bool = True) -> None:
        self.store = store
        self.may_exit = may_exit  # False in a REPL or notebook: report, never end the process
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        # Ticks fine enough to notice a death well inside the timeout, coarse enough to cost nothing.
        self.interval = min(1.0, max(0.05, timeout / 20))
        self.node = node_identity()  # None: no peer's pid can be checked from here
        self.peers = [r for r in range(world_size) if r != rank]
        self._beats = {r: (-1, time.monotonic()) for r in self.peers}
        self._local_pids: dict[int, int] | None = None
        # Each peer's host name, from the node identity read once with its pid: a report names
        # the machine of a peer that lives on another one (the node to look at, or the one that
        # went down).
        self.host = socket.gethostname()
        self._peer_hosts: dict[int, str] = {}
        self._done: set[int] = set()  # peers that shut down cleanly or stopped after a failure
        # Under shardkit.spawn and plain env:// launches rank 0's process hosts the store; under
        # torchrun its agent does.
        self.agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.hosts_store = rank == 0 and not self.agent_hosts_store
        self._store_errors = 0
        self._stop = threading.Event()
        self._reported = False
        self.report_message = ""  # what exit_as_survivor printed, once it has
        # Set once this rank posted its own failure and every survivor read it: the store's host
        # may be gone from then on, and touching the store would only print C++ warnings.
        self._detached = False
        # Set once this rank's report is out: a SIGTERM that lands between another path's claim
        # and its print must not end the process with nothing said.
        self.report_written = threading.Event()
        self._lock = threading.Lock()
        store.set(f"{_PREFIX}pid/{rank}", f"{self.node or '-'}:{os.getpid()}")
        store.add(f"{_PREFIX}hb/{rank}", 1)
        self._thread = threading.Thread(target=self._run, name="shardkit-watchdog", daemon=True)
        self._thread.start()

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                failures = self.check()
            except Exception as exc:  # noqa: BLE001 - the store itself is the casualty
                if self._stop.is_set() or self.hosts_store_rank_done():
                    return  # rank 0 finished cleanly and took the store with it: nothing to watch
                self._store_errors += 1
                if self._store_errors < 3:
                    continue
                failures = [self._store_lost(exc)]
            else:
                self._store_errors = 0
            if failures and not self._stop.is_set():
                self.exit_as_survivor(failures)

    def hosts_store_rank_done(self) -> bool:
        """True once rank 0 (the store's host, unless a launcher agent hosts it) has shut down cleanly."""
        return 0 in self._done and not self.agent_hosts_store

    def _store_lost(self, exc: BaseException) -> Failure:
        # Every later store call would fail too, each printing torch's C++ warning with a
        # backtrace: this rank no longer touches the store.
        self._detached = True
        dead = [r for r in self._dead_local_peers(cached_only=True) if r not in self._done]
        if dead:
            return Failure(dead[0], _DIED)
        if self.hosts_store_rank_done():
            return Failure(0, _FINISHED)  # and took the store with it, as its process ended
        # Under shardkit.spawn and plain env:// launches rank 0 hosts the store; under torchrun
        # its agent does, so a lost store there means the launcher itself went away. torch's
        # message carries a C++ backtrace after its first line: the first line says it.
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Failure(0, f"{_UNREACHABLE}: the job's store stopped answering ({said}); rank 0 "
                          "hosts it unless a launcher agent does, so rank 0 most likely died")

    def finish(self) -> None:
        """Stop the thread and mark this rank done, so peers do not take its exit for a death."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        if self._detached:
            return
        try:
            self.store.add(f"{_PREFIX}hb/{self.rank}", _DONE)
            if self.hosts_store:
                # This process hosts the store: leaving before the others are done would look
                # to them like rank 0 dying. Bounded, and skipped when a failure was reported.
                deadline = time.monotonic() + min(self.timeout, 10.0)
                while not self._reported and time.monotonic() < deadline:
                    if all(self.store.add(f"{_PREFIX}hb/{r}", 0) < 0 for r in self.peers):
                        break
                    time.sleep(self.interval / 2)
        except Exception:  # noqa: BLE001 - the store went first; nothing left to tell
            pass

    # ---- detection -------------------------------------------------------------------------
    def check(self) -> list[Failure]:
        """Beat once and return the peers known to have failed (empty when all look alive)."""
        store = self.store
        # Pids first: a dead store host must not hide which local rank is gone.
        gone = [r for r in self._dead_local_peers(cached_only=True) if r not in self._done]
        if 0 in gone and not self.agent_hosts_store:
            self._detached = True  # the store died with its host: calls would only fail, loudly
            return [Failure(r, _DIED) for r in gone]
        try:
            store.add(f"{_PREFIX}hb/{self.rank}", 1)
            failures = self.posted()
            counts = {r: store.add(f"{_PREFIX}hb/{r}", 0) for r in self.peers}
        except Exception:
            if gone:
                return [Failure(r, _DIED) for r in gone]
            raise
        self._done = {r for r, c in counts.items() if c < 0}
        known = {f.rank for f in failures}
        now = time.monotonic()
        for rank in self._dead_local_peers():
            if rank not in known and rank not in self._done:
                # Its heartbeat was read before its pid: a peer that shut down cleanly and
                # exited in between is gone but not dead (it marked itself done first).
                if store.add(f"{_PREFIX}hb/{rank}", 0) < 0:
                    self._done.add(rank)
                    counts[rank] = -1
                    continue
                failures.append(Failure(rank, _DIED))
                known.add(rank)
        for rank, count in counts.items():
            last, since = self._beats[rank]
            if count < 0:
                continue  # shut down cleanly
            if count != last:
                self._beats[rank] = (count, now)
            elif rank not in known and now - since > self.timeout:
                failures.append(Failure(rank, f"{_SILENT} (no heartbeat for "
                                              f"{now - since:.1f} s, timeout {self.timeout:g} s)"))
        return failures

    def posted(self) -> list[Failure]:
        """Failures that ranks posted themselves (an exception they raised)."""
        if self.store.add(f"{_PREFIX}board", 0) == 0:
            return []
        out = []
        for rank in self.peers:
            key = f"{_PREFIX}failed/{rank}"
            if self.store.check([key]):
                out.append(Failure(rank, self.store.get(key).decode(), posted=True))
        return out

    def _dead_local_peers(self, cached_only: bool = False) -> list[int]:
        if self._local_pids is None:
            if cached_only:
                return []
            pids, hosts = {}, {}
            for rank in self.peers:
                key = f"{_PREFIX}pid/{rank}"
                if not self.store.check([key]):
                    return []  # not every peer has started its watchdog yet
                node, _, pid = self.store.get(key).decode().rpartition(":")
                if self.node is not None and node == self.node:
                    pids[rank] = int(pid)
                if node != "-":  # node_identity() starts with the host name
                    hosts[rank] = node.partition("/")[0]
            self._peer_hosts = hosts
            self._local_pids = pids
        return [rank for rank, pid in self._local_pids.items() if not pid_alive(pid)]

    def diagnose(self, wait: float) -> list[Failure]:
        """After a collective failed here: find the culprit, giving peers `wait` seconds to show life."""
        deadline = time.monotonic() + wait
        start: dict[int, Any] = {}
        while True:
            try:
                failures = self.check()
                if failures:
                    return failures
                counts = {r: self.store.add(f"{_PREFIX}hb/{r}", 0) for r in self.peers}
            except Exception as exc:  # noqa: BLE001
                return [self._store_lost(exc)]
            start = start or counts
            if time.monotonic() >= deadline:
                # The job already failed, so a peer silent for the whole window is the suspect.
                return [Failure(r, f"{_SILENT} (no heartbeat while this rank waited "
                                   f"{wait:.1f} s after the collective failed)")
                        for r in self.peers if 0 <= counts[r] == start[r]]
            time.sleep(self.interval / 2)

    # ---- reporting -------------------------------------------------------------------------
    def post(self, cause: str) -> None:
        """Tell every peer that this rank failed with `cause`, and give them a moment to report."""
        try:
            self.store.set(f"{_PREFIX}failed/{self.rank}", cause)
            self.store.add(f"{_PREFIX}board", 1)
            # Peers report before this process exits, so the launcher (which stops every rank
            # once one exits) does not cut their messages off.
            deadline = time.monotonic() + min(self.timeout, 3 * self.interval + 1)
            while time.monotonic() < deadline:
                if self.store.add(f"{_PREFIX}acks", 0) >= self.world_size - 1:
                    # Done: the store's host, which waits for this before it exits, may go now.
                    self.store.add(f"{_PREFIX}hb/{self.rank}", _DONE)
                    self._detached = True
                    break
                time.sleep(self.interval / 2)
        except Exception:  # noqa: BLE001 - the store may be gone with a peer; nothing to tell
            pass

    def culprits(self, failures: list[Failure]) -> str:
        """The failures a report names, described: a rank a launcher stopped after another failed
        is not part of the story (named only when nothing else is known)."""
        told = [f for f in failures if not f.stopped] or failures
        return "; ".join(self.describe(f) for f in told)

    def describe(self, failure: Failure) -> str:
        """`failure` as a report says it: with the peer's host name where it is not this rank's."""
        host = self._peer_hosts.get(failure.rank)
        if host is None or host == self.host:
            return str(failure)
        return f"rank {failure.rank} (on {host}) {failure.cause}"

    def mark_terminated(self, orphaned: bool) -> None:
        """Post that this rank is ending by a SIGTERM, so a peer that finds its process gone
        says it was stopped (and by what: `orphaned`, its launcher ended), not that it died."""
        if self._detached:
            return
        try:
            self.store.set(f"{_PREFIX}failed/{self.rank}", ORPHANED if orphaned else TERMINATED)
            self.store.add(f"{_PREFIX}board", 1)
        except Exception:  # noqa: BLE001 - the store may be gone already; nothing to tell
            pass

    def survivor_message(self, failures: list[Failure]) -> str:
        """The error a rank left behind by `failures` prints."""
        culprits = self.culprits(failures)
        failures = [f for f in failures if not f.stopped] or failures
        if all(f.cause == TERMINATED for f in failures):
            cause = ("nothing failed in training: the job was stopped from outside, and this "
                     "rank stops with it")
        elif all(f.stopped for f in failures):
            cause = ("a rank's launcher ended (killed, out of memory, or its machine went down): "
                     "look at that launcher's output and at its host")
        elif all(f.cause == _FINISHED for f in failures):
            cause = ("every rank must issue the same collectives: run the same number of steps "
                     "on every rank (equal batches per rank, e.g. DistributedSampler with "
                     "drop_last=True) and let each finish its loop before shutdown()")
        elif all(f.cause == _DIED or f.cause.startswith(_UNREACHABLE) for f in failures):
            # Nothing was posted: a kill, an OOM kill, or a crash, which the collective library
            # itself causes when ranks issue collectives that do not match (gloo aborts); a store
            # host that stopped answering died the same way.
            cause = ("look at the failed rank's own output (killed, out of memory, or crashed; a "
                     "crash inside a collective can mean the ranks issued different collectives: "
                     "SHARDKIT_DEBUG=1 names the first difference)")
        elif all(f.cause.startswith(_SILENT) for f in failures):
            cause = ("a rank stops responding when its process hangs (stopped, in a debugger, "
                     "holding the GIL in a deadlock) or its machine went down or lost its network: "
                     "look at that rank's own output and at its host")
        else:
            cause = "the failed rank's own error is the cause"
        return (f"shardkit: {culprits}. Rank {self.rank} stops too; it was in {where.describe()} "
                f"when the failure was noticed. HINT: {cause}; the time to notice is bounded by "
                f"timeout={self.timeout:g} s (shardkit.init(timeout=...) or SHARDKIT_TIMEOUT)")

    def exit_as_survivor(self, failures: list[Failure]) -> None:
        """Print who failed and where this rank was, then end the process (it may be stuck in C++)."""
        with self._lock:
            if self._reported:
                return
            self._reported = True
        message = self.survivor_message(failures)
        self.report_message = message
        if interrupt.interrupted() and self.may_exit:
            # The peer ended by the same Ctrl-C as this rank: nothing failed, nothing to say.
            abandon_background_saves("it was interrupted")
            os._exit(interrupt.INTERRUPTED_EXIT)
        emit(message)
        launcher_record.record(message, "", failed_here=False)
        self.report_written.set()
        self.acknowledge(failures)
        self.linger(failures)
        self.await_posters(failures)
        if not self.may_exit:
            # The user's process: the blocked call fails by the timeout and raises there.
            self._stop.set()
            return
        abandon_background_saves("a peer failed")
        for stream in (sys.stdout, sys.stderr):  # os._exit drops what is still buffered
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream: nothing to save
                pass
        os._exit(PEER_FAILED_EXIT)

    def linger(self, failures: list[Failure]) -> None:
        """As the store's host, stay until every other survivor has reported and every rank that
        posted its own failure has seen the reports (bounded)."""
        if not self.hosts_store or self._detached:
            return
        failed = {f.rank for f in failures if not f.posted}
        deadline = time.monotonic() + min(self.timeout, 5.0)
        try:
            while time.monotonic() < deadline:
                if all(r in failed or self.store.add(f"{_PREFIX}hb/{r}", 0) < 0
                       for r in self.peers):
                    return
                time.sleep(self.interval / 2)
        except Exception:  # noqa: BLE001
            pass

    def await_posters(self, failures: list[Failure]) -> None:
        """Let the ranks that posted their own failure exit before this one (bounded).

        A launcher that names "the first observed failure" (torchrun) names the first process
        to exit: that must be the failed rank, not a survivor with status 75; and a failed rank
        still reporting must not be SIGTERMed by the launcher into a second, confusing report.
        """
        posters = [f.rank for f in failures if f.posted]
        if not posters or self._detached:
            return
        local = self._local_pids or {}
        deadline = time.monotonic() + min(self.timeout, 5.0)
        try:
            while time.monotonic() < deadline:
                if all(not pid_alive(local[r]) if r in local
                       else self.store.add(f"{_PREFIX}hb/{r}", 0) < 0 for r in posters):
                    return
                time.sleep(self.interval / 4)
        except Exception:  # noqa: BLE001 - the store went with its host: nothing left to wait for
            pass

    def await_own_exit(self) -> str:
        """In another thread, once this thread reported a peer's failure: wait while it lingers
        and ends the process (a launched rank); return what it printed if the process goes on."""
        self.report_written.wait(timeout=self.timeout)
        if self.report_message:  # this thread reported (not the caller's own earlier report)
            self._stop.wait(timeout=2 * min(self.timeout, 5.0) + 1.0)
        return self.report_message

    def claim_report(self) -> bool:
        """Return True once: the caller, not the thread, reports this rank's failure."""
        with self._lock:
            if self._reported:
                return False
            self._reported = True
            return True

    def acknowledge(self, failures: list[Failure] | None = None) -> None:
        """Count this rank as having reported a peer's failure (and not as a failure itself);
        with `failures`, leave them where a rank the launcher stops next can read them."""
        if self._detached:
            return
        try:
            if failures:
                self.store.set(f"{_PREFIX}reported", self.culprits(failures))
            self.store.add(f"{_PREFIX}hb/{self.rank}", _DONE)
            self.store.add(f"{_PREFIX}acks", 1)
        except Exception:  # noqa: BLE001
            pass

    def reported_by_a_peer(self) -> str:
        """The failures a peer reported before it stopped (acknowledge), or "" if none did."""
        key = f"{_PREFIX}reported"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else ""
        except Exception:  # noqa: BLE001 - the store may be gone
            return ""


def emit(message: str) -> None:
    """Write a failure report to stderr and, when set, to the file SHARDKIT_ERROR_FILE names."""
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    path = os.environ.get("SHARDKIT_ERROR_FILE")
    if path:
        try:
            with open(path, "a") as f:
                f.write(message + "\n")
        except OSError:
            pass


def default_store_client() -> Any | None:
    """A second connection to the process group's store (its key prefix included), or None."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        return store.clone() if hasattr(store, "clone") else store
    except Exception:  # noqa: BLE001 - no store to share (HashStore of a lone rank, other backends)
        return None


def as_seconds(timeout: datetime.timedelta | float | str) -> float:
    """A timeout in seconds, whatever form it was given in."""
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)
