"""`collabopt doctor` without a swarm: argument handling, the report's format and verdicts, and the dial-back
protocol's dialing on real loopback sockets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collabopt import cli, doctor
from collabopt.doctor import Check, DoctorOptions, _incoming_check, _PeerResult
from collabopt.engine import dialback

ROOT = Path(__file__).resolve().parents[2]
PEER = "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWCxv9C3e6qv91uDww31w8bJovEcFDUJXA8UxqW1q6Z81H"


def run_cli(*args: str, env_peers: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "INITIAL_PEERS"}
    if env_peers is not None:
        env["INITIAL_PEERS"] = env_peers
    return subprocess.run([sys.executable, "-m", "collabopt", "doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_an_invalid_initial_peer_fails_with_its_fix_and_starts_nothing():
    proc = run_cli("--initial-peers", "/ip4/1.2.3/tcp/4", "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["ok"]
    failed = [c for c in report["checks"] if c["status"] == "FAIL"]
    assert [c["name"] for c in failed] == ["initial peer /ip4/1.2.3/tcp/4"]
    assert "not a valid multiaddr" in failed[0]["detail"] and "/p2p/" in failed[0]["fix"]
    # no network check ran: the only address was invalid
    assert {c["name"] for c in report["checks"]} == {"versions", "membership", "initial peer /ip4/1.2.3/tcp/4",
                                                      "incoming connections"}


def test_text_report_has_one_line_per_check_with_the_fix_below():
    proc = run_cli("--initial-peers", "/ip4/1.2.3.4/tcp/4")  # no /p2p/ part
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("collabopt doctor: checking this machine")
    assert lines[1].startswith("PASS     versions: python ") and "hivemind 1.1.12" in lines[1]
    assert lines[2].startswith("FAIL     initial peer /ip4/1.2.3.4/tcp/4: ") and "no /p2p/" in lines[2]
    assert lines[3].startswith("         fix: copy the address exactly")
    assert lines[-1] == "1 check failed"


def test_initial_peers_come_from_the_environment_and_a_bad_listen_address_stops_the_network_checks():
    proc = run_cli("--host-maddrs", "/ip4/0.0.0.0/tcp/x", "--json", env_peers=PEER)
    assert proc.returncode == 1
    checks = json.loads(proc.stdout)["checks"]
    assert [(c["name"], c["status"]) for c in checks] == [("versions", "PASS"), ("--host-maddrs", "FAIL"),
                                                          ("network", "SKIP"), ("membership", "PASS")]


def test_no_initial_peers_is_not_a_failure_but_says_what_is_unknown():
    proc = run_cli("--json")
    assert proc.returncode == 0, proc.stdout
    statuses = {c["name"]: c["status"] for c in json.loads(proc.stdout)["checks"]}
    assert statuses == {"versions": "PASS", "addresses": "PASS", "initial peers": "SKIP",
                        "incoming connections": "UNKNOWN", "membership": "PASS"}


def test_cli_hands_every_option_to_the_checks(monkeypatch, capsys):
    seen = {}

    async def fake_network_checks(peers, options):
        seen.update(peers=peers, options=options)
        return [Check("incoming connections", "FAIL", "not reachable", "client_mode=True")]

    monkeypatch.setattr(doctor, "_network_checks", fake_network_checks)
    monkeypatch.setenv("INITIAL_PEERS", "/ip4/1.1.1.1/tcp/1/p2p/ignored-when-the-option-is-given")
    monkeypatch.delenv("COLLABOPT_SWARM_KEY", raising=False)
    code = cli.main(["doctor", "--initial-peers", f"{PEER},{PEER}", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337",
                     "--announce-maddrs", "/ip4/203.0.113.5/tcp/31337", "--client-mode", "--use-auto-relay",
                     "--no-relay", "--timeout", "4"])
    assert code == 1
    assert seen["peers"] == [PEER, PEER]
    assert seen["options"] == DoctorOptions(initial_peers=[PEER, PEER], host_maddrs=["/ip4/0.0.0.0/tcp/31337"],
                                            announce_maddrs=["/ip4/203.0.113.5/tcp/31337"], client_mode=True,
                                            use_relay=False, use_auto_relay=True, timeout=4.0)
    out = capsys.readouterr().out
    assert "FAIL     incoming connections: not reachable\n         fix: client_mode=True\n" in out
    assert "PASS     membership: open swarm" in out and out.endswith("\n1 check failed\n")


def test_announcing_port_zero_is_refused():
    _peers, checks = doctor.check_addresses(DoctorOptions(initial_peers=[PEER],
                                                          announce_maddrs=["/ip4/203.0.113.5/tcp/0"]))
    assert [(c.name, c.status) for c in checks] == [("--announce-maddrs", "FAIL")]


def test_help_is_plain_text():
    proc = subprocess.run([sys.executable, "-m", "collabopt", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    assert "``" not in proc.stdout and "collabopt doctor --initial-peers" in proc.stdout


# ---- verdicts on incoming connections


def answered(*targets: tuple[str, bool], observed: str = "203.0.113.7:4001") -> _PeerResult:
    results = [dict(address=a, reachable=ok, error="" if ok else "Connection refused", seconds=None)
               for a, ok in targets]
    return _PeerResult(PEER, connect_s=0.01, ping_s=0.01, clock_offset=0.0,
                       dialback=dict(observed=observed, results=results, note=""))


LISTENING = ["/ip4/192.168.1.4/tcp/4001"]


def test_verdict_reachable():
    check = _incoming_check([answered(("203.0.113.7:4001", True))], ["/ip4/203.0.113.7/tcp/4001"], DoctorOptions())
    assert check.status == "PASS" and "full peer" in check.detail


def test_verdict_reachable_at_an_address_it_does_not_listen_on_says_to_announce_it():
    """A 1:1 NAT or a forwarded port: the initial peers reach 203.0.113.7:4001 while the machine listens on
    192.168.1.4:4001. libp2p dials from ephemeral ports, so it does not learn that address from its own connections:
    the peer announces it, else other peers find only its private address."""
    reached = [answered(("203.0.113.7:4001", True))]
    check = _incoming_check(reached, LISTENING, DoctorOptions())
    assert check.status == "WARN" and "does not listen on" in check.detail
    assert "--announce-maddrs /ip4/203.0.113.7/tcp/4001" in check.fix
    assert "announce_maddrs=['/ip4/203.0.113.7/tcp/4001']" in check.fix
    announced = _incoming_check(reached, LISTENING, DoctorOptions(announce_maddrs=["/ip4/203.0.113.7/tcp/4001"]))
    assert announced.status == "PASS" and "full peer" in announced.detail


def test_verdict_behind_nat_names_client_mode_and_relay():
    check = _incoming_check([answered(("203.0.113.7:4001", False))], LISTENING, DoctorOptions())
    assert check.status == "FAIL"
    assert "behind NAT" in check.detail and "not reachable from outside" in check.detail
    assert "client_mode=True" in check.fix and "relay_peers=" in check.fix


def test_verdict_client_mode_and_relay_make_it_acceptable():
    nat = [answered(("203.0.113.7:4001", False))]
    assert _incoming_check(nat, LISTENING, DoctorOptions(client_mode=True)).status == "PASS"
    assert _incoming_check(nat, LISTENING, DoctorOptions(use_auto_relay=True)).status == "WARN"


def test_verdict_unknown_without_a_dialback_peer():
    plain = _PeerResult(PEER, connect_s=0.01, ping_s=0.01, clock_offset=0.0, dialback_error="protocol not supported")
    check = _incoming_check([plain], LISTENING, DoctorOptions())
    assert check.status == "UNKNOWN" and "plain hivemind" in check.detail and "client_mode=True" in check.fix


def test_verdict_mixed_is_a_warning():
    check = _incoming_check([answered(("192.168.1.4:4001", True), observed="192.168.1.4:4001"),
                             answered(("203.0.113.7:4001", False))], LISTENING, DoctorOptions())
    assert check.status == "WARN" and "only some peers" in check.detail


def test_the_advice_names_the_examples_switch_and_the_scripts_option_for_each_way_in():
    """Each way in (client mode, a forwarded port, a relay) as the switch a user of the examples passes and the
    option of a script of one's own; client mode first, auto-relay nowhere (it finds no relay with hivemind 1.1.12)."""
    fix = _incoming_check([answered(("203.0.113.7:4001", False))], LISTENING, DoctorOptions()).fix
    for switch, option in (("--client-mode", "client_mode=True"), ("--port 31337", "host_maddrs="),
                           ("--announce-maddrs", "announce_maddrs="), ("--relay-peers", "relay_peers=")):
        assert switch in fix and option in fix, (switch, option, fix)
    assert fix.index("--client-mode") < fix.index("--port") < fix.index("--relay-peers")
    assert "auto_relay" not in fix and "auto-relay" not in fix
    auto = _incoming_check([answered(("203.0.113.7:4001", False))], LISTENING, DoctorOptions(use_auto_relay=True))
    assert "--client-mode" in auto.fix and "auto_relay" not in auto.fix


