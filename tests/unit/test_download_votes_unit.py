"""Downloads of the state most of the swarm holds (collabopt/engine/download_votes.py): the majority rule, the order
of the sources, the check of a downloaded state, and a download (collabopt/engine/downloads.py) that installs only a
state that passes it (refused: its parameters stay as they were). The swarm test: tests/swarm/test_download_votes.py."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from hivemind.optim.state_averager import dump_optimizer_state

from collabopt.config import CollabConfig
from collabopt.engine import lineage_check
from collabopt.engine.download_challenge import projection
from collabopt.engine.download_votes import Vote, majority, newest_majority, refusal, sources
from collabopt.engine.downloads import StateDownloads
from collabopt.errors import ConfigurationError
from collabopt.lineage import fingerprint

HONEST = list(torch.randn(72, generator=torch.Generator().manual_seed(0)).split([64, 8]))
PERMUTED = list(HONEST[0].roll(1).split([64])) + [HONEST[1].flip(0)]  # the same three sums
ALTERED = [t + 1000.0 for t in HONEST]
H, X = fingerprint(HONEST), fingerprint(ALTERED)


def votes(*entries: tuple[str, int, list[float]]) -> list[Vote]:
    return [Vote(*entry) for entry in entries]


def test_the_majority_is_more_than_half_of_the_votes_at_the_epoch_and_two_at_least():
    assert majority(votes(("a", 5, H), ("b", 5, H), ("c", 5, H), ("x", 5, X)), 5) == H
    assert majority(votes(("a", 5, H), ("b", 5, H), ("x", 5, X)), 5) == H
    assert majority(votes(("a", 5, H), ("x", 5, X)), 5) is None  # two peers that disagree
    assert majority(votes(("a", 5, H), ("b", 5, H), ("x", 5, X), ("y", 5, X)), 5) is None  # a tie
    assert majority(votes(("x", 5, X)), 5) is None  # one peer alone: it could be the hostile one
    assert majority([], 5) is None  # no votes yet (the swarm's first peer)
    # votes at other epochs take no part; a non-finite fingerprint is never the majority's
    assert majority(votes(("a", 5, H), ("b", 5, H), ("x", 4, X), ("y", 4, X), ("z", 4, X)), 5) == H
    nan = [float("nan")] * 3
    assert majority(votes(("a", 5, nan), ("b", 5, nan)), 5) is None


def test_the_newest_epoch_with_a_majority_is_the_one_downloaded():
    ballot = votes(("a", 5, H), ("b", 5, H), ("c", 6, H), ("x", 9, X))  # (one vote far ahead is no majority)
    assert newest_majority(ballot) == (5, H)
    assert newest_majority(votes(("a", 5, H), ("x", 5, X))) is None


def test_sources_claiming_the_majority_come_first_by_priority_and_never_this_peer():
    ballot = votes(("a", 5, H), ("b", 5, H), ("x", 5, X), ("me", 5, H))
    priorities = {"x": 1e6, "a": 5.0, "b": 6.0, "me": 7.0, "nv": 9.0}  # ("nv" votes not: never a source)
    order = sources(ballot, priorities, 5, H, "me")
    assert order == ["b", "a", "x"]  # (x votes another fingerprint: tried last)
    assert "c" not in sources(votes(("c", 5, H)), {"a": 1.0}, 5, H, "me")  # only peers that serve their state


def test_a_state_passes_only_with_the_majoritys_fingerprint_at_its_own_epoch():
    ballot = votes(("a", 5, H), ("b", 5, H), ("x", 5, H), ("a2", 6, X), ("b2", 6, X))
    assert refusal({"epoch": 5}, [*HONEST, torch.zeros(3)], 2, ballot) is None  # (statistics after the parameters)
    assert "another fingerprint" in refusal({"epoch": 5}, ALTERED, 2, ballot)  # x's vote lied
    # a server that moved on: its state is checked against the majority of the epoch it says it is
    assert refusal({"epoch": 6}, ALTERED, 2, ballot) is None
    assert "no majority" in refusal({"epoch": 7}, HONEST, 2, ballot)
    assert "no epoch" in refusal({"epoch": "5"}, HONEST, 2, ballot)
    assert "no epoch" in refusal(None, HONEST, 2, ballot)
    assert "1 tensors for 2" in refusal({"epoch": 5}, HONEST[:1], 2, ballot)


def state_averager(params, optimizer, **attributes):
    """A ConsistentStateAverager as a download sees it (its install on a downloaded state): no process, no DHT."""
    from collabopt.engine.state import ConsistentStateAverager

    avg = ConsistentStateAverager.__new__(ConsistentStateAverager)
    vars(avg).update(_parent_pid=-1, optimizer=optimizer, extra_tensors=(), lock_averaged_tensors=threading.Lock(),
                     lock_optimizer=threading.Lock(), _open_for_downloads=threading.Event(),
                     _closing_lock=threading.Lock(), _closings=0,
                     _label_lock=threading.Lock(), _epoch=0, _steps_owed=0, _step_with_increment=False,
                     offload_optimizer=False, reuse_tensors=True, scheduler=None, **attributes)
    return avg


@pytest.fixture
def averager():
    """A download (StateDownloads) into a state averager, through a fake state service: each source sends what
    ``served`` maps it to, and answers a challenge for it at its epoch in ``epochs``."""
    params = [torch.nn.Parameter(torch.zeros(64)), torch.nn.Parameter(torch.zeros(8))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    opt_metadata, opt_tensors = dump_optimizer_state(optimizer)
    served = {"x": ALTERED, "a": HONEST, "b": HONEST}
    asked: list[str] = []
    challenged: list[list[str]] = []
    epochs = {"x": 5, "a": 5, "b": 5}  # the epoch each peer serves when a challenge comes

    def ask_projections(peers, seed, epoch, timeout=None):  # (each peer answers for what it serves)
        challenged.append(sorted(peers))
        answers = {peer: dict(epoch=epochs[peer], projection=projection(served[peer], seed).values) for peer in peers}
        future = Future()
        future.set_result(answers)
        return future

    def fetch(peer, timeout):
        if peer not in served:
            return None
        asked.append(peer)
        return dict(epoch=5, optimizer_metadata=opt_metadata), [t.clone() for t in served[peer]] + opt_tensors

    service = SimpleNamespace(dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), fetch=fetch,
                              ask_projections=ask_projections, announce_download=lambda: None,
                              serving_peers=lambda: {"x": 1e6, "a": 5.0, "b": 5.0})
    avg = state_averager(params, optimizer,
                         votes=SimpleNamespace(read=lambda: votes(("a", 5, H), ("b", 5, H), ("x", 5, H))))
    return SimpleNamespace(averager=avg, downloads=StateDownloads(service, avg), service=service, params=params,
                           served=served, asked=asked, challenged=challenged, epochs=epochs)


def test_a_hostile_state_is_refused_and_the_next_source_installed(averager, caplog):
    averager.downloads.download(timeout=1.0)
    assert averager.asked[0] == "x" and len(averager.asked) == 2  # the hostile peer first (its priority), refused
    assert "refused the state x sent" in caplog.text
    assert all(torch.equal(p, h) for p, h in zip(averager.params, HONEST, strict=True))
    assert averager.averager.local_epoch == 5


def test_a_refused_state_leaves_the_parameters_as_they_were(averager, caplog):
    averager.served.update(a=ALTERED, b=ALTERED)  # every server sends another state than the votes' majority
    averager.downloads.download(timeout=1.0)
    assert sorted(averager.asked) == ["a", "b", "x"]
    assert all(torch.equal(p, torch.zeros_like(p)) for p in averager.params)
    assert averager.averager.local_epoch == 0
    assert "no peer sent the state most of the swarm holds" in caplog.text


def test_without_a_majority_only_a_swarm_of_one_vote_downloads_unverified(averager, caplog):
    """Votes that disagree download nothing (an unverified install would make a hostile server's state the next
    majority); fewer than two votes (the swarm's first epochs, one server) download unverified, logged."""
    averager.averager.votes = SimpleNamespace(read=lambda: votes(("a", 5, H), ("x", 5, X)))
    assert averager.downloads.download(timeout=1.0) is False and averager.asked == []
    assert "hold no fingerprint most of them share: nothing downloaded" in caplog.text
    averager.averager.votes = SimpleNamespace(read=lambda: votes(("a", 5, H)))
    averager.downloads.download(timeout=1.0)
    assert averager.asked == ["x"] and "this download is not verified" in caplog.text  # (by priority, unchecked)


def test_a_failed_read_or_source_downloads_nothing_unverified_and_the_next_source_is_tried(averager, caplog,
                                                                                           monkeypatch):
    from collabopt.engine.download_votes import VotesUnreadable

    def unreadable():
        raise VotesUnreadable("no DHT node answered")

    honest_votes = averager.averager.votes
    averager.averager.votes = SimpleNamespace(read=unreadable)
    assert averager.downloads.download(timeout=1.0) is False and averager.asked == []
    averager.averager.votes = honest_votes
    fetch = averager.service.fetch

    def first_fails(peer, timeout):
        if not averager.asked:
            averager.asked.append("timed out")
            raise TimeoutError("a slow stream")
        return fetch(peer, timeout)

    averager.service.fetch = first_fails
    averager.downloads.download(timeout=1.0)
    assert "failed (TimeoutError('a slow stream'))" in caplog.text and len(averager.asked) == 2
    assert all(torch.equal(p, h) for p, h in zip(averager.params, HONEST, strict=True))


def test_a_peer_votes_for_its_parameters_and_its_lineage_metadata_reads_them_afresh():
    params = [torch.nn.Parameter(torch.ones(3))]
    voted: list = []
    loop = SimpleNamespace(local_epoch=4, client_mode=False, sync_state=lineage_check.SyncState(checks_lineage=True),
                           state_averager=SimpleNamespace(main_parameters=params,
                                                          votes=SimpleNamespace(vote=lambda *a: voted.append(a))))
    lineage_check.vote_for_parameters(loop)
    assert voted == [(4, fingerprint(params))]
    assert lineage_check.lineage_metadata(loop)["lineage"] == voted[0][1]
    params[0].data.add_(1.0)  # (as the averager's process writes them: no version counter of this one moves)
    assert lineage_check.lineage_metadata(loop)["lineage"] == fingerprint(params) != voted[0][1]


def test_centered_clip_refuses_a_lossy_state_compression():
    from hivemind.compression import Float16Compression, NoCompression

    options = dict(run_id="r", target_batch_size=8, aggregation="centered_clip")
    with pytest.raises(ConfigurationError, match="load_state_compression"):
        CollabConfig.from_options(**options, load_state_compression=Float16Compression())
    CollabConfig.from_options(**options, load_state_compression=NoCompression())
    config = CollabConfig.from_options(**options)
    assert config.hivemind_arguments()["averager_opts"]["verify_downloads"] is True


def test_centered_clip_refuses_what_leaves_honest_parameters_apart():
    """hivemind's all-reduce leaves each member its own tensor plus a compressed difference: lossy parameter rounds,
    or lossy gradient rounds between parameter rounds, leave honest peers apart, and verified downloads (1e-5)
    would refuse them. DiLoCo's rounds answer with the average itself: its fp16 default stays."""
    from hivemind.compression import Float16Compression

    options = dict(run_id="r", target_batch_size=8, aggregation="centered_clip")
    with pytest.raises(ConfigurationError, match="state_averaging_compression"):
        CollabConfig.from_options(**options, state_averaging_compression=Float16Compression())
    with pytest.raises(ConfigurationError, match="average_state_every=1"):
        CollabConfig.from_options(**options, grad_compression=Float16Compression(), average_state_every=2)
    CollabConfig.from_options(**options, grad_compression=Float16Compression())  # a parameter round every epoch
    CollabConfig.from_options(run_id="r", target_batch_size=8, state_averaging_compression=Float16Compression())
    CollabConfig.from_options(**options, outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7),
                              grad_compression=Float16Compression())
    assert "verify_downloads" not in (CollabConfig.from_options(run_id="r", target_batch_size=8)
                                      .hivemind_arguments().get("averager_opts") or {})


