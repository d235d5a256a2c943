"""The rules behind multi-node runs, without namespaces: which bytes cross a node (by hand), the
planner's `nodes`, and the cpu backend's choice of gloo interface when the host name is loopback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from torch import nn

import shardkit
from shardkit.errors import ShardkitError
from shardkit.planner.nodes import inter_node_by_rank
from shardkit.sharding.step.traffic import CommStats, successor_off_node
from shardkit_backends.cpu.interface import gloo_interface, interface_with_address

MB = 1 << 20


def test_a_ring_crosses_where_the_next_rank_lives_on_another_node():
    assert [successor_off_node(range(4), i, 2) for i in range(4)] == [False, True, False, True]
    assert [successor_off_node((1, 3), i, 2) for i in range(2)] == [True, True]  # replicas
    assert not any(successor_off_node(range(4), i, 4) for i in range(4))  # one node
    assert not successor_off_node((5,), 0, 2)


def test_inter_node_bytes_by_hand():
    # 8 ranks on 2 nodes. A 1 MiB all-gather shard over the world: ranks 3 and 7 send 7 shards
    # to the other node. A replica all-reduce (shard group 4, 2 replicas) of 1 MiB: every rank's
    # partner is on the other node, 2(2-1)/2 = 1 MiB each.
    calls = [("forward_gather", MB, 8), ("all_reduce", MB, 2)]
    rows = inter_node_by_rank(calls, world=8, shard_group=4, ranks_per_node=4)
    assert [r["all_gather"] for r in rows] == [0, 0, 0, 7 * MB, 0, 0, 0, 7 * MB]
    assert [r["all_reduce"] for r in rows] == [MB] * 8
    assert rows[3]["total"] == 8 * MB and rows[0]["total"] == MB
    # The engine's counter applies the same rule to its own group.
    stats = CommStats(ranks_per_node=4)
    group = type("G", (), {"size": 8, "ranks": tuple(range(8)), "rank": 3})()
    stats.all_gather(MB, 8, stats.crosses_node(group))
    snap = stats.snapshot()
    assert snap["inter_node"]["all_gather"] == 7 * MB and snap["intra_node"] == 0


def test_plan_nodes_defaults_hybrid_to_one_node_and_checks_the_split():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    plan = shardkit.plan(model, world_size=8, strategy="HYBRID_SHARD", nodes=2)
    assert plan.shard_group_size == 4 and plan.replica_group_size == 2
    assert all(r["all_gather"] == r["reduce_scatter"] == 0 for r in plan.comm["inter_node_by_rank"])
    assert "sent to another node per step (2 nodes" in plan.table()
    with pytest.raises(ShardkitError, match="does not split evenly over 3 nodes"):
        shardkit.plan(model, world_size=8, nodes=3)


@pytest.mark.long  # 10 s in the default lane on 2 cores (2026-11-29)
def test_shardkit_plan_cli_takes_nodes():
    done = subprocess.run([sys.executable, "-m", "shardkit.cli.main", "plan", "--hf-config",
                           "gpt2", "--world-size", "8", "--nodes", "2", "--strategy",
                           "HYBRID_SHARD"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "sent to another node per step (2 nodes, ring order; all-to-alls by peer)" in done.stdout


def test_gloo_interface_is_chosen_only_across_nodes_with_a_loopback_host_name():
    environ: dict[str, str] = {}
    # One node: loopback is right, gloo's own choice stands.
    assert gloo_interface(environ, 4, 4, "127.0.0.1", "localhost") is None
    # The user's choice stands.
    assert gloo_interface({"GLOO_SOCKET_IFNAME": "ib0"}, 4, 2, "127.0.0.1", "localhost") is None
    # Across nodes with a loopback host name: the interface that holds the route to the master;
    # toward a loopback master, that is lo (never chosen: peers cannot reach it).
    assert gloo_interface(environ, 4, 2, "127.0.0.1", "localhost") is None
    here = socket.gethostbyname(socket.gethostname())
    if not here.startswith("127."):
        # A host name that resolves to a real address: gloo finds it by itself.
        assert gloo_interface(environ, 4, 2, here, socket.gethostname()) is None


def test_interface_with_address_names_loopback():
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: on no interface here
