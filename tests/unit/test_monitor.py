"""The monitor without a swarm: how each record is judged (real Ed25519 signatures), the state and verdict built
from records, the status page's server, the loss a peer reports, and the adapters' report of it."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from collabopt import ConfigurationError, RoundOutcome, monitor
from collabopt.engine import records as run_records
from collabopt.engine.record_signing import SIGNATURE_FORMAT, Ed25519SignatureValidator
from collabopt.metrics import MetricsReporter
from collabopt.status_page import StatusServer, parse_address, prometheus_text

KEY = "unit_run_progress"
KEY_ID = DHTID.generate(source=KEY).to_bytes()
PROGRESS = run_records._record_models()["progress"]


def owner(seed: bytes) -> bytes:
    return Ed25519SignatureValidator(seed).local_public_key


def sign(seed: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """``value`` signed by ``seed``'s key, whatever owner ``subkey`` names."""
    record = DHTRecord(KEY_ID, MSGPackSerializer.dumps(subkey), value, expiration)
    signature = Ed25519PrivateKey.from_private_bytes(seed).sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return value + SIGNATURE_FORMAT.replace(b"_value_", base64.b64encode(signature))


def progress(**changes) -> dict:
    return dict(dict(peer_id=b"\x00\x24" + b"p" * 36, epoch=3, samples_accumulated=10, samples_per_second=5.0,
                     time=time.time(), client_mode=False), **changes)


def judge(subkey: bytes | None, value: bytes, expiration: float = 1e10) -> str:
    subkey_bytes = MSGPackSerializer.dumps(subkey) if subkey is not None else None
    return run_records._check_record(KEY_ID, subkey_bytes, value, expiration, PROGRESS)[0]


def test_each_record_is_judged_on_its_own():
    alice, mallory = os.urandom(32), os.urandom(32)
    good = MSGPackSerializer.dumps(progress())
    assert judge(owner(alice), sign(alice, owner(alice), good, 1e10)) == "ok"
    assert judge(owner(alice), sign(alice, owner(alice), MSGPackSerializer.dumps(None), 1e10)) == "ok"  # left
    assert judge(b"rogue", good) == "unsigned"
    assert judge(b"rogue", MSGPackSerializer.dumps("garbage")) == "unsigned"
    assert judge(owner(alice), good) == "bad_signature"  # no signature
    assert judge(owner(alice), sign(mallory, owner(alice), good, 1e10)) == "bad_signature"  # another key's
    assert judge(owner(alice), sign(alice, owner(alice), good, 1e10), expiration=2e10) == "bad_signature"  # replayed
    assert judge(b"[ed25519:not-a-key]", good + b"[signature:c2ln]") == "bad_signature"
    assert judge(b"[owner:not-a-key]", good + b"[signature:c2ln]") == "unsigned"  # (hivemind's marker: no owner)
    for content in ({"epoch": "lots"}, progress(epoch=3.0), progress(extra=1), progress(epoch=-1)):
        assert judge(owner(alice), sign(alice, owner(alice), MSGPackSerializer.dumps(content), 1e10)) == "malformed"
    assert judge(owner(alice), sign(alice, owner(alice), b"\xc1\xc1", 1e10)) == "malformed"
    assert judge(None, good) == "malformed"  # one plain value where every peer keeps its own record
    huge = MSGPackSerializer.dumps(progress(peer_id=b"x" * 100_000))
    assert judge(owner(alice), sign(alice, owner(alice), huge, 1e10)) == "oversized"


def test_peers_refuse_oversized_records_under_the_run_keys():
    validator = run_records.RecordSizeValidator([KEY], run_records.MAX_RECORD_BYTES)
    small, big = b"v" * 100, b"v" * (run_records.MAX_RECORD_BYTES + 1)
    assert validator.validate(DHTRecord(KEY_ID, b"s", small, 1e10))
    assert not validator.validate(DHTRecord(KEY_ID, b"s", big, 1e10))
    assert validator.validate(DHTRecord(DHTID.generate(source="other").to_bytes(), b"s", big, 1e10))
    other = run_records.RecordSizeValidator(["other"], run_records.MAX_RECORD_BYTES)
    assert validator.merge_with(other) and not validator.validate(
        DHTRecord(DHTID.generate(source="other").to_bytes(), b"s", big, 1e10))


# ---------------------------------------------------------------------------------------------- the state


def metrics_record(peer_id: str, **changes) -> dict:
    record = dict(peer_id=peer_id, time=time.time(), interval=1.0, epoch=5, global_epoch=5, samples_per_second=10.0,
                  samples_reported=100, samples_skipped=0, nonfinite_steps=0, target_batch_size=64, loss=1.5,
                  losses_reported=10, nonfinite_losses=0, client_mode=False, relayed=False, auxiliary=False,
                  collabopt_version="0", hivemind_version="1", torch_version="2", python_version="3", last_round=None)
    record.update(changes)
    return record


