"""relay_peers: the arguments a peer behind NAT hands to hivemind, and the p2pd flags they become (no network)."""

from __future__ import annotations

import asyncio

import hivemind
import pytest
from hivemind.p2p.p2p_daemon import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from collabopt import swarm
from collabopt.engine import compat
from collabopt.engine import p2p as engine_p2p

RELAY = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWJ7CitovXMdKJp8FY7EcxfuMcxBHcQotgYjYMNxQAiAkX"


def test_relay_options_reserve_on_the_relay_and_announce_the_circuit_address():
    options = swarm.relay_options([RELAY], announce_maddrs=["/ip4/198.51.100.7/tcp/4000"])
    assert options["trusted_relays"] == [RELAY] and options["use_auto_relay"] and options["use_relay"]
    assert options["force_reachability"] == "private"  # autorelay reserves only on a peer that is not reachable
    assert options["announce_maddrs"] == ["/ip4/198.51.100.7/tcp/4000", f"{RELAY}/p2p-circuit"]


def test_start_dht_passes_relay_options_and_p2pd_gets_static_relays(monkeypatch):
    started = {}

    class FakeDHT:
        def __init__(self, start: bool, **kwargs):
            started.update(kwargs)
            # what P2P.create builds for these arguments, while the DHT process would fork
            started["args"] = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=RELAY, relay=True,
                                                     b=True, bootstrapPeers=RELAY)
            started["args_without_relays"] = P2P._make_process_args("p2pd", autoRelay=True, relay=True, b=True,
                                                                    bootstrapPeers=RELAY)
            started["create"] = P2P.create

    monkeypatch.setattr(hivemind, "DHT", FakeDHT)
    swarm.start_dht(swarm.SwarmOptions(initial_peers=[RELAY], relay_peers=RELAY))
    assert started["trusted_relays"] == [RELAY] and started["announce_maddrs"] == [f"{RELAY}/p2p-circuit"]
    assert "-relayDiscovery=0" in started["args"]  # else autorelay waits for 4 candidates or 3 minutes
    assert not any(a.startswith("-relayDiscovery") for a in started["args_without_relays"])
    # p2pd's bootstrap would not count the relay it already reached: collabopt connects to the initial peers itself
    assert "-b=0" in started["args"] and not any(a.startswith("-bootstrapPeers") for a in started["args"])
    assert "-b=1" in started["args_without_relays"] and started["create"] != P2P.create
    # only while the DHT starts: hivemind's P2P is as it was afterwards
    assert not any(a.startswith("-relayDiscovery") for a in
                   P2P._make_process_args("p2pd", trustedRelays=RELAY))


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
