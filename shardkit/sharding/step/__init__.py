"""What runs every training step: the engine's runtime, imported by setup/ and surface/ and
importing neither.

state (the model's
runtime: execution order, prefetch, the backward finaliser), unit (one unit's unshard / reshard /
reduce; it sees the state through its UnitRuntime protocol), lifecycle (a unit's ShardedState and
TrainingState machines), param (one parameter's shard and gathered tensor), layout (a parameter's
dim-0 row split), whole_view (the DeviceMesh and the DTensor of the whole parameter training code
sees; .item() of a partial value refused), hooks (module and autograd hooks), traced (a unit's
gather and reduce as custom ops inside a compiled graph), comms/ (the collective strategies each
unit chooses once at shard(): the backend's own, int8 blocks in one or two hops, a user's comm;
the template around them: streams, events, replica and cross-group steps), collectives (fused
copy-in, copy-out and gradient packing), quantize (the int8 block code of
shardkit.Quantization's payloads), buckets (which parameters share a collective), buffers (flat-buffer reuse on
host-ordered devices), reduce_ops (AVG / PREMUL_SUM or SUM + divide), casts (mixed-precision
casts of inputs and outputs), verify (every rank issues the same collective, under
SHARDKIT_DEBUG), traffic (bytes sent), trace (`shardkit::` profiler ranges, free without a
profiler).
"""
