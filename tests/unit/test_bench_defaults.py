"""The figures of benchmarks/defaults.py (each side on its own defaults), from canned peer records: no swarm runs."""

from __future__ import annotations

import torch

from benchmarks import defaults, swarmrun


def test_window_rate_counts_the_steps_inside_whole_epochs():
    # window from the transition at t=10 to the one at t=14: the steps ending at 11, 12, 14 count (not 10, not 15)
    record = dict(window=[10.0, 14.0], steps=[[9.0, 32], [10.0, 32], [11.0, 32], [12.0, 32], [14.0, 32], [15.0, 32]],
                  epochs=[[10.0, 1], [12.0, 2], [14.0, 3], [15.0, 4]])
    assert defaults.window_rate(record) == 3 * 32 / 4.0
    assert defaults.epoch_seconds(record) == 2.0


def test_parameter_differences_compare_every_common_epoch(tmp_path):
    a, b = {}, {}
    for epoch, delta in ((1, 0.0), (2, 0.5), (3, 0.0)):
        a[epoch] = tmp_path / f"a_{epoch}.pt"
        torch.save(torch.ones(4), a[epoch])
        b[epoch] = tmp_path / f"b_{epoch}.pt"
        torch.save(torch.ones(4) + torch.tensor([0.0, -delta, 0.0, 0.0]), b[epoch])
    a[4] = a[3]  # reached by one peer only: not compared
    assert swarmrun.parameter_differences([a, b]) == {1: 0.0, 2: 0.5, 3: 0.0}


def test_a_peer_holding_nan_is_apart_whatever_the_order(tmp_path):
    # the snapshots a peer writes, read back by epoch; among 3 peers, a NaN on either of the others is NaN apart
    # (Python's max() over [0.5, nan] keeps 0.5)
    values = {"a": [1.0, 1.0], "b": [1.0, 1.5], "c": [1.0, float("nan")]}
    for name, row in values.items():
        swarmrun.save_snapshot(str(tmp_path / name), 7, [torch.tensor(row[:1]), torch.tensor(row[1:])])
    paths = {name: swarmrun.snapshot_paths(str(tmp_path / name)) for name in values}
    assert paths["a"] == {7: tmp_path / "a_e7.pt"}
    for order in (["a", "b", "c"], ["a", "c", "b"], ["c", "a", "b"]):
        diffs = swarmrun.parameter_differences([paths[n] for n in order])
        assert list(diffs) == [7] and diffs[7] != diffs[7], order
    assert swarmrun.parameter_differences([paths["a"], paths["b"]]) == {7: 0.5}
    assert not list(tmp_path.glob("*.tmp"))  # (written whole, then renamed)


def test_snapshots_of_a_peer_are_removed_before_a_run_and_after_the_comparison(tmp_path):
    for name in ("p_e1.pt", "p_e2.pt.tmp", "p_1_e1.pt", "q_e1.pt"):  # (a half-written one; another peer's)
        torch.save(torch.ones(2), tmp_path / name)
    swarmrun.remove_snapshots(str(tmp_path / "p"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p_1_e1.pt", "q_e1.pt"]
    swarmrun.save_snapshot(str(tmp_path / "p"), 1, [torch.ones(2)])
    assert swarmrun.compare_snapshots([str(tmp_path / "p"), str(tmp_path / "q")]) == {1: 0.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p_1_e1.pt"]


def test_summary_needs_every_session_at_or_above_the_goal_and_peers_equal():
    def session(ratio, diff):
        return dict(ratio=ratio, collabopt=dict(max_param_diff=diff, epochs_compared=10))

    good = defaults.summarize([session(1.2, 0.0), session(1.1, 1e-9), session(1.3, 0.0)])
    assert good["ratio_met"] and good["params_met"] and good["ratio_median"] == 1.2
    slow = defaults.summarize([session(1.2, 0.0), session(0.9, 0.0), session(1.3, 0.0)])
    assert not slow["ratio_met"]
    apart = defaults.summarize([session(1.2, 0.0), session(1.2, 0.01), session(1.3, 0.0)])
    assert not apart["params_met"] and apart["collabopt_max_param_diff"] == 0.01


def test_report_names_host_load_commit_and_settings():
    side = dict(samples_per_s=1000.0, epoch_seconds=10.0, epochs_compared=10, max_param_diff=0.0, epochs_apart=[])
    sessions = [dict(ratio=1.1, hivemind=side, collabopt=dict(side, samples_per_s=1100.0))]
    machine = dict(host="h", cpu="cpu", cpus=2, date_utc="2026-01-01 00:00 UTC", load_avg_1m_at_start=2.5,
                   torch="2", hivemind="1.1.12", collabopt="0.1", git_commit="abc1234")
    result = dict(sessions=sessions, **defaults.summarize(sessions), config=defaults.QUICK, machine=machine,
                  dirty=["collabopt/x.py"])
    text = defaults.report(result)
    assert "`h`" in text and "load 2.5" in text and "`abc1234` plus uncommitted changes to collabopt/x.py" in text
    assert "| 1 | 1000 | 1100 | 1.100 |" in text and "Median ratio **1.100**" in text
    assert f"target_batch_size` = {defaults.QUICK['target_batch_size']:,}" in text


def test_rounds_not_averaged_counts_what_was_not_the_whole_swarm_s_average():
    full = dict(reason="averaged", group_size=2)
    alone = dict(reason="no group", group_size=1)
    records = [dict(rounds=[full, alone]), dict(rounds=[full, dict(full, group_size=1)])]
    assert swarmrun.rounds_not_averaged(records) == 2
    assert swarmrun.rounds_not_averaged([dict(rounds=[full]), dict(rounds=[full]), dict()]) == 2  # (groups of 2 of 3)
    assert swarmrun.rounds_not_averaged([dict(rounds=[full]), dict(rounds=[full])]) == 0
