# After, shardkit:  shardkit launch --nproc 2 shardkit_train.py OUT_DIR
import sys

import torch
from torch import nn

import shardkit


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


ctx = shardkit.init()  # any backend: cpu, cuda, xpu, xla
rank, world_size = ctx.rank, ctx.world_size
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)],
                      nn.Linear(64, 4))
mp = shardkit.MixedPrecision(param_dtype=torch.float32,
                            reduce_dtype=torch.float32)
blocks = shardkit.wrap.transformer_layers({Block})
model = shardkit.shard(model, auto_wrap_policy=blocks,  # every block, the root
                       mixed_precision=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = torch.Generator().manual_seed(rank)
for step in range(1, 31):
    x = torch.randn(32, 16, generator=batches)
    loss = nn.functional.cross_entropy(model(x), x[:, :4].argmax(dim=1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    mean = shardkit.global_mean(loss.item())  # or dist.all_reduce
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {mean:.6f}")
# loads at any world size, on any backend
shardkit.checkpoint.save(f"{sys.argv[1]}/ckpt", model, opt)
shardkit.shutdown()