class FakeRecords:
    """Stands in for read_run_records: the test sets what the DHT holds."""

    def __init__(self):
        self.metrics: dict[bytes, tuple] = {}
        self.progress: dict[bytes, tuple] = {}
        self.rejected: list[tuple] = []

    def __call__(self, dht, run_id, timeout):
        return SimpleNamespace(metrics=dict(self.metrics), progress=dict(self.progress), rejected=list(self.rejected),
                               sources=3, bad_responses=0)


@pytest.fixture
def records(monkeypatch):
    fake = FakeRecords()
    monkeypatch.setattr(monitor, "read_run_records", fake)
    return fake


def by_id(state: dict) -> dict:
    return {row["id"]: row for row in state["peers"]}


def test_state_rows_sync_and_counts(records):
    now = time.time()
    records.metrics = {
        b"a": (metrics_record("A", samples_reported=300, last_round="epoch 4: applied: averaged (3 of 3)"), now + 30),
        b"b": (metrics_record("B", epoch=3, samples_reported=100, client_mode=True), now + 30),
        b"c": (metrics_record("C", time=now - 60), now + 30),  # stopped publishing a minute ago
        b"d": (None, now + 30),  # left
        b"r": (metrics_record("R", relayed=True, loss=None), now + 30),
    }
    records.progress = {b"a": (progress(epoch=5, samples_accumulated=20, time=now), now + 60), b"d": (None, now + 60)}
    records.rejected = [("metrics", b"f1", "unsigned"), ("progress", b"f2", "bad_signature")]
    watcher = monitor.SwarmMonitor(None, "unit", interval=1.0)
    state = watcher.refresh()
    rows = by_id(state)
    assert state["global_epoch"] == 5 and state["num_peers"] == 3 and state["peers_known"] == 5
    assert (rows["A"]["sync"], rows["B"]["sync"], rows["C"]["sync"], rows["R"]["sync"]) == (
        "in sync", "catching up", "stale", "in sync")  # B is 2 epochs behind
    assert [r for r in state["peers"] if r["sync"] == "left"][0]["left"]
    assert (rows["A"]["reachability"], rows["B"]["reachability"], rows["R"]["reachability"]) == (
        "reachable", "client", "relayed")
    assert rows["A"]["share"] == pytest.approx(300 / 600) and rows["A"]["samples_accumulated"] == 20
    assert (rows["A"]["last_round"], rows["B"]["last_round"]) == ("epoch 4: applied: averaged (3 of 3)", None)
    assert state["samples_per_second"] == 30.0 and state["loss"] == 1.5
    assert state["eta_seconds"] == pytest.approx((64 - 20) / 30.0)
    assert state["rejected"]["by_kind"] == {"metrics/unsigned": 1, "progress/bad_signature": 1}
    # the same refused records read again (another node, a later read) are not counted again
    records.rejected.append(("metrics", b"f3", "oversized"))
    assert watcher.refresh()["rejected"]["total"] == 3
    json.dumps(state, allow_nan=False)
    text, content_type = prometheus_text(state)
    assert "collabopt_peer_epoch" in text.decode() and content_type.startswith("text/plain")
    assert 'collabopt_rejected_records_total{reason="unsigned",record="metrics",run_id="unit"} 1.0' in text.decode()


def test_one_epoch_behind_is_catching_up_only_after_a_grace(records, monkeypatch):
    records.metrics = {b"a": (metrics_record("A", epoch=5), 1e10), b"b": (metrics_record("B", epoch=4), 1e10)}
    watcher = monitor.SwarmMonitor(None, "unit", interval=1.0)
    assert by_id(watcher.refresh())["B"]["sync"] == "in sync"
    monkeypatch.setattr(monitor, "CATCH_UP_GRACE", 0.0)
    time.sleep(0.01)
    assert by_id(watcher.refresh())["B"]["sync"] == "catching up"


def test_verdicts(records):
    records.metrics = {b"a": (metrics_record("A"), 1e10)}
    watcher = monitor.SwarmMonitor(None, "unit", interval=1.0, stall_after=0.05)
    assert watcher.refresh()["verdict"] == "training"
    time.sleep(0.1)
    state = watcher.refresh()
    assert state["verdict"] == "stalled" and "no progress" in state["verdict_reason"]
    records.metrics = {b"a": (metrics_record("A", epoch=6, nonfinite_losses=2), 1e10)}
    assert watcher.refresh()["verdict"] == "diverging"
    assert watcher.refresh()["verdict"] == "training"  # no new non-finite loss since
    for loss in [1.0] * 10 + [5.0] * 5:  # the loss rises to 5x its lowest
        records.metrics = {b"a": (metrics_record("A", epoch=int(loss * 100), loss=loss), 1e10)}
        state = watcher.refresh()
    assert state["verdict"] == "diverging" and "loss" in state["verdict_reason"]
    records.metrics = {}
    assert monitor.SwarmMonitor(None, "unit").refresh()["verdict_reason"] == "no live peer"


