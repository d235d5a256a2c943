"""What a sharded model offers the code that trains it (called by users, checkpoint/ and the
Lightning strategy; built on step/).

module_api (no_sync, unshard, gradient sync, explicit prefetch; dtype/device changes refused),
param_access (global shape, full tensor and local rows of a sharded parameter), views (the
checkpoint contract: one view per parameter's shard), clip (clip_grad_norm_), torch_norms
(torch's clip_grad_norm_ / get_total_norm see whole parameters), state_dict_hooks (state_dict()
tags and warns, load_state_dict() cuts a full dict to rows), forward_methods (other methods run
under the hooks), recipes (compile_layers, checkpoint_layers: shardkit.wrap.*), fault_tolerant
(fault_tolerant_optimizer: the optimizer of a model sharded with fault_tolerance=), local_step
(an elementwise optimizer steps the DTensor parameters' local tensors: shardkit.elementwise_optimizer).
"""
