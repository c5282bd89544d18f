"""Benchmark B7 (``python -m benchmarks.scale``) in its smoke version: swarms of 2 and 4 peers, then late joiners; the
report has every figure for both sizes (no timing asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import ROOT

from benchmarks.dht_traffic import CATEGORIES
from benchmarks.scale_report import CPU_KINDS, FIGURES, NOTES, value

pytestmark = pytest.mark.swarm


def test_smoke_run_reports_every_figure_for_2_and_4_peers(tmp_path, monkeypatch):
    """Each size's row holds the DHT bytes (by key), the CPU seconds by process, the boundary time, the group sizes
    and the joiners' download times, all measured (finite); the fits and the tables are in scale.md."""
    out = tmp_path / "results"
    monkeypatch.setenv("COLLABOPT_BENCHMARK_FORK", "1")  # its processes forked from a launcher
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--smoke", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "scale.json").read_text())
    rows = {row["peers"]: row for row in results["rows"]}
    assert sorted(rows) == [2, 4]
    for n, row in rows.items():
        assert "error" not in row and "peer_errors" not in row, row
        for key, label in FIGURES:
            assert math.isfinite(value(row, key)) and value(row, key) >= 0, (n, label, row)
        assert row["dht_sent_per_epoch"] > 0 and row["dht_received_per_epoch"] > 0
        assert row["dht_by_category"]["progress"] > 0 and set(row["dht_by_category"]) == set(CATEGORIES)
        assert set(CPU_KINDS) <= set(row["cpu_per_epoch"]) and row["cpu_per_epoch"]["dht"] > 0
        assert row["group_sizes"] and row["boundaries"] >= 1
        assert row["epoch_fill"] >= 0.9, "the swarm's samples in an epoch are about its target, not less"
        assert row["joiners_synced"] == row["joiners"] >= 1
    text = (out / "scale.md").read_text()
    for part in ("| N | epoch s", "by key", "by process", "Fits `a * N^b`", NOTES):
        assert part in text, part