def test_a_re_synchronization_s_preferred_peers_come_first_among_those_that_claim_the_majority(averager):
    averager.averager.votes = SimpleNamespace(read=lambda: votes(("a", 5, H), ("b", 5, H)))
    averager.service.serving_peers = lambda: {"a": 6.0, "b": 5.0}
    averager.downloads.prefer_sources(["b"])
    averager.downloads.download(timeout=1.0)
    assert averager.asked == ["b"]
    averager.downloads.prefer_sources([])
    averager.asked.clear()
    averager.downloads.download(timeout=1.0)
    assert averager.asked == ["a"]


def test_an_unverified_download_asks_by_priority_preferred_first_never_itself_and_installs_the_first_sent(averager):
    averager.averager.votes = None
    averager.served["x"] = None  # (x declines: it sends nothing)
    averager.service.fetch = lambda peer, timeout, fetch=averager.service.fetch: (
        averager.asked.append(peer) if averager.served.get(peer) is None else fetch(peer, timeout))
    averager.service.serving_peers = lambda: {"me": 1e9, "x": 7.0, "a": 6.0, "b": 5.0}
    assert averager.downloads.download(timeout=1.0) is True
    assert averager.asked == ["x", "a"] and averager.averager.local_epoch == 5
    assert all(torch.equal(p, h) for p, h in zip(averager.params, HONEST, strict=True))
    averager.asked.clear()
    averager.averager.local_epoch = 0
    averager.downloads.prefer_sources(["b"])
    averager.downloads.download(timeout=1.0)
    assert averager.asked == ["b"]


