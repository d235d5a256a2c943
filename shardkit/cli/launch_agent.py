"""torchrun as `shardkit launch` runs it: the same agent, with a failure said in a few lines.

torchrun ends a failed job by raising its ChildFailedError out of its own `main`, so the user gets
torchrun's Python traceback (about 20 lines of launcher frames) and a 25-line table in which the
ranks torchrun itself stopped with SIGTERM show an empty traceback. The rank that failed has
already printed its traceback and every survivor shardkit's one-line report, so this prints one
line per rank saying how each ended, the root cause first, and exits 1 as torchrun does. A Ctrl-C
or a signal from outside (a scheduler's SIGTERM: scancel, a time limit, a requeue) ends it with one
line and 128 + the signal, where torchrun prints its agent's SignalException traceback.

    python -m shardkit.cli.launch_agent [torchrun options] -- script.py [script args]
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import sys
from typing import Any, Sequence

from typing_extensions import override

from ..failure import same_error
from ..failure.interrupt import INTERRUPTED_EXIT
from ..failure.watchdog import PEER_FAILED_EXIT


def _first_line(message: Any) -> str:
    """The error line of a failure's message (torchrun's error files hold a dict or a string)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line.strip() for line in str(message or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def root_cause(failures: dict[int, Any]) -> int:
    """The rank whose failure started it: not one that stopped because a peer failed (status 75)
    or that torchrun stopped (SIGTERM), where another failed; then the earliest, as torchrun.

    torchrun's own "first failure" goes by error-file time, and a rank killed with SIGKILL writes
    none: its time is when torchrun noticed, later than the survivors' reports of its death."""
    def order(rank: int) -> tuple[bool, bool, float, int]:
        code = failures[rank].exitcode
        return (code == PEER_FAILED_EXIT, code == -signal.SIGTERM, failures[rank].timestamp, rank)
    return min(failures, key=order)


def describe_failures(script: str, failures: dict[int, Any]) -> str:
    """The lines printed for a failed job: the root cause's rank first, then how each other rank ended."""
    root_rank = root_cause(failures)
    lines = [f"shardkit launch: {script} failed"]
    for rank in [root_rank, *sorted(r for r in failures if r != root_rank)]:
        failure = failures[rank]
        code = failure.exitcode
        where = f"rank {rank} (local {failure.local_rank}, pid {failure.pid})"
        if rank == root_rank:
            error = _first_line(failure.message)
            how = (f"was killed by {failure.signal_name()}" if code < 0 else f"exited with status {code}")
            lines.append(f"  {where} {how} (the root cause)"
                         + (f": {error}" if error and not error.startswith(("To enable traceback",
                                                                           "Signal ")) else "")
                         + (" (its traceback is above)" if code > 0 else ""))
        elif code == -signal.SIGTERM:
            lines.append(f"  {where} was stopped by torchrun (SIGTERM) after rank {root_rank} failed")
        elif code < 0:
            lines.append(f"  {where} was killed by {failure.signal_name()}")
        elif code == PEER_FAILED_EXIT:
            lines.append(f"  {where} exited with status {code}: it stopped because a peer failed "
                         f"(its report is above)")
        elif _first_line(failure.message) == _first_line(failures[root_rank].message):
            lines.append(f"  {where} exited with status {code}: the same error")
        else:
            lines.append(f"  {where} exited with status {code}: {_first_line(failure.message)}")
    return "\n".join(lines)


# torch's agent logs these as it stops the other ranks and as it notices a failed one; the
# summary below says both, rank by rank. Matched by format string: should torch reword them,
# they are printed again, and nothing else changes.
_SAID_BY_THE_SUMMARY = ("Sending process %s closing signal %s",
                        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s")


class _SaidOnce(logging.Filter):
    """Drop torch's agent records that shardkit launch's own lines say: everything it logs while
    it handles a signal ("Received 2 death signal", "Sending process ... closing signal SIGINT"),
    told by the exception it is handling, and the per-rank lines the failure summary repeats."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(sys.exc_info()[1], "sigval", None) is not None:
            return False  # handling a signal: main() says it in one line
        return record.msg not in _SAID_BY_THE_SUMMARY


def _remove_error_markers() -> None:
    """Remove the folders in which this launch's ranks agreed on who reports an error."""
    for folder in glob.glob(same_error.folder_prefix(os.getpid()) + "*"):
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun's agent on `argv`; on a failed job print describe_failures() and return 1;
    on a Ctrl-C or a SIGTERM/SIGHUP/SIGQUIT print one line and return 128 + the signal."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api as processes_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    get_error_handler().initialize()
    quiet = _SaidOnce()
    for module in (agent_api, processes_api):  # the modules that log the shutdown
        logging.getLogger(module.__name__).addFilter(quiet)
    try:
        run(args)
    except SignalException as exc:
        where = " on this node" if str(args.nnodes) not in ("1", "1:1") else ""
        if exc.sigval == signal.SIGINT:
            # Every rank got the same Ctrl-C from the terminal and stopped without a word.
            print(f"shardkit launch: interrupted; {args.nproc_per_node} ranks stopped{where}",
                  file=sys.stderr, flush=True)
            return INTERRUPTED_EXIT
        # A scheduler ending the job (SLURM's scancel, a time limit, a node failure's requeue)
        # or a kill: torch's agent stopped the ranks; its traceback would only show its frames.
        name = signal.Signals(exc.sigval).name
        print(f"shardkit launch: stopped by {name} from outside the job (a scheduler's cancel, "
              f"time limit or requeue, or a kill); {args.nproc_per_node} ranks stopped{where}",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)  # as a shell reports a process that the signal ended
    except ChildFailedError as exc:
        root = exc.failures[root_cause(exc.failures)]
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and os.path.isfile(root.error_file):
            # Under an outer torchelastic agent or scheduler: hand it the root cause, as torchrun does.
            get_error_handler().dump_error_file(root.error_file, root.exitcode)
        print(describe_failures(os.path.basename(args.training_script), exc.failures),
              file=sys.stderr, flush=True)
        return 1
    finally:
        _remove_error_markers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
