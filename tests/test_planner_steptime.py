"""The step-time model: ring formulas, the schedule, the per-unit compute measurement, the CLI."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import shardkit
from shardkit.cli.main import main
from shardkit.planner.compute_times import measure_unit_times
from shardkit.planner.steptime import LINKS, Link, Topology, UnitTimes, collective_seconds, step_time
from shardkit.sharding.setup.plan import plan_units
from shardkit.sharding.step.traffic import CommStats
from shardkit.wrap import as_policy


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def _hidden(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.out_features == 64


def _plan(world=2, **options):
    with torch.device("meta"):
        model = Net()
    return shardkit.plan(model, world, auto_wrap_policy=_hidden, **options)


def test_ring_formulas():
    link = Link("t", 10e-6, 1e9, reduce_scatter_factor=2.0)
    assert collective_seconds("forward_gather", 10**6, 4, link) == pytest.approx(3 * (10e-6 + 1e-3))
    assert collective_seconds("reduce_scatter", 10**6, 4, link) == pytest.approx(6 * (10e-6 + 1e-3))
    assert collective_seconds("all_reduce", 4 * 10**6, 4, link) == pytest.approx(6 * (10e-6 + 1e-3))
    assert collective_seconds("all_reduce", 10**6, 1, link) == 0.0
    topology = Topology(LINKS["nvlink"], LINKS["ib"], 8)
    assert topology.link(8) is LINKS["nvlink"] and topology.link(16) is LINKS["ib"]
    with pytest.raises(shardkit.ShardkitError, match="unknown collective"):
        collective_seconds("broadcast", 1, 2, link)


@pytest.mark.parametrize("strategy, world, group", [("FULL_SHARD", 4, None), ("SHARD_GRAD_OP", 2, None),
                                                   ("HYBRID_SHARD", 4, 2), ("NO_SHARD", 3, None)])
def test_unit_collectives_add_up_to_the_plans_bytes_and_calls(strategy, world, group):
    plan = _plan(world, strategy=strategy, hybrid_group_size=group)
    stats = CommStats()
    for unit in plan.units:
        for kind, nbytes, size in unit.collectives:
            getattr(stats, "all_gather" if kind.endswith("gather") else kind)(nbytes, size)
    snap = stats.snapshot()
    assert {k: snap[k] for k in ("all_gather", "reduce_scatter", "all_reduce", "total")} == {
        k: plan.comm[k] for k in ("all_gather", "reduce_scatter", "all_reduce", "total")}
    assert snap["calls"] == plan.comm["calls"]


def test_schedule_by_hand():
    # Every collective 1 s (latency only, 2 ranks); forward 1 s and backward 2 s per unit.
    plan = _plan(2)
    # gather, re-gather, reduce; the root keeps its parameters for backward: no re-gather
    assert [len(u.collectives) for u in plan.units] == [3, 3, 2]
    topology = Topology(Link("t", 1.0, 1e30), Link("t", 1.0, 1e30), 8)
    times = UnitTimes((1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    free = step_time(plan, times, topology)
    # Link: root [0,1], a [1,2], b [2,3] (prefetched), b again [3,4], a [4,5];
    # compute: a [2,3], b [3,4], root [4,5]; backward root [5,7], b [7,9], a [9,11];
    # reductions b [9,10], a [11,12], root [12,13].
    assert (free.compute_s, free.communication_s, free.serial_s, free.overlapped_s) == (9, 8, 17, 13)
    # Host-bound (CPU): a hook's collectives wait for the host, who waits for compute.
    assert step_time(plan, times, topology, host_bound=True).overlapped_s == 14
    assert free.exposed_communication_s == 4


def test_split_shares_compute_by_parameters_and_scale_grows_the_latency_term():
    plan = _plan(2)
    times = UnitTimes.split(plan, 3.0, 6.0, 1.0)
    assert sum(times.forward_s) == pytest.approx(3.0) and sum(times.backward_s) == pytest.approx(6.0)
    assert times.forward_s[0] == pytest.approx(3.0 * 4160 / 8840)
    small, large = (step_time(_plan(n), UnitTimes.split(_plan(n), 0.1, 0.2, 0.0),
                              Topology(LINKS["nvlink"], LINKS["ib"], 8)) for n in (8, 64))
    assert large.communication_s > small.communication_s  # 63 ring steps over IB, not 7 on NVLink
    assert small.overlapped_s <= small.serial_s and large.overlapped_s <= large.serial_s


class Sleepy(nn.Module):
    """A layer whose forward takes at least `seconds` (a stand-in for heavy compute)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.proj, self.seconds = nn.Linear(8, 8), seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.proj(x)


def test_measured_unit_times_are_each_units_own():
    model = nn.Sequential(Sleepy(0.05), Sleepy(0.0), nn.Linear(8, 1))
    units = [u.module for u in plan_units(model, as_policy(lambda m: isinstance(m, Sleepy)))]
    x = torch.randn(4, 8)
    times = measure_unit_times(units, lambda: model(x).sum(), repeats=2)
    assert len(times.forward_s) == 3 and min(times.forward_s + times.backward_s) >= 0
    assert times.forward_s[0] >= 0.05 > times.forward_s[1]  # the sleeper's own, not its neighbour's
    assert times.forward_s[2] < 0.05  # the root's share excludes the units inside it


def test_cli_step_time_table_and_errors(capsys):
    args = ["plan", "--hf-config", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set",
            "n_head=4", "--world-size", "8"]
    assert main(args + ["--step-time", "100", "--scale", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "between: ib 45.0 GB/s 10 us" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith(("8 ", "16 "))]
    assert [row[0] for row in lines] == ["8", "16"] and lines[0][1] == "0.300"
    assert main(args + ["--step-time", "100", "--scale", "16", "--link-gbps", "1",
                        "--link-latency-us", "50"]) == 0
    assert "between: given 1.0 GB/s 50 us" in capsys.readouterr().out
    assert main(args[:-1] + ["12", "--step-time", "100"]) == 0  # default scale: 8, 12, 64, 512, 1024
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()
            if line.strip()[:1].isdigit()] == ["8", "12", "64", "512", "1024"]
    assert main(args + ["--step-time", "fast"]) == 1
    assert "--step-time takes FWD_MS" in capsys.readouterr().err
    assert main(args + ["--step-time", "100", "--device-memory", "80GiB"]) == 1
    assert "in a separate command" in capsys.readouterr().err
