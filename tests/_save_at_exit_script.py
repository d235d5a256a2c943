"""A script whose last line starts a background save of many small tensors, then ends (issue 55).

The writer thread frees one host copy per tensor once the save is written; the process exits
as soon as the save is complete (atexit waits for it). Before the fix the writer said "done"
before it freed them, and freed them while the interpreter finalized: 9 of 10 runs aborted.
"""

import torch

import shardkit
import shardkit.checkpoint as ck

shardkit.init()
torch.manual_seed(0)
model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(400)]))
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 8)).sum().backward()
opt.step()
ck.save("ckpt", model, opt, background=True)
