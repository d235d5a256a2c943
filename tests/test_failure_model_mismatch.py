"""Ranks that disagree about the model are refused at shard(), with the differences and ranks."""

from __future__ import annotations

import shardkit

from _failure_workers import disagreeing_models


def test_disagreeing_ranks_are_refused_with_the_first_differences():
    results = shardkit.spawn(disagreeing_models, 3, 3, threads_per_rank=1, timeout=30)
    for out in results:
        assert out["then_ok"]
        for case, text in out.items():
            if case == "then_ok":
                continue
            assert text is not None, case
            assert "ranks disagree about the model" in text, text
            assert "ranks [0, 1] have one model, ranks [2] another" in text, text
            assert "HINT:" in text
        assert results[0] == out  # every rank raises the same message
    out = results[0]
    assert "rank 0: param conv.weight" not in out["shape"]  # conv does not depend on dim
    assert ("rank 0: param blocks.0.qkv.weight: unit 'blocks.0', shape (42, 14), torch.float32, requires_grad=True"
            "\n  rank 2: param blocks.0.qkv.weight: unit 'blocks.0', shape (45, 15), torch.float32, requires_grad=True"
            ) in out["shape"]
    assert ("rank 0: param blocks.0.ln1.weight: unit 'blocks.0', shape (14,), torch.float32, requires_grad=True"
            "\n  rank 2: param blocks.0.ln1.weight: unit 'blocks.0', shape (14,), torch.float64, requires_grad=True"
            ) in out["dtype"]
    assert "rank 0: no param blocks.2.ln1.weight\n  rank 2: param blocks.2.ln1.weight: unit 'blocks.2'" in out["name"]
    assert "rank 0: param blocks.0.ln1.weight: unit 'blocks.0'" in out["wrap_plan"]
    assert "rank 2: param blocks.0.ln1.weight: unit '<root>'" in out["wrap_plan"]
    assert ("requires_grad=True\n  rank 2: param blocks.0.ln1.weight: unit 'blocks.0', shape "
            "(14,), torch.float32, requires_grad=False") in out["frozen"]
