"""Exceptions that tell the user what went wrong and what to do about it."""

from __future__ import annotations


class ShardkitError(RuntimeError):
    """Base class for every error shardkit raises on purpose."""


class ShardedStateDictWarning(UserWarning):
    """state_dict() of a sharded model was taken: it holds one rank's rows, not the whole model."""


class BackendNotFoundError(ShardkitError, LookupError):
    """A backend name that no installed plugin registers."""


class BackendUnavailableError(ShardkitError):
    """A registered backend that cannot run on this machine or install."""


class PluginLoadError(ShardkitError):
    """A plugin that failed to import or register; carries the original traceback text."""


class UnsupportedOperationError(ShardkitError, NotImplementedError):
    """A collective or reduce op that the selected backend cannot perform."""


class PeerFailedError(ShardkitError):
    """This rank stopped because another rank of the job failed; the message names it."""

    # Set once the message is on stderr: left uncaught in a launched rank, the process then ends
    # with PEER_FAILED_EXIT and prints nothing more, as when the watchdog thread reports first.
    reported = False
