"""torch.compile the way users call it on sharded units (issue 17): block.compile() after shard()."""

from __future__ import annotations

import pytest

import shardkit

pytest.importorskip("transformers")

from _compile_workers import CONFIGS, compiled_blocks

BLOCKS = 3  # the workers' GPT-2 has three blocks


def _check(results: dict, names: list[str]) -> None:
    assert results["fsdp2:FULL_SHARD"]["breaks"] == 0  # torch's own, same model, block.compile()
    assert results["fsdp2:FULL_SHARD"]["graphs"][-1] == BLOCKS
    for name in names:
        run = results[f"shardkit:{name}"]
        fsdp2 = results["fsdp2:" + ("torch.compile(block)" if name == "torch.compile(block)"
                                    else "FULL_SHARD")]
        # Same numbers as eager (aot_eager runs the same kernels); bf16 within its precision.
        assert run["compiled"] == pytest.approx(run["eager"], rel=1e-3 if name == "bf16" else 1e-6), name
        # torch.compile(block) runs the block's hooks outside the graph and would trace any
        # Python frame of ours around the disabled engine hooks (a counted break at each edge,
        # two per block, when they were lambdas): as many breaks as FSDP2, which is none.
        assert run["breaks"] <= fsdp2["breaks"], (name, run["breaks"])
        assert run["graphs"][-1] <= fsdp2["graphs"][-1], (name, run["graphs"])
        assert run["graphs"][1] == run["graphs"][-1], (name, run["graphs"])  # no recompiles after step 2


@pytest.mark.long  # 12 s on 2 cores
def test_block_compile_after_shard_has_no_breaks_and_no_recompiles():
    # One rank here; every configuration at 1 and 2 ranks in the long lane below.
    names = ["FULL_SHARD"]
    for results in shardkit.spawn(compiled_blocks, 1, 1, names, True, backend="cpu"):
        _check(results, names)


@pytest.mark.slow
# 55 and 85 s; CI's long lane compiles blocks under every strategy in
# test_sharding_compile_checkpoint.py and after shard() in the test above.
@pytest.mark.extended
@pytest.mark.parametrize("world", [1, 2])
def test_block_compile_every_configuration(world):
    names = [n for n in CONFIGS if not (world == 1 and n == "reshard_to_2")]
    for results in shardkit.spawn(compiled_blocks, world, world, names, True, threads_per_rank=1,
                                  backend="cpu"):
        _check(results, names)


@pytest.mark.slow
@pytest.mark.extended  # about 60 s; CI's long lane compiles the whole sharded model in test_compile_fullgraph.py
def test_whole_model_compile_runs_ten_steps_like_fsdp2():
    # torch.compile(model) on the sharded model: same losses as FSDP2 and as eager, no
    # recompilation after the second step, no more graph breaks or graphs than FSDP2. dynamo
    # traces shardkit's hooks into the graph (sharding/step/traced.py), so its breaks are only
    # transformers' own (a logging call in the loss: 3 on torch 2.13, 2 graphs) where FSDP2
    # breaks at every block too (5 breaks, 5 graphs).
    from _compile_workers import compiled_model

    for result in shardkit.spawn(compiled_model, 2, 2, threads_per_rank=1, backend="cpu"):
        ours, torchs = result["shardkit"], result["fsdp2"]
        assert ours["compiled"] == pytest.approx(torchs["compiled"], rel=1e-6)
        assert ours["compiled"][:5] == pytest.approx(result["eager"], rel=1e-6)
        assert ours["graphs"][1] == ours["graphs"][-1]
        assert ours["breaks"] <= torchs["breaks"], (ours, torchs)
        assert ours["graphs"][-1] <= torchs["graphs"][-1], (ours, torchs)
        print(f"graphs: shardkit {ours['graphs'][-1]}, FSDP2 {torchs['graphs'][-1]}; graph breaks: "
              f"shardkit {ours['breaks']}, FSDP2 {torchs['breaks']}")


@pytest.mark.extended  # about 30 s
def test_whole_model_compile_shares_the_on_disk_cache_at_uneven_rows(tmp_path):
    """Ranks holding different row counts, and a second run reading the first's compiled graphs
    from inductor's on-disk cache, as every run on one machine does: each rank must get a graph
    made for its own rows (a graph made for 4 rows failed on the rank holding 3)."""
    from _compile_workers import compiled_uneven_rows

    runs = [shardkit.spawn(compiled_uneven_rows, 2, 2, str(tmp_path), threads_per_rank=1,
                           backend="cpu") for _ in range(2)]
    for run in runs:
        assert all(max(r["diffs"]) <= 1e-6 for r in run), run
    assert all(r["cache_hits"] > 0 for r in runs[1]), runs[1]  # the second run read the cache
