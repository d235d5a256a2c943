"""The root unit keeps its gathered parameters from forward to backward under FULL_SHARD by
default (FSDP2's root), frees them after a no_grad forward, and a value the user gives wins."""

from __future__ import annotations

import pytest

import shardkit


def _run(root_value: object, world: int = 2) -> list[dict]:
    from tests._root_reshard_workers import root_after_forward

    return shardkit.spawn(root_after_forward, world, root_value, backend="cpu", threads_per_rank=1)


@pytest.mark.parametrize("world", [2, 3])
def test_the_root_is_gathered_once_per_step_and_trains_like_one_process(world):
    kept, freed = _run("default", world), _run(True, world)
    for rank in range(world):
        assert kept[rank]["after_train_forward"] == ["kept"] * 3, kept[rank]
        assert kept[rank]["after_eval_forward"] == ["sharded"] * 3  # no backward follows
        assert freed[rank]["after_train_forward"] == ["sharded"] * 3
        # One all-gather of the root fewer per step, nothing else changes.
        saved = [f - k for f, k in zip(freed[rank]["sent"], kept[rank]["sent"])]
        assert saved == [kept[rank]["root_gather_bytes"]] * 3 and saved[0] > 0, saved
        assert kept[rank]["losses"] == pytest.approx(kept[rank]["ref"], rel=1e-5)
        assert kept[rank]["losses"] == pytest.approx(freed[rank]["losses"], rel=1e-6)


def test_a_root_value_the_user_gives_wins():
    for run in _run(False):
        assert run["after_train_forward"] == ["kept"] * 3
        assert run["after_eval_forward"] == ["kept"] * 3  # kept by request, not by default


def test_the_planner_counts_the_root_once():
    from tests._root_reshard_workers import Block, build

    model = build()
    policy = shardkit.wrap.transformer_layers({Block})
    default = shardkit.plan(model, world_size=2, auto_wrap_policy=policy)
    freed = shardkit.plan(model, world_size=2, auto_wrap_policy=policy,
                          reshard_after_forward={"<root>": True})
    assert default.comm["calls"]["all_gather"] == freed.comm["calls"]["all_gather"] - 1
    root_params = sum(p.numel() for m in (model[0], model[3]) for p in m.parameters())
    assert freed.comm["all_gather"] - default.comm["all_gather"] == root_params * 4 // 2
