"""Fault tolerance across replica groups: HYBRID_SHARD on a torchft Manager (`shardkit[ft]`).

A failure inside a group (a rank dies) still ends that group's job, which its launcher restarts;
what this package adds is that the *other* groups keep training meanwhile, and that the
restarted group rejoins with the current weights and optimizer state fetched live from a healthy
group instead of a checkpoint. Files:

- requirement.py: import torchft, or say which extra installs it.
- cross_groups.py: the object the engine calls for the gradient all-reduce across groups (the
  Manager's fault-tolerant all-reduce) and what a recovering group is sent (its shards, its
  optimizer's state) and loads; made by shard(), it dies with the model.
- optimizer.py: the optimizer wrapper: zero_grad() joins the step's quorum, step() steps only
  when every group in the quorum committed.

It sits below the engine and imports nothing of it (the model's state is read by duck typing):
shard() (sharding/api.py) starts a model's CrossGroups only when `fault_tolerance=` is given, so
plain installs never import torchft, and shardkit.fault_tolerant_optimizer
(sharding/surface/fault_tolerant.py) finds it on the model.
"""

from .optimizer import FaultTolerantOptimizer
from .requirement import require_torchft

__all__ = ["FaultTolerantOptimizer", "require_torchft"]
