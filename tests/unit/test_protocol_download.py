"""The synchronous re-sync path's decisions (collabopt/engine/protocol_download.py), as tables of evidence."""

from __future__ import annotations

import pytest

from collabopt.engine.protocol_download import (
    DOWNLOAD_ACTIONS,
    RESYNC_ACTIONS,
    DownloadEvidence,
    ResyncEvidence,
    after_download,
    resync_after_download,
)

DOWNLOADS = [  # (local epoch, swarm epoch, seconds left) -> action
    ((5, 5, 10.0), "current"),
    ((6, 5, 10.0), "current"),  # (the swarm's records lag a peer that served a later state)
    ((5, 5, 0.0), "current"),
    ((4, 5, 10.0), "again"),  # an older state is not relabelled while time is left
    ((2, 5, 0.1), "again"),
    ((4, 5, 0.0), "relabel"),  # past the deadline one epoch behind: hivemind's rule, the last resort
    ((4, 5, -3.0), "relabel"),
    ((3, 5, 0.0), "behind"),  # two behind is never relabelled: the next step downloads again
    # its gradient round showed its group stepping to epoch 6 before the records did (a peer behind its round)
    ((4, 4, 10.0, 6), "again"),  # a state of the records' epoch is no catch-up
    ((5, 4, 10.0, 6), "again"),
    ((6, 4, 10.0, 6), "current"),
    ((4, 4, 0.0, 6), "behind"),  # nobody served it in time: never relabelled to an epoch the records do not show
    ((5, 5, 0.0, 6), "behind"),
    ((4, 5, 0.0, 6), "relabel"),  # (to the records' epoch 5, as without a round)
    ((3, 5, 0.0, 6), "behind"),
]


@pytest.mark.parametrize(("seen", "action"), DOWNLOADS)
def test_after_a_download(seen, action):
    decision = after_download(DownloadEvidence(*seen))
    assert decision.action == action and decision.action in DOWNLOAD_ACTIONS
    assert str(seen[0]) in decision.reason and any(str(epoch) in decision.reason for epoch in (seen[1], *seen[3:]))


RESYNCS = [  # (resyncing, apart, moved, seconds left) -> (resync, apart)
    ((False, False, False, 0.0), (None, False)),
    ((False, True, False, 0.0), (None, True)),  # its own state came back: still apart
    ((False, True, True, 0.0), (None, False)),  # a served state: no longer apart
    ((True, False, True, 5.0), ("done", False)),
    ((True, True, True, 0.0), ("done", False)),  # moved at the deadline still counts
    ((True, True, False, 5.0), ("retry", True)),  # the group's peers had not served the new state yet
    ((True, False, False, 0.0), ("give up", False)),
    ((True, True, False, -1.0), ("give up", True)),  # giving up leaves it apart: the next round checks again
]


@pytest.mark.parametrize(("seen", "decided"), RESYNCS)
def test_what_a_download_ends_of_a_resync(seen, decided):
    decision = resync_after_download(ResyncEvidence(*seen))
    assert (decision.resync, decision.apart) == decided
    assert decision.resync is None or decision.resync in RESYNC_ACTIONS
