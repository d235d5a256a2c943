"""What runs once, inside shard(): from a model and its options to the pieces the step runs with.

plan (which module is a unit, which unit owns each parameter), groups (shard / replicate groups, destroyed when their
model dies), mesh (a user's DeviceMesh checked and its groups taken instead), reshard (per-unit reshard_after_forward values, the k-rank groups), materialize
(meta-device init, module by module), fingerprint (every rank shards the same model the same
way), replicas (compare replicated values across ranks, or copy rank 0's), stale_optimizer (an
optimizer built before shard() is refused), report (the one-line log of what shard() made).
Nothing here runs in a training step; it imports from step/ and surface/, never the reverse.
"""
