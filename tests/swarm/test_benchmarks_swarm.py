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
