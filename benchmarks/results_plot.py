"""The chart of a benchmark run (``results.png``): one panel per benchmark of :mod:`benchmarks.run`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: dict[str, Any], path: Path, goals: dict[str, float]) -> bool:
    """Bar charts of the benchmarks into ``path``, with each one's goal (``goals``: benchmarks.run's GOALS); returns
    False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    (ax1, ax2, ax5), (ax3, ax4, ax6) = axes
    ax6.set_axis_off()

    def bars(ax: Any, labels: list[str], values: list[float], title: str, goal: float | None = None,
             ylabel: str = "") -> None:
        ax.bar(range(len(values)), values, color="#4c72b0")
        ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=9)
        if goal is not None:
            ax.axhline(goal, color="#c44e52", linestyle="--", linewidth=1, label=f"goal {goal}")
            ax.legend(fontsize=8)

    def empty(ax: Any, title: str, text: str) -> None:
        ax.set_title(title, fontsize=10)
        ax.text(0.5, 0.5, text[:80], ha="center", va="center", fontsize=9, wrap=True)
        ax.set_axis_off()

    b1 = results.get("b1")
    if b1 and "ratio" in b1:
        bars(ax1, ["hivemind", "collabopt"], [1.0, b1["ratio"]], "B1 swarm samples/s (relative to hivemind)",
             goals["b1"])
    else:
        empty(ax1, "B1", (b1 or {}).get("error", "not run"))
    b2 = results.get("b2")
    if b2 and "rows" in b2:
        bars(ax2, [r["variant"] for r in b2["rows"]], [r["ratio"] for r in b2["rows"]],
             "B2 local step time / plain torch", goals["b2"])
    else:
        empty(ax2, "B2", (b2 or {}).get("error", "not run"))
    b3 = results.get("b3")
    rows = [r for r in (b3 or {}).get("rows", []) if "error" not in r]
    if rows:
        labels = [f"{r['peers']}p {r['mbit']}M {r['variant']}" + (" (hivemind)" if r.get("impl") == "hivemind" else "")
                  for r in rows]
        x = range(len(rows))
        ax3.bar([i - 0.2 for i in x], [r["utilization"] for r in rows], width=0.4, label="compute utilization")
        ax3.bar([i + 0.2 for i in x], [r["bound_over_allreduce"] for r in rows], width=0.4,
                label="bound / all-reduce time")
        ax3.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=7)
        ax3.axhline(goals["b3_util"], color="#c44e52", linestyle="--", linewidth=1)
        ax3.set_title("B3 WAN (tc tbf links)", fontsize=10)
        ax3.legend(fontsize=8)
    else:
        empty(ax3, "B3", (b3 or {}).get("skipped") or (b3 or {}).get("error", "not run"))
    b4 = results.get("b4")
    if b4 and "rows" in b4:
        bars(ax4, [r["mode"] for r in b4["rows"]], [r["extra_over_params"] for r in b4["rows"]],
             "B4 extra tensor bytes / parameter bytes", ylabel="× parameter bytes")
    else:
        empty(ax4, "B4", (b4 or {}).get("error", "not run"))
    b5 = results.get("b5")
    rows5 = [r for r in (b5 or {}).get("rows", []) if "error" not in r]
    if rows5:
        bars(ax5, [f"{r['peers']}p {r['epoch_factor']:g}x {r['variant']}" for r in rows5],
             [r["idle_share"] for r in rows5], "B5 idle share of wall time at epoch boundaries", goals["b5_idle"])
    else:
        empty(ax5, "B5", (b5 or {}).get("error", "not run"))
    m = results["machine"]
    fig.suptitle(f"collabopt {m['collabopt']} vs hivemind {m['hivemind']} / torch {m['torch']} — {m['date_utc']}, "
                 f"{m['cpus']} CPUs" + (" (quick run)" if results["quick"] else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