def test_the_state_service_serves_under_hivemind_s_name():
    """Plain hivemind peers download from ``<prefix>::TrainingStateAverager.rpc_download_state``: the state service
    answers under that name."""
    from collabopt.engine.state_service import StateServicer

    name = "run_state_averager::TrainingStateAverager.rpc_download_state"
    assert StateServicer._get_handle_name("run_state_averager", "rpc_download_state") == name


def test_a_read_of_the_votes_that_no_node_answered_is_an_error_not_an_empty_ballot(monkeypatch):
    """An empty ballot downloads unverified (the swarm's first votes); a failed read must not: it is retried."""
    from collabopt.engine import download_votes
    from collabopt.engine.records import RunRecords

    answered = RunRecords()
    monkeypatch.setattr(download_votes, "read_run_records", lambda *args, **kwargs: answered)
    reader = download_votes.DownloadVotes(dht=None, records_dht=None, run_id="run", public_key=b"k")
    with pytest.raises(download_votes.VotesUnreadable, match="run_fingerprints"):
        reader.read()  # (no node answered: sources 0)
    answered.sources = 2
    assert reader.read() == []


def test_a_permutation_passes_the_fingerprint_and_is_refused_by_the_secret_challenge(averager, caplog):
    """The hostile source sends a permutation of the honest parameters (its three sums are theirs); the other voters'
    answers refuse it, and the next source, whose answers agree, is installed. A source is never its own answerer."""
    assert refusal({"epoch": 5}, PERMUTED, 2, votes(("a", 5, H), ("b", 5, H))) is None  # (the fingerprint's gap)
    averager.served["x"] = PERMUTED
    averager.downloads.download(timeout=1.0)
    assert averager.downloads.handed_on and averager.asked[0] == "x" and len(averager.asked) == 2
    assert averager.challenged == [["a", "b"], sorted({"a", "b", "x"} - {averager.asked[1]})]
    assert "refused the state x sent" in caplog.text
    assert "secret challenge: 0 answer(s) agree, 2 disagree" in caplog.text
    assert all(torch.equal(p, h) for p, h in zip(averager.params, HONEST, strict=True))


