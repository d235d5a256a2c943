"""Draw bench_step.py's results: seconds per step and peak memory per rank, each mode against FSDP2.

    python benchmarks/bench_step.py --plot step.png ...          (draws after the run)
    python benchmarks/plot_step.py results.json step.png         (from bench_step.py --json)
"""

from __future__ import annotations

import json
import sys

BASELINE = "fsdp2"


def ratios(rows: list[dict], memory: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per mode: s/step and peak memory per rank, each divided by FSDP2's (None where unmeasured)."""
    time = {r["mode"]: r["sec_per_step"] for r in rows}
    peak = {}
    for m in memory:
        value = m.get("peak_device_mb") or max(m.get("peak_rss_mb") or [0]) or None
        peak[m["mode"]] = value
    out: dict[str, dict[str, float | None]] = {}
    for mode in time:
        t_base, m_base = time.get(BASELINE), peak.get(BASELINE)
        out[mode] = {"time": time[mode] / t_base if t_base else None,
                     "memory": peak[mode] / m_base if peak.get(mode) and m_base else None}
    return out


def plot(result: dict, path: str) -> dict[str, dict[str, float | None]]:
    """Write a two-panel bar chart (time, memory; FSDP2 = 1) to `path`; return the plotted ratios."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    values = ratios(result["rows"], result.get("memory", []))
    modes = list(values)
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.1 * len(modes), 4), sharey=False)
    for ax, key, label in ((axes[0], "time", "s/step"), (axes[1], "memory", "peak memory / rank")):
        heights = [values[m][key] or 0.0 for m in modes]
        bars = ax.bar(modes, heights, color=["tab:blue" if m.startswith("shardkit") else "tab:gray"
                                             for m in modes])
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.bar_label(bars, labels=[f"{h:.2f}" if h else "n/a" for h in heights], fontsize=8)
        ax.set_title(f"{label}, FSDP2 = 1", fontsize=9)
        ax.set_ylabel("ratio (lower is better)", fontsize=8)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(result.get("title", ""), fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return values


def main(argv: list[str] | None = None) -> int:
    """Plot a bench_step.py --json file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(args[0]) as f:
        plot(json.load(f), args[1])
    print(f"wrote {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
