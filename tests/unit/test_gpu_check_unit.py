"""The checks of ``gpu-check``'s AMP swarms fail when they should (benchmarks/gpu_check.py ``check_case``), and the
wheel list for the GPU machine holds what it lacks (benchmarks/gpu_wheels.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check import SWARM_SETTINGS, check_case
from benchmarks.gpu_swarm import slug

CASE = "plain fp16"
SETTINGS = SWARM_SETTINGS["smoke"]


def peer_result(**changes) -> dict:
    result = dict(start_loss=1.4, final_loss=1.2, samples_skipped=SETTINGS["batch"], scale_before=1024.0,
                  scale_after=512.0, final_epoch=2, autocast="bfloat16", scaler=True, seconds=3.0, timed_out=False,
                  finite_after_every_round=True, finite_at_end=True)
    result.update(changes)
    return {CASE: result}


def run_check(tmp_path, results: list[dict], offset: float = 0.0) -> dict:
    for index in range(len(results)):
        params = {"w": torch.ones(3) + (offset if index else 0.0)}
        torch.save({0: params, 1: params, 2: params}, tmp_path / f"{slug(CASE)}.{index}.pt")
    return check_case(tmp_path, CASE, results, SETTINGS)


def test_a_healthy_case_passes(tmp_path):
    row = run_check(tmp_path, [peer_result(), peer_result()])
    assert row["ok"], row["problems"]
    assert row["compared_at_epoch"] == 2 and row["max_param_diff"] == 0.0


@pytest.mark.parametrize("changes, offset, problem", [
    ({}, 1e-3, "apart"),
    ({"final_loss": 1.5}, 0.0, "loss did not fall"),
    ({"samples_skipped": 0}, 0.0, "overflow step was not skipped"),
    ({"finite_after_every_round": False}, 0.0, "non-finite"),
    ({"scale_after": 1024.0}, 0.0, "did not back off"),
    ({"timed_out": True}, 0.0, "in time"),
    ({"error": "RuntimeError: boom"}, 0.0, "boom"),
])
def test_each_check_can_fail(tmp_path, changes, offset, problem):
    row = run_check(tmp_path, [peer_result(), peer_result(**changes)], offset)
    assert not row["ok"]
    assert any(problem in p for p in row["problems"]), row["problems"]


def test_the_wheels_hold_hivemind_and_its_missing_needs_not_what_the_gpu_machine_has():
    pytest.importorskip("hivemind")
    from benchmarks.gpu_wheels import installs_on_device, missing_on_device

    pins = missing_on_device()
    assert pins["hivemind"] == "1.1.12"
    assert {"pydantic", "cryptography", "protobuf"} <= set(pins)
    assert not {"torch", "numpy", "lightning", "accelerate", "grpcio"} & set(pins)
    assert installs_on_device("hivemind-1.1.12-py3-none-manylinux2014_x86_64.whl")
    assert installs_on_device("cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl")
    assert not installs_on_device("pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not installs_on_device("x-1.0-cp312-cp312-macosx_11_0_arm64.whl")