def test_a_refused_source_is_tried_last_in_the_next_downloads(averager):
    averager.served["x"] = PERMUTED
    for attempt in range(5):
        averager.asked.clear()
        averager.downloads.download(timeout=1.0)
        assert (averager.asked[0] == "x") == (attempt in (0, 4)), attempt  # (x's priority is the highest)


def test_without_answers_at_the_states_epoch_nothing_is_installed_and_the_source_is_not_remembered(averager, caplog):
    """The other voters moved on an epoch: their answers (at epoch 6) are no answers; each state is not installed, the
    log says so once (INFO), and the download is tried again, with the same order of sources."""
    averager.served["x"] = HONEST
    averager.epochs.update(x=6, a=6, b=6)
    caplog.set_level("INFO", logger="collabopt")
    assert averager.downloads.download(timeout=1.0) is False and not averager.downloads.handed_on
    assert averager.asked[0] == "x" and sorted(averager.asked) == ["a", "b", "x"]
    assert caplog.text.count("answered its challenge") == 1 and averager.downloads._refused_sources == {}
    assert "WARNING" not in caplog.text  # (a retry the swarm's pace causes, not a fault)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in averager.params)
    averager.epochs.update(a=5)  # one voter of epoch 5 answers: it agrees
    averager.asked.clear()
    averager.downloads.download(timeout=1.0)
    assert averager.asked == ["x"] and all(torch.equal(p, h) for p, h in zip(averager.params, HONEST, strict=True))


