# Run: shardkit launch --nproc 2 examples/quickstart.py   (or torchrun --nproc-per-node 2 ...)
import torch
from torch import nn

import shardkit


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


ctx = shardkit.init()                         # reads torchrun / mpirun / SLURM variables
torch.manual_seed(0)                          # every rank builds the same model
model = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)], nn.Linear(64, 4))
model = shardkit.shard(model,                 # shards in place; parameter names unchanged
                       strategy=shardkit.ShardingStrategy.FULL_SHARD,
                       auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                       mixed_precision=shardkit.MixedPrecision(param_dtype=torch.bfloat16,
                                                               reduce_dtype=torch.float32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # after shard(): it sees the shards
batches = torch.Generator().manual_seed(ctx.rank)     # each rank draws its own data
recent = []
for step in range(1, 101):
    x = torch.randn(32, 16, generator=batches)
    y = x[:, :4].argmax(dim=1)                # a rule the model can learn
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    shardkit.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    recent.append(loss.item())                # this rank's share of the batch
    if step % 20 == 0:
        mean = shardkit.global_mean(sum(recent) / len(recent))   # collective: every rank calls it
        if ctx.rank == 0:
            print(f"step {step}, {ctx.world_size} ranks: mean loss {mean:.3f}")
        recent.clear()
shardkit.checkpoint.save("quickstart-ckpt", model, opt, extra={"step": step})  # loads at any world size
shardkit.shutdown()
