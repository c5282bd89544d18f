"""The core's view of its peer's rounds (collabopt.rounds): each outcome once, the guard's refusals in it, and the
warning about epochs shorter than matchmaking_time."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from collabopt import RoundOutcome
from collabopt.rounds import RoundWatch


def guard(refused: int = 0, restored: int = 0) -> SimpleNamespace:
    return SimpleNamespace(refused_updates=refused, restored_parameters=restored)


def test_each_outcome_is_seen_once_and_the_guards_refusal_amends_it():
    g = guard()
    watch = RoundWatch(g, matchmaking_time=2.0, target_batch_size=100, judges_average=True)
    first = RoundOutcome(True, "averaged", 3, 10.0, 3, epoch=0)
    assert watch.ended(None, lambda: 50.0) is None and watch.last is None
    assert watch.ended(first, lambda: 50.0) is first
    assert watch.ended(first, lambda: 50.0) is None  # the same round: once
    g.refused_updates = 1  # the next round's averaged gradients were not finite: no update
    second = watch.ended(RoundOutcome(True, "averaged", 3, 10.0, 3, epoch=1), lambda: 50.0)
    assert (second.applied, second.reason, second.epoch) == (False, "non-finite average", 1) and watch.last is second
    g.restored_parameters = 1  # its averaged parameters were not: this peer's own update is kept
    third = watch.ended(RoundOutcome(True, "averaged", 3, 10.0, 3, epoch=2), lambda: 50.0)
    assert (third.applied, third.reason) == (True, "non-finite average")
    fourth = RoundOutcome(True, "averaged", 3, 10.0, 3, epoch=3)
    assert watch.ended(fourth, lambda: 50.0) is fourth  # nothing refused since


def test_diloco_rounds_judge_their_average_themselves():
    g = guard()
    watch = RoundWatch(g, matchmaking_time=2.0, target_batch_size=100, judges_average=False)
    g.refused_steps = g.refused_updates = 1
    outcome = RoundOutcome(True, "averaged", 2, 10.0, 2, epoch=0)
    assert watch.ended(outcome, lambda: 50.0) is outcome


def test_epochs_shorter_than_matchmaking_time_are_said_once_with_what_to_set(caplog):
    watch = RoundWatch(None, matchmaking_time=5.0, target_batch_size=1024, judges_average=True)
    with caplog.at_level(logging.WARNING, logger="collabopt.rounds"):
        for epoch in range(2):  # 1024 samples at 1280/s: 0.8 s, against 5 s
            watch.ended(RoundOutcome(True, "averaged", 2, epoch=epoch), lambda: 1280.0)
        assert not caplog.records  # two short rounds are not yet a pattern
        for epoch in range(2, 6):
            watch.ended(RoundOutcome(True, "averaged", 2, epoch=epoch), lambda: 1280.0)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "fills an epoch in 0.8 s, less than matchmaking_time (5.0 s)" in text
    assert "target_batch_size to about 26000 or more" in text  # 4 x 5 s x 1280 samples/s = 25,600


def test_epochs_of_several_matchmaking_times_are_not_said(caplog):
    watch = RoundWatch(None, matchmaking_time=2.0, target_batch_size=1024, judges_average=True)
    with caplog.at_level(logging.WARNING, logger="collabopt.rounds"):
        for epoch in range(10):  # 1024 samples at 100/s: 10 s; a short one in between does not count three
            rate = 100.0 if epoch % 3 else 1000.0
            watch.ended(RoundOutcome(True, "averaged", 2, epoch=epoch), lambda rate=rate: rate)
    assert not caplog.records