def test_a_diloco_peer_counts_a_refused_download_as_not_done(monkeypatch):
    """DiLoCo keeps what a PartialRound must decide (``delivered``) until a state is installed: a download whose
    state was refused (nothing handed on) is not one."""
    import contextlib

    from collabopt.engine.diloco_round import DiLoCoLoop

    restored = []
    loop = DiLoCoLoop.__new__(DiLoCoLoop)
    state_averager = SimpleNamespace(step=lambda **kwargs: None, local_epoch=3)
    vars(loop).update(
        land=lambda wait: None, scheduled_grads=None, state_averager=state_averager, anchors=(torch.zeros(2),),
        state_downloads=SimpleNamespace(download=lambda timeout=None: False),
        load_state_timeout=1.0, _share_state=lambda: None,
        grad_averager=SimpleNamespace(reset_accumulated_grads_=lambda: None),
        tracker=SimpleNamespace(pause_updates=contextlib.nullcontext, report_local_progress=lambda **kwargs: None),
        diloco=SimpleNamespace(progress_to_keep=lambda swarm: ([], None), needs_sync=True, resyncs=0,
                               restore_after_download=lambda *args: restored.append(args[3])))
    monkeypatch.setattr(DiLoCoLoop, "local_epoch", property(lambda self: 3), raising=False)
    loop.load_state_from_peers()
    assert restored == [False]


def test_a_whitespace_alias_of_the_hostile_peer_is_neither_its_answerer_nor_a_source(averager, caplog):
    """x votes as "x " (PeerID.from_base58 strips it: it dials x): before, the joiner refused a (0-1 against "x ")
    and then installed x's permutation (1-1: a against, "x " = x for). A vote names a canonical id or no one."""
    averager.served["x"] = PERMUTED
    averager.averager.votes = SimpleNamespace(read=lambda: votes(("a", 5, H), ("x ", 5, H)))
    averager.service.serving_peers = lambda: {"x": 1e6, "a": 5.0}
    assert averager.downloads.download(timeout=1.0) is False  # (1 vs 1: nothing can be verified)
    assert averager.asked == ["a"] and averager.challenged == []  # x: no vote names it; "x ": no one
    assert all(torch.equal(p, torch.zeros_like(p)) for p in averager.params)


