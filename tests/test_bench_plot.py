"""benchmarks/bench_step.py --plot: the chart shows the ratios the table prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from plot_step import main as plot_main  # noqa: E402
from plot_step import plot, ratios  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RESULT = {"title": "test", "rows": [{"mode": "shardkit-full", "sec_per_step": 0.3},
                                    {"mode": "fsdp2", "sec_per_step": 0.4},
                                    {"mode": "ddp", "sec_per_step": 0.2}],
          "memory": [{"mode": "shardkit-full", "peak_rss_mb": [300.0, 320.0]},
                     {"mode": "fsdp2", "peak_rss_mb": [400.0, 390.0]}]}


def test_ratios_are_against_fsdp2_and_missing_figures_stay_missing():
    found = ratios(RESULT["rows"], RESULT["memory"])
    assert {mode: {k: v if v is None else round(v, 9) for k, v in r.items()}
            for mode, r in found.items()} == {"shardkit-full": {"time": 0.75, "memory": 0.8},
                                              "fsdp2": {"time": 1.0, "memory": 1.0},
                                              "ddp": {"time": 0.5, "memory": None}}
    no_baseline = ratios(RESULT["rows"][:1], [])
    assert no_baseline == {"shardkit-full": {"time": None, "memory": None}}


def test_plot_writes_a_png_from_a_json_file(tmp_path):
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(RESULT))
    assert plot_main([str(saved), str(tmp_path / "chart.png")]) == 0
    assert (tmp_path / "chart.png").read_bytes()[:8] == PNG_SIGNATURE
    assert plot_main([str(saved)]) == 2  # usage


@pytest.mark.slow
@pytest.mark.extended  # about 25 s
def test_bench_step_plot_flag_draws_what_it_measured(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--model",
                          "mlp", "--steps", "2", "--warmup", "1", "--chunk", "1", "--batch", "8",
                          "--modes", "shardkit-full,fsdp2", "--nproc", "2", "--isolated-steps",
                          "1", "--json", str(tmp_path / "r.json"), "--plot",
                          str(tmp_path / "r.png")], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_SIGNATURE
    result = json.loads((tmp_path / "r.json").read_text())
    table_ratio = float(out.stdout.split("| shardkit-full |")[1].split("|")[1])  # vs FSDP2
    drawn = plot(result, str(tmp_path / "again.png"))
    assert drawn["shardkit-full"]["time"] == pytest.approx(table_ratio, abs=0.0005)
    assert drawn["shardkit-full"]["memory"] is not None
