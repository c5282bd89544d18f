"""The benchmark runner end to end (real swarm processes): a quick run writes the report (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.swarm
def test_quick_run_writes_the_report(tmp_path):
    """B2 and B4 at tiny sizes through the real runner (B1/B3 need minutes; their tables are checked above)."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "b2,b4", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [row["variant"] for row in results["b2"]["rows"]][0] == "plain torch"
    assert all(row["local_steps"] > 0 for row in results["b2"]["rows"])
    assert {row["mode"] for row in results["b4"]["rows"]} >= {"plain torch", "none", "reuse"}
    text = (out / "results.md").read_text()
    assert "## B2" in text and "## B4" in text and "torch" in text


@pytest.mark.swarm
def test_quick_b1_and_b5_write_their_tables(tmp_path):
    """B1 (two swarms side by side) and B5 (boundary idle time, default and overlap) at tiny sizes through the real
    runner: every row is measured from the peers' records and hivemind's status lines (no timing asserted)."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "b1,b5", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    b1 = results["b1"]
    assert b1["rounds"] >= 1 and len(b1["round_ratios"]) == b1["rounds"]
    assert b1["hivemind_cpu_ms_per_sample"] > 0 and b1["collabopt_cpu_ms_per_sample"] > 0
    rows = {row["variant"]: row for row in results["b5"]["rows"]}
    assert set(rows) == {"default", "overlap"}
    for row in rows.values():
        assert "error" not in row and row["epochs"] >= 1 and 0 <= row["idle_share"] < 1
        assert row["lead_s"] == row["lead_s"]  # the status lines were captured: a pre-scheduled gradient round
    assert rows["default"]["boundary_s"] > 0  # foreground averaging inside the boundary step
    text = (out / "results.md").read_text()
    assert "## B1" in text and "## B5" in text and "CPU ms / sample" in text
