"""torch_xla's FSDP MNIST example (test_train_mp_mnist_fsdp_with_ckpt.py), through `shardkit.shard`.

What changed from the original: `XlaFullyShardedDataParallel(model)` became `shardkit.shard(model)`,
`torch_xla.launch(_mp_fn)` became `shardkit.spawn(_mp_fn, nproc, backend="xla")` (it returns each
rank's result), `xm.mesh_reduce` became a shardkit all_reduce, and the data is a synthetic
MNIST-like set (8x8 class prototypes plus noise) so the example needs no download. As in the
original, the loop calls `optimizer.step()`, never `xm.optimizer_step()` (that would all-reduce the
already reduce-scattered gradients again); the graph cut after the step (`torch_xla.sync()`) is
done by shardkit's optimizer post-hook, so the loop has no XLA-specific line at all.

    PJRT_DEVICE=CPU python examples/xla_fsdp.py --nproc 2      # two XLA CPU devices (threads)
    PJRT_DEVICE=TPU python examples/xla_fsdp.py --nproc 1      # one TPU chip
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit

CLASSES = 10


class MNIST(nn.Module):
    """The example's small CNN, scaled to 8x8 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(20 * 2 * 2, 50)
        self.fc2 = nn.Linear(50, CLASSES)

    def forward(self, x):
        """x: (batch, 1, 8, 8) -> log-probabilities (batch, 10)."""
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.bn1(x)
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = self.bn2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n noisy 8x8 images of 10 fixed class prototypes (prototypes shared by every rank and split)."""
    prototypes = torch.rand(CLASSES, 1, 8, 8, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    images = prototypes[labels] + 0.35 * torch.randn(n, 1, 8, 8, generator=g)
    return images, labels


def _mp_fn(index: int, flags: argparse.Namespace) -> dict:
    """One rank: shard, train, test; return this rank's numbers."""
    ctx = shardkit.current_context()
    device = ctx.device
    # The same initial weights on every rank: device threads share torch's RNG, and seeded()
    # keeps each rank's seed-and-build from interleaving with another's.
    with shardkit.seeded(flags.seed):
        model = MNIST()
    model = shardkit.shard(model)  # was: XlaFullyShardedDataParallel(MNIST().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=flags.lr, momentum=flags.momentum)
    loss_fn = nn.NLLLoss()
    train_x, train_y = synthetic_digits(flags.train_size, seed=100 + ctx.rank)  # this rank's shard
    test_x, test_y = synthetic_digits(flags.test_size, seed=100_000 + ctx.rank)

    def train_loop_fn(epoch: int) -> float:
        model.train()
        total = 0.0
        for step, start in enumerate(range(0, len(train_x), flags.batch_size)):
            data = train_x[start:start + flags.batch_size].to(device)
            target = train_y[start:start + flags.batch_size].to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            optimizer.step()  # not xm.optimizer_step: gradients are already reduce-scattered
            total += loss.item()
            if step % flags.log_steps == 0 and ctx.rank == 0:
                print(f"[xla:{ctx.rank}] epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        return total / (step + 1)

    def test_loop_fn() -> float:
        model.eval()
        counts = torch.zeros(2, device=device)  # correct, seen
        with torch.no_grad():
            for start in range(0, len(test_x), flags.batch_size):
                data = test_x[start:start + flags.batch_size].to(device)
                target = test_y[start:start + flags.batch_size].to(device)
                pred = model(data).argmax(dim=1)
                counts += torch.stack([pred.eq(target).sum().float(),
                                       torch.tensor(float(len(target)), device=device)])
        ctx.backend.all_reduce(counts, ctx.world, op="sum").wait()  # was: xm.mesh_reduce
        correct, seen = counts.cpu().tolist()
        return 100.0 * correct / seen

    started = time.perf_counter()
    losses, accuracy = [], 0.0
    for epoch in range(1, flags.num_epochs + 1):
        losses.append(train_loop_fn(epoch))
        accuracy = test_loop_fn()
        if ctx.rank == 0:
            print(f"[xla:{ctx.rank}] epoch {epoch}: mean train loss {losses[-1]:.4f}, "
                  f"test accuracy {accuracy:.2f}% ({time.perf_counter() - started:.1f}s)", flush=True)
    sharded = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "accuracy": accuracy, "local_sharded_params": sharded}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (small defaults so the example runs in well under a minute)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="XLA devices (ranks)")
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=512, help="training samples per rank")
    parser.add_argument("--test-size", type=int, default=256, help="test samples per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--log-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Run the example on --nproc XLA devices and return every rank's result."""
    flags = parse_args(argv)
    return shardkit.spawn(_mp_fn, flags.nproc, flags, backend="xla")


if __name__ == "__main__":
    results = main()
    print(f"final test accuracy {results[0]['accuracy']:.2f}%", flush=True)
