"""A training job that survives restarts: checkpoint every N steps, resume from the newest complete one.

    shardkit launch --nproc 2 --max-restarts 3 examples/elastic_resume.py --ckpt-dir ckpt --steps 60
    shardkit launch --nnodes 1:2 --nproc 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/elastic_resume.py --ckpt-dir /shared/ckpt   # on each node

When a rank or a node dies, torchrun's elastic agent stops the survivors and starts the worker
group again (up to --max-restarts times); every new start of this script finds the newest complete
checkpoint with `shardkit.checkpoint.latest` and goes on from its step. The data order depends only
on the step, so the resumed job sees the batches the lost steps saw, and its weights equal those of
a run that was never interrupted. With `--nnodes 1:2` a lost node's agent leaves and the job goes
on at the smaller world size: the global batch (--batch) stays the same, so each rank takes a
larger slice of it, and the sharded checkpoint reloads into the new sharding.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
import torch.nn.functional as F

import shardkit
import shardkit.checkpoint as ck
from shardkit.demo.data import load_digits_28
from shardkit.wrap import transformer_layers


class Block(torch.nn.Module):
    """A residual MLP block: one shardkit unit each."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


def build_model(width: int, depth: int) -> torch.nn.Module:
    """Digits classifier: 784 -> width -> depth blocks -> 10, the same weights on every start."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, width),
                               *(Block(width) for _ in range(depth)), torch.nn.Linear(width, 10))


def batch_for_step(images: torch.Tensor, labels: torch.Tensor, step: int, batch: int):
    """The global batch of `step`: a permutation seeded by its epoch, so any restart sees the same order."""
    per_epoch = len(images) // batch
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
    rows = order[index * batch:(index + 1) * batch]
    return images[rows], labels[rows]


def prune(ckpt_dir: str, keep: int) -> None:
    """Rank 0: remove all but the newest `keep` complete checkpoints (an unfinished one the next save clears)."""
    for path in ck.complete(ckpt_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    """Train --steps steps on the digits, saving every --every and resuming from the newest save."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, help="where step_NNNNNN checkpoints go (shared by all nodes)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints kept")
    p.add_argument("--batch", type=int, default=64, help="global batch, split across the ranks")
    p.add_argument("--background", action="store_true",
                   help="write checkpoints from a thread (the step waits only for host copies)")
    p.add_argument("--export", default=None, help="write the final weights here as safetensors")
    args = p.parse_args()

    ctx = shardkit.init()
    rank, world = ctx.rank, ctx.world_size
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split evenly across {world} ranks")
    train, _ = load_digits_28()
    images, labels = train.images, train.labels
    model = shardkit.shard(build_model(128, 3), auto_wrap_policy=transformer_layers({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)

    step = 0
    resume = ck.latest(args.ckpt_dir, verify=True)  # skips a newest one damaged after its save
    if resume is not None:
        step = ck.load(resume, model, opt)["step"]
    if rank == 0:
        print(f"world size {world}: " + (f"resumed from {resume} at step {step}" if resume
                                         else "starting at step 0"), flush=True)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    share = args.batch // world
    while step < args.steps:
        x, y = batch_for_step(images, labels, step, args.batch)
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.every == 0 or step == args.steps:
            ck.save(os.path.join(args.ckpt_dir, f"step_{step:06d}"), model, opt,
                    extra={"step": step}, background=args.background)
            if rank == 0:
                prune(args.ckpt_dir, args.keep)
    if args.export:
        ck.export(args.export, model)
    shardkit.shutdown()


if __name__ == "__main__":
    main()