def test_a_second_identity_under_the_hostile_key_never_answers_for_it(averager):
    """x's key votes for y, a second identity x controls, serving x's permutation: x itself (no vote) is no source,
    and y as source is challenged by a alone (before: x source, a and y answered, 1-1, installed)."""
    averager.served.update(x=PERMUTED, y=PERMUTED)
    averager.epochs["y"] = 5
    averager.averager.votes = SimpleNamespace(read=lambda: [Vote("a", 5, H, b"ka"), Vote("y", 5, H, b"kx")])
    averager.service.serving_peers = lambda: {"x": 1e6, "y": 1e5, "a": 5.0}
    assert averager.downloads.download(timeout=1.0) is False
    assert averager.asked == ["y", "a"] and averager.challenged == [["a"], ["y"]]
    assert all(torch.equal(p, torch.zeros_like(p)) for p in averager.params)


def test_no_vote_its_sources_key_signed_answers_for_a_source(averager):
    """One key, one role: votes of the source's key never answer for it (two such votes: x and y under kx)."""
    averager.served.update(x=PERMUTED, y=PERMUTED)
    averager.epochs["y"] = 5
    averager.averager.votes = SimpleNamespace(read=lambda: [Vote("a", 5, H, b"ka"), Vote("x", 5, H, b"kx"),
                                                            Vote("y", 5, H, b"kx")])
    averager.service.serving_peers = lambda: {"x": 1e6, "y": 1e5, "a": 5.0}
    averager.downloads.download(timeout=1.0)
    assert averager.challenged[:2] == [["a"], ["a"]]  # (x's and y's states: a alone answers, against)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in averager.params)


def test_client_voters_are_never_asked_and_clients_do_not_vote(averager):
    """Client-mode peers serve no state and register no handler: only voters that serve are asked. A client's
    DownloadVotes stores no vote (a swarm of one server and clients: one vote, the download is hivemind's)."""
    averager.averager.votes = SimpleNamespace(read=lambda: votes(("a", 5, H), ("b", 5, H), ("c", 5, H), ("d", 5, H)))
    averager.service.serving_peers = lambda: {"a": 6.0, "b": 5.0}  # (c and d: clients)
    averager.downloads.download(timeout=1.0)
    assert averager.asked == ["a"] and averager.challenged == [["b"]]
    assert all(torch.equal(p, h) for p, h in zip(averager.params, HONEST, strict=True))
    from collabopt.engine.download_votes import DownloadVotes

    stored = []
    client = DownloadVotes(SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "c")),
                           SimpleNamespace(store=lambda **kwargs: stored.append(kwargs)), "run", b"k")
    client.serves = False
    client.vote(5, H)
    assert stored == []
    client.serves = True
    client.vote(5, H)
    assert len(stored) == 1


def test_the_votes_read_carry_their_signing_key(monkeypatch):
    from collabopt.engine import download_votes
    from collabopt.engine.records import RunRecords

    found = RunRecords()
    found.sources = 1
    found.fingerprints = {b"kx": (dict(peer_id="x ", epoch=5, fingerprint=H), 1.0), b"kb": (None, 1.0)}
    monkeypatch.setattr(download_votes, "read_run_records", lambda *args, **kwargs: found)
    reader = download_votes.DownloadVotes(dht=None, records_dht=None, run_id="run", public_key=b"k")
    assert reader.read() == [Vote("x ", 5, H, b"kx")]
    assert download_votes.voters_of(reader.read(), 5, H) == set()  # (not canonical)
