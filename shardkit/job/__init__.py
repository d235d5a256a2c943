"""Joining and leaving the job: the process-level life of a rank, above the backend interface.

selection (which backend: backend=, SHARDKIT_BACKEND, a plugin's hook, or the best available;
"DEVICE+COLLECTIVES" pairs), rendezvous (the job's store, checked to be this job's, handed to the
backend in LaunchEnv.store), runtime (init() / shutdown(): the rank's context, the watchdog, the
step hook), step_boundary (the optimizer post-hook that cuts a lazy device's graph), spawn
(shardkit.spawn: N local ranks, their reports), parent_death (ranks end with their launcher).
The engine (sharding/) reads only runtime's context; users reach these through the shardkit face.
"""