def test_every_switch_the_advice_names_is_one_the_examples_take_and_every_option_is_collabopts():
    import argparse
    import re

    from collabopt.config import option_names
    from collabopt.network_args import add_network_arguments

    advice = " ".join([doctor.RELAY_OR_CLIENT_FIX, doctor._connect_fix("connection refused")])
    switches = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", advice))
    assert {"--client-mode", "--port", "--announce-maddrs", "--relay-peers"} <= switches
    taken = {s for action in add_network_arguments(argparse.ArgumentParser())._actions for s in action.option_strings}
    assert switches <= taken, switches - taken
    options = set(re.findall(r"\b([a-z_]+)=", advice))
    assert options and options <= option_names(), options - option_names()


def test_a_peer_with_a_skewed_clock_fails():
    check = doctor._peer_check(_PeerResult(PEER, connect_s=0.01, ping_s=0.01, clock_offset=-7.5))
    assert check.status == "FAIL" and "-7.5 s" in check.detail and "clock" in check.fix


# ---- the dial-back side, on real loopback sockets


def test_dial_back_connects_to_listening_ports_of_the_observed_host_only():
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = server.sockets[0].getsockname()[1]
        probe = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        closed_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        try:
            return open_port, closed_port, await dialback.dial_back(
                "/ip4/127.0.0.1/tcp/55555",
                dict(ports=[open_port, closed_port], announce=[f"/ip4/198.51.100.1/tcp/{open_port}"]))
        finally:
            server.close()
            await server.wait_closed()

    open_port, closed_port, answer = asyncio.run(scenario())
    assert answer["observed"] == "127.0.0.1:55555"
    by_address = {r["address"]: r for r in answer["results"]}
    assert by_address[f"127.0.0.1:{open_port}"]["reachable"] is True
    assert by_address[f"127.0.0.1:{closed_port}"]["reachable"] is False
    assert by_address[f"127.0.0.1:{closed_port}"]["error"]
    assert len(by_address) == 2, "the announced address of another host must not be dialed"
    assert "not dialed" in answer["note"]


