"""relay_peers: the arguments a peer behind NAT hands to hivemind, the p2pd flags they become, and the daemon collabopt
starts for them."""

from __future__ import annotations

import asyncio

import hivemind
import pytest
from hivemind.p2p.p2p_daemon import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from collabopt import swarm
from collabopt.engine import compat
from collabopt.engine import p2p as engine_p2p
from collabopt.errors import ConfigurationError

RELAY = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWJ7CitovXMdKJp8FY7EcxfuMcxBHcQotgYjYMNxQAiAkX"


def test_relay_options_reserve_on_the_relay_and_announce_the_circuit_address():
    options = swarm.relay_options([RELAY], announce_maddrs=["/ip4/198.51.100.7/tcp/4000"])
    assert options["trusted_relays"] == [RELAY] and options["use_auto_relay"] and options["use_relay"]
    assert options["force_reachability"] == "private"  # autorelay reserves only on a peer that is not reachable
    assert options["announce_maddrs"] == ["/ip4/198.51.100.7/tcp/4000", f"{RELAY}/p2p-circuit"]


def hivemind_flags(monkeypatch, **options) -> list[str]:
    """The flags hivemind's ``P2P.create`` starts p2pd with for ``options`` (captured; nothing starts)."""
    captured = []

    async def capture(*args, **kwargs):
        captured.extend(args)
        raise FileNotFoundError

    monkeypatch.setattr(asyncio.subprocess, "create_subprocess_exec", capture)
    with pytest.raises(P2PDaemonError):
        asyncio.run(P2P.create(**options))
    monkeypatch.undo()
    return captured[1:]


def test_the_relay_daemon_has_hivemind_flags_with_static_relays_and_no_bootstrap(monkeypatch):
    """A peer given relay_peers runs collabopt's own p2pd (docs/decisions.md, "Static relays"): the flags hivemind
    gives the same arguments, but -relayDiscovery=0 (else autorelay waits for 4 candidates or 3 minutes) and no
    p2pd bootstrap (it would not count the relay it already reached: collabopt connects to the initial peers)."""
    from collabopt.engine.relay_daemon import daemon_flags, split_options

    kwargs = dict(initial_peers=[RELAY], host_maddrs=["/ip4/0.0.0.0/tcp/0"], client_mode=True, wait_timeout=3.0,
                  identity_path=None, **swarm.relay_options([RELAY]))
    options, dht_kwargs = split_options(kwargs)
    assert set(dht_kwargs) == {"initial_peers", "client_mode", "wait_timeout"}  # (the DHT node's)
    ours = daemon_flags("/unix/tmp/x.sock", options, client_mode=True)
    theirs = hivemind_flags(monkeypatch, **options, initial_peers=[RELAY], dht_mode="client")

    def same(flags, *left_out):
        return sorted(f for f in flags if not f.startswith(("-listen=", *left_out)))

    assert same(ours, "-relayDiscovery=", "-b=") == same(theirs, "-b=", "-bootstrapPeers=")
    assert "-relayDiscovery=0" in ours and "-b=0" in ours and "-b=1" in theirs
    assert f"-trustedRelays={RELAY}" in ours and "-dhtClient=1" in ours and "-listen=/unix/tmp/x.sock" in ours
    with pytest.raises(ConfigurationError, match="use_ipfs"):  # (before any daemon starts)
        daemon_flags("/unix/tmp/x.sock", dict(options, use_ipfs=True), client_mode=False)


