"""PowerSGD as users write it, ``grad_averager_factory=partial(PowerSGDGradientAverager, averager_rank=1)``: two peer
processes run collabopt's own PowerSGD rounds (engine/powersgd_rounds.py) and end equal at every common epoch."""

from __future__ import annotations

import pytest
from helpers import (
    SWARM_ROUNDING,
    diffs_at_common_epochs,
    finish,
    finish_line,
    read_result,
    start_peer,
    unique_run_id,
    worst,
)

pytestmark = pytest.mark.swarm


def test_powersgd_rounds_leave_the_peers_equal_and_train(tmp_path, bootstrap):
    """Rank 1 compresses both weight matrices of the workers' model (the biases are averaged whole). Each round's
    two phases give every member the same bytes of P and Q: the peers step alike."""
    base = dict(run_id=unique_run_id("powersgd"), target_batch_size=384, epochs=4, model_seed=0, lr=0.8,
                step_sleep=0.05, finish_with=finish_line(tmp_path, "a", "b"), wait_peers=2, save_epoch_params=True,
                powersgd_rank=1, options=dict(matchmaking_time=1.0, next_chunk_timeout=5.0))
    configs = {"a": dict(base, seed=1), "b": dict(base, seed=2)}
    procs = {name: start_peer(tmp_path, name, cfg, bootstrap) for name, cfg in configs.items()}
    finish(procs, 120)
    for name in configs:
        result = read_result(tmp_path, name)
        assert "PowerSGD gradient rounds of rank 1: 2 of 4 tensors compressed" in (tmp_path / f"{name}.log").read_text()
        assert result["final_epoch"] >= 4, (name, result["final_epoch"])
        assert sum(r["reason"] == "averaged" for r in result["rounds"]) >= 3, (name, result["rounds"])
        assert result["final_loss"] < 0.93 * result["start_loss"], (name, result["start_loss"], result["final_loss"])
    apart = diffs_at_common_epochs(tmp_path, ["a", "b"])
    assert len(apart) >= 4 and worst(apart.values()) <= SWARM_ROUNDING, apart
