# Before, FSDP2:  torchrun --nproc-per-node 2 fsdp2_train.py OUT_DIR
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)],
                      nn.Linear(64, 4))
mp = MixedPrecisionPolicy(param_dtype=torch.float32,
                          reduce_dtype=torch.float32)
for layer in model:
    if isinstance(layer, Block):
        fully_shard(layer, mp_policy=mp)
fully_shard(model, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = torch.Generator().manual_seed(rank)
for step in range(1, 31):
    x = torch.randn(32, 16, generator=batches)
    loss = nn.functional.cross_entropy(model(x), x[:, :4].argmax(dim=1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {mean.item() / world_size:.6f}")
dcp.save({"model": get_model_state_dict(model)},
         checkpoint_id=f"{sys.argv[1]}/dcp")
dist.destroy_process_group()