def test_a_relay_peers_dht_runs_on_its_own_daemon_which_ends_after_the_dht(tmp_path):
    """Two DHTs on loopback, the second reaching the first as its relay: its DHT runs on collabopt's daemon (with
    static relays) and stores a record the first reads; the daemon ends with the DHT (at once: p2pd's own idle check
    would take up to 30 s). An initial peer that does not answer fails the start as p2pd's bootstrap does, and leaves
    no daemon."""
    import time

    from hivemind.utils import get_dht_time

    from collabopt.engine import relay_daemon

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    relay = str(first.get_visible_maddrs()[0])
    try:
        second = swarm.start_dht(swarm.SwarmOptions(initial_peers=[relay], relay_peers=relay,
                                                    host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        daemon = relay_daemon._started[-1]
        try:
            assert "-relayDiscovery=0" in daemon.args and f"-trustedRelays={relay}" in daemon.args
            listen = next(a.split("=", 1)[1] for a in daemon.args if a.startswith("-listen="))
            assert str(second.run_coroutine(engine_p2p._daemon_listen_maddr)) == listen, "the DHT has another daemon"
            assert second.store("relayed", 7, get_dht_time() + 30)
            assert first.get("relayed", latest=True).value == 7
            assert daemon.poll() is None
        finally:
            second.shutdown()
        deadline = time.monotonic() + 5
        while daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.poll() is not None, "the relay peer's daemon outlived its DHT"

        silent = relay.replace(relay.split("/")[4], "1")  # (no one listens on port 1)
        with pytest.raises(swarm.SwarmConnectionError, match="none of the initial peers answered"):
            swarm.start_dht(swarm.SwarmOptions(initial_peers=[silent], relay_peers=silent,
                                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=2.0))
        assert not [process for process in relay_daemon._started if process.poll() is None]
    finally:
        first.shutdown()
@pytest.mark.parametrize("relay_peers", [RELAY, [RELAY], f"{RELAY},{RELAY}"])
def test_relay_peers_accepts_a_list_or_a_string(relay_peers):
    swarm.SwarmOptions(relay_peers=relay_peers).validate()
    assert swarm.peer_maddrs(relay_peers, "relay_peers")[0] == RELAY


def test_no_relay_peers_no_static_relays(monkeypatch):
    started = {}
    monkeypatch.setattr(hivemind, "DHT", lambda start, **kwargs: started.update(kwargs) or object())
    monkeypatch.setattr(engine_p2p, "_add_dialback_handler", lambda *a: None)
    swarm.start_dht(swarm.SwarmOptions(client_mode=True))
    assert "trusted_relays" not in started and "force_reachability" not in started


class FakeP2P:
    """A started p2p whose control client answers ``connect`` per peer id: True connects, False refuses, None hangs."""

    def __init__(self, answers: dict[str, bool | None]):
        self.answers, self.dialed, self.shut_down = answers, [], False
        self._client = self

    async def connect(self, peer_id, maddrs) -> None:
        self.dialed.append((peer_id.to_base58(), [str(m) for m in maddrs]))
        answer = self.answers[peer_id.to_base58()]
        if answer is None:
            await asyncio.sleep(3600)
        if not answer:
            raise ConnectionError("refused")

    async def shutdown(self) -> None:
        self.shut_down = True


OTHER = "/ip4/203.0.113.6/tcp/31337/p2p/12D3KooWPGsoMSdG5ZJxrLAQhLoEKfnZ1BUPdMh8naMCEeueHBmu"


def peer_id(maddr: str) -> str:
    return maddr.rsplit("/", 1)[1]


@pytest.mark.parametrize("relay_answer", [False, None])
def test_initial_peers_are_dialed_once_the_daemon_runs(relay_answer):
    p2p = FakeP2P({peer_id(RELAY): relay_answer, peer_id(OTHER): True})
    # one answer is enough: it returns without waiting for a peer that does not answer (timeout 60 s)
    connecting = engine_p2p._connect_initial_peers(p2p, [RELAY, compat.Multiaddr(OTHER)], timeout=60.0)
    asyncio.run(asyncio.wait_for(connecting, timeout=5.0))
    assert sorted(p2p.dialed) == sorted([(peer_id(RELAY), ["/ip4/203.0.113.5/tcp/31337"]),
                                         (peer_id(OTHER), ["/ip4/203.0.113.6/tcp/31337"])])
    assert not p2p.shut_down  # one answered: enough, as for p2pd's bootstrap


@pytest.mark.parametrize("answer", [False, None])
def test_no_initial_peer_answering_shuts_the_daemon_and_says_bootstrap(answer):
    p2p = FakeP2P({peer_id(RELAY): answer})
    with pytest.raises(P2PDaemonError, match="failed to connect to bootstrap peers"):
        asyncio.run(engine_p2p._connect_initial_peers(p2p, [RELAY], timeout=0.2))
    assert p2p.shut_down  # swarm.start_dht turns this message into "none of the initial peers answered"
