"""Modes that must not change the math: gradient buffer reuse, offloading and AMP with torch.amp.GradScaler.

Each mode trains the same model on the same batches as a solo peer of a real swarm (fresh process).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env, max_param_diff

pytestmark = pytest.mark.swarm
WORKER = Path(__file__).resolve().parent / "equivalence_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence") / "results.pt"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


SAME_AS_FP32 = ["fp32_reuse", "fp32_offload", "amp", "amp_reuse", "amp_reuse_unscale_first", "amp_offload"]


def test_reference_run_trained(results):
    fp32 = results["fp32"]
    assert fp32["epoch"] == 6
    assert fp32["samples_reported"] == 24 * 16


@pytest.mark.parametrize("mode", SAME_AS_FP32)
def test_mode_gives_bit_identical_parameters(results, mode):
    assert results[mode]["epoch"] == results["fp32"]["epoch"]
    assert results[mode]["samples_reported"] == results["fp32"]["samples_reported"]
    assert max_param_diff(results[mode]["params"], results["fp32"]["params"]) == 0.0


def test_zero_grad_is_safe_and_warns_once_with_reuse(results):
    for mode, result in results.items():
        expected = 1 if "reuse" in mode else 0
        assert result["zero_grad_warnings"] == expected, mode


def test_amp_overflow_step_is_dropped_exactly(results):
    dropped = results["amp_overflow5"]
    assert dropped["samples_skipped"] == 16
    assert dropped["samples_reported"] == 23 * 16
    assert max_param_diff(dropped["params"], results["fp32_skip5"]["params"]) == 0.0
    assert max_param_diff(dropped["params"], results["fp32"]["params"]) > 0.0


def test_amp_overflow_with_reuse_drops_the_local_accumulation(results):
    """With reuse_grad_buffers the overflow poisons param.grad, which also held step 4: both are dropped."""
    dropped = results["amp_reuse_overflow5"]
    assert dropped["samples_skipped"] == 32 and dropped["samples_reported"] == 22 * 16
    assert all(torch.isfinite(p).all() for p in dropped["params"].values())
    assert max_param_diff(dropped["params"], results["fp32_skip4_5"]["params"]) == 0.0
