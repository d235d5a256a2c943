"""The flat-shard layout of one parameter: how far it is padded and how much each rank owns.

Pure integer arithmetic shared by the engine (ShardedParam) and the planner, so the bytes the
planner predicts are the bytes the engine allocates and sends.
"""

from __future__ import annotations


def shard_layout(numel: int, group_size: int, alignment: int = 1) -> tuple[int, int]:
    """Return (padded_numel, shard_numel) for a parameter of `numel` elements over `group_size` ranks.

    The flat parameter is right-padded to a multiple of group_size * alignment (at least one
    chunk, so an empty parameter still has a shard) and rank r owns [r*shard, (r+1)*shard).
    """
    chunk = group_size * max(1, alignment)
    padded = max(1, -(-numel // chunk)) * chunk
    return padded, padded // group_size
