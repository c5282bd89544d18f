"""The CPU smoke version of ``python3 scripts/dev.py gpu-check`` (benchmarks/gpu_check.py), so that the script a lent
GPU machine runs cannot rot between the times one is at hand: AMP swarms of 2 peer processes in every adapter (each
peer injects one overflow), the local-step timing loop and the memory measurement on a tiny model. The smoke runs its
three parts at once (benchmarks/gpu_check.py: on a GPU one after the other)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SWARM_ROUNDING, child_env

pytestmark = pytest.mark.swarm

CASES = ["plain fp16", "plain bf16", "lightning 16-mixed", "diloco fp16", "accelerate fp16"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    committed = ROOT / "benchmarks" / "results" / "gpu.md"
    before = committed.read_bytes() if committed.exists() else None
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--out", str(out)],
                          env=child_env(COLLABOPT_BENCHMARK_FORK="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=280)  # its processes forked from a launcher
    assert "CPU SMOKE VERSION" in proc.stdout
    assert (committed.read_bytes() if committed.exists() else None) == before, "the smoke overwrote the GPU results"
    assert (out / "gpu.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    result["returncode"], result["log"] = proc.returncode, proc.stdout[-4000:] + proc.stderr[-2000:]
    result["md"] = (out / "gpu.md").read_text()
    return result


def test_it_says_it_is_the_smoke_version(smoke):
    assert smoke["smoke"] is True
    assert "CPU SMOKE VERSION" in smoke["md"]


@pytest.mark.parametrize("case", CASES)
def test_amp_swarm_peers_end_in_sync_loss_falls_and_the_overflow_is_skipped_on_every_peer(smoke, case):
    rows = {row["case"]: row for row in smoke["swarms"]["rows"]}
    row = rows[case]
    assert row["ok"], (row["problems"], smoke["log"])
    peers = smoke["swarms"]["settings"]["peers"]
    assert row["max_param_diff"] <= SWARM_ROUNDING and row["compared_at_epoch"] >= 1
    assert all(end < start for start, end in zip(row["loss_start"], row["loss_end"], strict=True))
    batch = smoke["swarms"]["settings"]["batch"]
    assert len(row["samples_skipped"]) == peers and all(s >= batch for s in row["samples_skipped"])
    for peer in smoke["swarms"]["peers"]:  # no inf/NaN reached any peer
        assert peer[case]["finite_after_every_round"] and peer[case]["finite_at_end"]
    if row["scaler"]:  # the scaler saw the overflow: it skipped the step and backed off on every peer
        assert all(after == before / 2 for before, after in row["scale_before_after"])
    assert smoke["returncode"] == 0 or not smoke["swarms"]["ok"]


def test_local_step_loop_times_every_variant_against_plain_torch(smoke):
    rows = smoke["step"]["rows"]
    assert {row["variant"] for row in rows} == {"plain torch fp16", "collabopt fp16", "collabopt reuse fp16",
                                                "hivemind fp16"}
    for row in rows:
        assert "error" not in row, row
        assert row["ratio"] > 0 and row["epochs"] >= smoke["step"]["settings"]["rounds"], row
    assert next(r for r in rows if r["variant"] == "plain torch fp16")["ratio"] == 1.0


def test_memory_rows_for_every_mode(smoke):
    memory = smoke["memory"]
    assert "error" not in memory, memory.get("error")
    assert [row["mode"] for row in memory["rows"]] == ["plain torch", "default", "offload_optimizer", "DiLoCo"]
    assert all(row["epochs"] >= 1 for row in memory["rows"])