def test_dial_back_over_a_relay_dials_nothing():
    answer = asyncio.run(dialback.dial_back("/ip4/1.2.3.4/tcp/1/p2p/QmRelay/p2p-circuit", dict(ports=[1])))
    assert answer["results"] == [] and "relay" in answer["note"]


@pytest.mark.parametrize("request_bytes", [b"not json", json.dumps(dict(ports="x" * 100)).encode()])
def test_dial_back_handler_survives_garbage(request_bytes):
    class Info:
        addr = "/ip4/127.0.0.1/tcp/1"

    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data(len(request_bytes).to_bytes(4, "big") + request_bytes)
        reader.feed_eof()
        written = []

        class Writer:
            def write(self, data):
                written.append(data)

            async def drain(self):
                pass

            def close(self):
                written.append(b"<closed>")

        await doctor.serve_dialback(Info(), reader, Writer())
        return written

    written = asyncio.run(scenario())
    assert written[-1] == b"<closed>"


def test_report_verdict_counts_failures_then_warnings():
    assert doctor.format_report([Check("a", "WARN", "x", "y")]).splitlines()[-1] == "no check failed; 1 warning"
    lines = doctor.format_report([Check("a", "FAIL", "x", "y"), Check("b", "FAIL", "x", "y")]).splitlines()
    assert lines[-1] == "2 checks failed"


def test_a_tiny_negative_clock_difference_reads_as_zero():
    check = doctor._peer_check(_PeerResult(PEER, connect_s=0.01, ping_s=0.02, clock_offset=-0.01))
    assert check.detail == "connected in 10 ms, DHT ping 20 ms, clock difference +0.0 s"