def test_status_server_serves_the_page_json_and_metrics(records):
    records.metrics = {b"a": (metrics_record("A"), 1e10)}
    server = StatusServer(monitor.SwarmMonitor(None, "unit", interval=0.2), ("127.0.0.1", 0)).start()
    try:
        page = urllib.request.urlopen(server.url).read().decode()
        assert "/static/status.js" in page and "http" not in page.split("<body>")[1].split("<footer>")[0]
        assert b"function plot" in urllib.request.urlopen(server.url + "static/status.js").read()
        deadline = time.monotonic() + 10
        while json.loads(urllib.request.urlopen(server.url + "api/state").read())["reads"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert b'collabopt_peers{run_id="unit"} 1.0' in urllib.request.urlopen(server.url + "metrics").read()
        for path in ("static/../monitor.py", "static/nothing.js", "etc/passwd"):
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(server.url + path)
    finally:
        server.stop()


def test_serve_address_is_checked():
    assert parse_address("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_address("[::1]:0") == ("::1", 0)
    for bad in ("8080", "localhost", "host:port", ":80", "1.2.3.4:70000"):
        with pytest.raises(ConfigurationError, match="--serve"):
            parse_address(bad)


# ---------------------------------------------------------------------------------------------- reporting losses


class FakePeer:
    peer_id, client_mode, relayed = "P", False, False
    local_epoch, global_epoch, local_samples_per_second = 2, 2, 12.5

    def __init__(self):
        self.published: list = []
        self.event = threading.Event()

    def publish_metrics(self, record, expiration, may_wait=0.0):
        self.published.append(record)
        self.event.set()


def reporter() -> tuple[MetricsReporter, FakePeer]:
    copt = SimpleNamespace(config=SimpleNamespace(auxiliary=False), samples_reported=64, samples_skipped=0,
                           nonfinite_steps=0, target_batch_size=128,
                           last_round=RoundOutcome(False, "anchor differs", 2, 8.0, 3, resync=True, epoch=11))
    peer = FakePeer()
    return MetricsReporter(copt, peer, interval=3600), peer


def test_reported_losses_are_averaged_between_records():
    metrics, peer = reporter()
    try:
        assert peer.event.wait(10)  # the first record, at once
        assert peer.published[0]["loss"] is None and peer.published[0]["epoch"] == 2
        metrics.report_loss(torch.tensor(1.0))
        metrics.report_loss(torch.tensor([3.0]))
        metrics.report_loss(2.0)
        metrics.report_loss(torch.tensor(float("nan")))
        record = metrics.record()
        assert record["loss"] == pytest.approx(2.0) and record["nonfinite_losses"] == 1
        assert record["losses_reported"] == 4
        assert metrics.record()["loss"] == pytest.approx(2.0)  # nothing new: the last mean stays
        metrics.report_loss(float("inf"))
        assert metrics.record()["loss"] == pytest.approx(2.0) and metrics.record()["nonfinite_losses"] == 2
        run_records._record_models()["metrics"].parse_obj(metrics.record())  # what peers' validators accept
        assert record["last_round"] == "epoch 11: not applied, re-syncs: anchor differs (2 of 3)"
        with pytest.raises(ConfigurationError, match="report_loss"):
            metrics.report_loss(torch.ones(2))
        with pytest.raises(ConfigurationError, match="report_loss"):
            metrics.report_loss("low")
    finally:
        metrics.close()
    assert peer.published[-1] is None  # withdrawn on close
    assert not math.isnan(peer.published[0]["samples_per_second"])


def test_adapters_report_the_loss_they_see(monkeypatch):
    from accelerate.state import AcceleratorState
    from collabopt.integrations.accelerate import CollaborativeAccelerator
    from collabopt.integrations.lightning import CollaborativeStrategy, DDPStrategy

    reported = []
    recorder = SimpleNamespace(closed=False, report_loss=reported.append)
    try:
        accelerator = CollaborativeAccelerator(cpu=True, run_id="unit", target_batch_size=64)
        accelerator.collaborative_optimizer = recorder
        weight = torch.ones(2, requires_grad=True)
        loss = (weight * 3).sum()
        accelerator.backward(loss)
        assert reported == [loss] and weight.grad.tolist() == [3.0, 3.0]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

    strategy = CollaborativeStrategy(target_batch_size=64)
    strategy._copt = recorder
    monkeypatch.setattr(DDPStrategy, "training_step", lambda self, *a, **k: {"loss": torch.tensor(0.5)})
    strategy.training_step(torch.zeros(4, 2), 0)
    assert float(reported[-1]) == 0.5 and strategy._pending_samples == 4
