"""`shardkit demo`: its data, models and memory formula, and one short real 2-rank training run."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from shardkit.demo import cli
from shardkit.demo.data import load_digits_28, rank_indices, rank_slice
from shardkit.demo.memory import MB, measured_state_bytes, unsharded_state_bytes
from shardkit.demo.models import DeepNet, ShallowNet, count_params

CHANCE_ACCURACY = 0.1  # ten balanced classes


def test_digits_are_28x28_normalised_and_split_the_same_way_every_time():
    train, test = load_digits_28()
    again, _ = load_digits_28()
    assert train.images.shape == (1438, 1, 28, 28) and len(test) == 359
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    assert abs(train.images.mean().item()) < 1e-4 and abs(train.images.std().item() - 1) < 1e-4
    # Stratified: every class is in the test set in about its 20% share.
    assert test.labels.bincount().min().item() >= 30


def test_rank_indices_cover_every_sample_with_equal_steps_per_rank():
    for world in (1, 2, 3, 4):
        parts = [rank_indices(1438, r, world, epoch=2, seed=7) for r in range(world)]
        assert len({p.numel() for p in parts}) == 1
        assert set(torch.cat(parts).tolist()) == set(range(1438))
        slices = [rank_slice(359, r, world) for r in range(world)]
        assert sum(s.stop - s.start for s in slices) == 359


def test_models_have_the_tutorial_parameter_counts():
    assert count_params(ShallowNet()) == 32 * 9 + 32 + 64 * 32 * 9 + 64 + 9216 * 128 + 128 + 1290
    with torch.device("meta"):
        deep = DeepNet()
    sizes = [(9216, 9000), (9000, 1000), (1000, 1000), (1000, 1000), (1000, 128), (128, 10)]
    assert count_params(deep) == 320 + 18496 + sum(i * o + o for i, o in sizes) == 94_104_234
    assert ShallowNet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_state_bytes_of_an_unsharded_adam_step_match_the_formula():
    model = ShallowNet()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    opt.step()
    measured = measured_state_bytes(opt)
    assert measured["total"] == unsharded_state_bytes(count_params(model), "adamw")
    assert measured["params"] == measured["grads"] == measured["optimizer"] // 2


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shardkit")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["demo", *argv])


def test_flags_reach_the_config():
    cfg = cli.config_from_args(_parse(["--strategy", "shard_grad_op", "--model", "deep",
                                       "--mixed-precision", "bf16", "--nproc", "3", "--lr", "0.5",
                                       "--epochs", "4", "--batch-size", "16", "--seed", "9"]))
    assert (cfg.strategy, cfg.model, cfg.mixed_precision, cfg.nproc, cfg.lr, cfg.epochs,
            cfg.batch_size, cfg.seed) == ("SHARD_GRAD_OP", "deep", "bf16", 3, 0.5, 4, 16, 9)
    with pytest.raises(SystemExit):
        _parse(["--model", "resnet"])


@pytest.mark.slow
@pytest.mark.long
def test_two_rank_full_shard_demo_learns_and_prints_consistent_memory(capfd):
    from shardkit.cli.main import main

    assert main(["demo", "--nproc", "2", "--epochs", "2", "--model", "shallow", "--no-progress",
                 "--threads-per-rank", "1", "--limit-train", "800"]) == 0
    captured = capfd.readouterr()
    out = captured.out
    assert "[shardkit INFO" not in captured.err  # logging is opt-in (-v, SHARDKIT_LOG)

    epochs = re.findall(r"epoch (\d)/2  train loss ([\d.]+)  test accuracy ([\d.]+)%", out)
    assert [e[0] for e in epochs] == ["1", "2"], out
    losses = [float(e[1]) for e in epochs]
    assert losses[1] < losses[0] < 2.30  # below ln(10), the loss of a uniform guess
    final = float(re.search(r"final test accuracy ([\d.]+)%", out).group(1))
    assert final == float(epochs[-1][2]) >= 75.0 > 5 * 100 * CHANCE_ACCURACY

    params = count_params(ShallowNet())
    formula = unsharded_state_bytes(params, "adadelta")
    assert formula == 16 * params
    rows = re.findall(r"^\s*(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["0", "1"], out
    # Each rank holds half of params, grads and both Adadelta states, plus shard padding of at
    # most one element per parameter tensor in each of those four; figures print rounded to 0.1.
    padding = 4 * 4 * len(list(ShallowNet().parameters()))
    for _, state, unsharded, peak, before in rows:
        state, unsharded, peak, before = (float(v) * MB for v in (state, unsharded, peak, before))
        assert abs(unsharded - formula) <= 0.05 * MB
        assert formula / 2 - 0.05 * MB <= state <= formula / 2 + padding + 0.05 * MB
        assert peak >= before > state
    # What a rank sent per step: FULL_SHARD gathers every unit twice (forward, backward) and
    # reduce-scatters the gradients once: (N-1)/N of the fp32 parameters each time, N = 2.
    sent = re.search(r"all-gather ([\d.]+), reduce-scatter ([\d.]+), all-reduce ([\d.]+)", out)
    half = 4 * params / 2 / MB
    assert [float(v) for v in sent.groups()] == pytest.approx([2 * half, half, 0.0], abs=0.006)
    assert "FULL_SHARD: parameters, gradients and optimizer state sharded" in out


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, group", [
    ("SHARD_GRAD_OP", 2, None), ("NO_SHARD", 2, None),
    pytest.param("HYBRID_SHARD", 4, 2, marks=pytest.mark.long)])  # 4 ranks: 10 s
def test_the_strategies_differ_in_what_a_rank_holds_and_sends(strategy, nproc, group):
    from shardkit.demo.config import DemoConfig
    from shardkit.demo.train import run_demo

    cfg = DemoConfig(strategy=strategy, nproc=nproc, hybrid_group_size=group, epochs=1,
                     limit_train=64, progress=False, threads_per_rank=1)
    results = run_demo(cfg)
    fp32_params = 4 * count_params(ShallowNet())  # every ShallowNet row count is even: no padding
    shard = {"SHARD_GRAD_OP": 2, "NO_SHARD": 1, "HYBRID_SHARD": 2}[strategy]
    replicas = nproc // shard
    ring = (shard - 1) / shard * fp32_params  # one all-gather or reduce-scatter in the group
    expected = {"SHARD_GRAD_OP": (ring, ring, 0.0),  # gathered once: kept for backward
                "NO_SHARD": (0.0, 0.0, 2 * (replicas - 1) / replicas * fp32_params),
                "HYBRID_SHARD": (2 * ring, ring,
                                 2 * (replicas - 1) / replicas * fp32_params / shard)}[strategy]
    for r in results:
        sent = r["sent_per_step"]
        assert (sent["all_gather"], sent["reduce_scatter"], sent["all_reduce"]) == \
            pytest.approx(expected, abs=1.0)
        assert r["groups"] == {"shard": shard, "replicas": replicas}
        assert r["memory"]["state_bytes"] == pytest.approx(16 * count_params(ShallowNet()) / shard,
                                                           abs=1)


def test_hybrid_group_size_is_checked_before_any_rank_starts():
    with pytest.raises(Exception, match="applies to --strategy HYBRID_SHARD only"):
        cli.config_from_args(_parse(["--hybrid-group-size", "2"]))
    with pytest.raises(Exception, match=r"does not divide --nproc 4; HINT: use one of \[1, 2, 4\]"):
        cli.config_from_args(_parse(["--strategy", "hybrid_shard", "--nproc", "4",
                                     "--hybrid-group-size", "3"]))
    cfg = cli.config_from_args(_parse(["--strategy", "hybrid_shard", "--nproc", "4",
                                       "--hybrid-group-size", "2"]))
    assert (cfg.strategy, cfg.hybrid_group_size) == ("HYBRID_SHARD", 2)


def test_python_m_shardkit_demo_is_registered():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "shardkit", "demo", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--mixed-precision" in proc.stdout and "--strategy" in proc.stdout
