"""The PyTorch FSDP MNIST tutorial, with the FSDP wrap line replaced by `shardkit.shard`.

Same Net, Adadelta, StepLR, train/test functions and arguments; nothing names a vendor, so
`--backend cpu|cuda|xpu|xla` (or none: the best available) picks the device. The data are
scikit-learn's bundled handwritten digits upscaled to MNIST's 28x28 (no download).

    python examples/mnist_fsdp.py --nproc 2 --epochs 3                # spawns 2 local ranks
    shardkit launch --nproc 2 examples/mnist_fsdp.py --epochs 3       # torchrun starts them
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

import shardkit
from shardkit.checkpoint import full_state_dict
from shardkit.demo.data import batches, load_digits_28, rank_indices, rank_slice

from launching import add_launch_args, run  # examples/launching.py


class Net(nn.Module):
    """The tutorial's CNN."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        """Log-probabilities of the ten digits."""
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def all_sum(ctx, t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over every rank (the engine's collectives take only "sum")."""
    ctx.backend.all_reduce(t, ctx.world, op="sum").wait()
    return t


def train(args, model, ctx, train_data, optimizer, epoch):
    """One epoch over this rank's share of the training set (the tutorial's DistributedSampler)."""
    model.train()
    ddp_loss = torch.zeros(2, device=ctx.device)
    order = rank_indices(len(train_data), ctx.rank, ctx.world_size, epoch, args.seed)
    for data, target in batches(train_data, order, args.batch_size):
        data, target = data.to(ctx.device), target.to(ctx.device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction='sum')
        loss.backward()
        optimizer.step()
        ctx.backend.step_boundary()
        ddp_loss[0] += loss.detach()
        ddp_loss[1] += len(data)
    all_sum(ctx, ddp_loss)
    if ctx.rank == 0:
        print('Train Epoch: {} \tLoss: {:.6f}'.format(epoch, ddp_loss[0] / ddp_loss[1]), flush=True)


def test(model, ctx, test_data, batch_size):
    """Loss and accuracy over the whole test set, each rank scoring its own slice."""
    model.eval()
    ddp_loss = torch.zeros(3, device=ctx.device)
    mine = torch.arange(len(test_data))[rank_slice(len(test_data), ctx.rank, ctx.world_size)]
    with torch.no_grad():
        for data, target in batches(test_data, mine, batch_size):
            data, target = data.to(ctx.device), target.to(ctx.device)
            output = model(data)
            ddp_loss[0] += F.nll_loss(output, target, reduction='sum')  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            ddp_loss[1] += pred.eq(target.view_as(pred)).sum()
            ddp_loss[2] += len(data)
    all_sum(ctx, ddp_loss)
    if ctx.rank == 0:
        test_loss = ddp_loss[0] / ddp_loss[2]
        print('Test set: Average loss: {:.4f}, Accuracy: {}/{} ({:.2f}%)\n'.format(
            test_loss, int(ddp_loss[1]), int(ddp_loss[2]),
            100. * ddp_loss[1] / ddp_loss[2]), flush=True)


def fsdp_main(rank, args):
    """One rank: shard the model, train and test every epoch, optionally save the full weights."""
    ctx = shardkit.current_context()
    train_data, test_data = load_digits_28(limit_train=args.limit_train)
    with shardkit.seeded(args.seed):  # the same initial weights on every rank
        model = Net()
    # The tutorial's `model = FSDP(model, auto_wrap_policy=my_auto_wrap_policy)`:
    model = shardkit.shard(model, auto_wrap_policy=shardkit.wrap.size_based(min_num_params=100))
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        train(args, model, ctx, train_data, optimizer, epoch)
        test(model, ctx, test_data, args.test_batch_size)
        scheduler.step()
    ctx.backend.synchronize(ctx.device)
    if ctx.rank == 0:
        print(f"{ctx.backend.name} elapsed time: {time.perf_counter() - start:.2f}sec")
        print(f"{model}")
    if args.save_model:
        states = full_state_dict(model)  # collective: every rank gathers, rank 0 keeps
        if ctx.rank == 0:
            torch.save(states, args.save_model)
    ctx.barrier()


def parse_args(argv=None):
    """The tutorial's arguments, plus --backend, --nproc and --limit-train."""
    parser = argparse.ArgumentParser(description='shardkit FSDP MNIST Example')
    parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                        help='input batch size for training (default: 64)')
    parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                        help='input batch size for testing (default: 1000)')
    parser.add_argument('--epochs', type=int, default=10, metavar='N',
                        help='number of epochs to train (default: 10)')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR',
                        help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M',
                        help='Learning rate step gamma (default: 0.7)')
    parser.add_argument('--seed', type=int, default=1, metavar='S',
                        help='random seed (default: 1)')
    parser.add_argument('--save-model', default=None, metavar='PATH',
                        help='rank 0 saves the full (unsharded) weights here')
    parser.add_argument('--limit-train', type=int, default=None, metavar='N',
                        help='train on the first N training images only (quick runs)')
    add_launch_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    """Run as one rank under a launcher (shardkit launch, mpirun, SLURM), or spawn --nproc ranks."""
    run(fsdp_main, parse_args(argv))


if __name__ == '__main__':
    main()
