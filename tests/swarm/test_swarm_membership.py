"""Membership by a swarm key on a real swarm (issue 35, "Membership"): 3 members train with the key; an outsider
with the same run_id and initial peers, without a key and with a wrong one, fails at start with an error naming
swarm_key, can neither store records nor download the members' state, and `collabopt monitor` shows the 3 members
with the key and a clear error without it."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    ROOT,
    child_env,
    finish,
    finish_line,
    max_param_diff,
    read_params,
    read_result,
    start_peer,
    unique_run_id,
    wait_for_file,
)

from collabopt import processes
from harness import launcher

pytestmark = pytest.mark.swarm

MEMBERS = ("m0", "m1", "m2")


async def _connect(maddr: str, _dht, node) -> None:
    from collabopt.engine.p2p import connect

    await connect(node.p2p, maddr)


async def _download(handle: str, peer_id, _dht, node) -> int:
    """How many messages of its state the peer ``peer_id`` sends this node (0: it refused)."""
    from hivemind.proto import averaging_pb2

    stream = await node.p2p.iterate_protobuf_handler(peer_id, handle, averaging_pb2.DownloadRequest(),
                                                      averaging_pb2.DownloadData)
    return len([message async for message in stream])


def _within(seconds: float, condition) -> bool:
    """Whether ``condition()`` holds within ``seconds``, looked at again every 0.2 s."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _logged(proc, text: str) -> bool:
    return text in proc.log()


def _sends_state(node, handle: str, peer_id) -> bool:
    return node.run_coroutine(functools.partial(_download, handle, peer_id)) > 0


async def _store(key: str, peer_id, _dht, node) -> list[bool] | None:
    """A direct store of a record under ``key`` on ``peer_id``'s node; None where it refused."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import MSGPackSerializer, get_dht_time

    return await node.protocol.call_store(peer_id, [DHTID.generate(source=key)], [MSGPackSerializer.dumps(1e9)],
                                          get_dht_time() + 60)


def _monitor(run_id: str, initial_peers: str, *key_args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collabopt", "monitor", "--run-id", run_id, "--initial-peers",
                           initial_peers, "--count", "1", "--json", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                           *key_args], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)


def test_only_members_train_read_and_download(tmp_path, monkeypatch):
    import hivemind
    from hivemind.p2p import PeerID

    from collabopt import CollaborativeOptimizer, SwarmKeyError
    from collabopt.engine.member_checks import MEMBERS_RECORD
    from collabopt.membership import MemberToken, SwarmKey, new_swarm_key
    from collabopt.swarm import SwarmOptions, start_dht

    monkeypatch.delenv("COLLABOPT_SWARM_KEY", raising=False)
    text = new_swarm_key()
    key_file = tmp_path / "swarm.key"
    key_file.write_text(text + "\n")
    bootstrap, initial_peers = processes.start_bootstrap(tmp_path, dht_args=["--swarm-key-file", str(key_file)],
                                                         env=child_env(), cwd=ROOT, spawn=launcher.spawn)
    run_id = unique_run_id("members")
    procs, dhts = {}, []
    try:
        for name in MEMBERS:
            # members train on until the others and the gate, opened once the outsider was tried, are at the finish
            config = dict(run_id=run_id, target_batch_size=128, epochs=4, seed=MEMBERS.index(name), model_seed=0,
                          batch_sizes=[16], step_sleep=0.05, wait_peers=3, max_seconds=90,
                          finish_with=finish_line(tmp_path, "gate", *(other for other in MEMBERS if other != name)),
                          options=dict(swarm_key=text))
            procs[name] = start_peer(tmp_path, name, config, initial_peers)
        for name in MEMBERS:
            assert wait_for_file(tmp_path / f"{name}.start.pt", 90), procs[name].log()[-3000:]

        # collabopt monitor: the 3 members with the key (their records published as they train), an error without
        deadline, report = time.monotonic() + 30, {}
        while report.get("num_peers") != 3 and time.monotonic() < deadline:
            monitor = _monitor(run_id, initial_peers, "--swarm-key-file", str(key_file))
            assert monitor.returncode == 0, monitor.stderr[-3000:]
            report = json.loads(monitor.stdout.strip().splitlines()[-1])
        assert report["num_peers"] == 3, report
        refused = _monitor(run_id, initial_peers)
        assert refused.returncode == 1 and "admits members only" in refused.stderr, refused.stderr[-3000:]
        assert "swarm_key" in refused.stderr

        # the outsider, without a key and with a wrong one: refused before its first step, naming swarm_key
        model = torch.nn.Linear(16, 4)
        for swarm_key, says in ((None, "admits members only"), (new_swarm_key(), "refused this peer's swarm_key")):
            started = time.monotonic()
            with pytest.raises(SwarmKeyError, match=says) as refusal:
                CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), run_id=run_id,
                                       target_batch_size=128, initial_peers=initial_peers, swarm_key=swarm_key,
                                       host_maddrs=["/ip4/127.0.0.1/tcp/0"], print_join_message=False)
            assert "swarm_key" in str(refusal.value)
            assert time.monotonic() - started < 30, "the refusal took as long as a timeout"

        # a member (a key holder) in this process, and an outsider's DHT node that asks members directly
        member = start_dht(SwarmOptions(initial_peers=[initial_peers], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                        client_mode=True, swarm_key=SwarmKey(text)))
        dhts.append(member)
        outsider = hivemind.DHT(initial_peers=[initial_peers], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                                ensure_bootstrap_success=False)
        dhts.append(outsider)
        prefix = f"{run_id}_state_averager"
        servers = member.get(f"{prefix}.all_averagers", latest=True)
        assert servers is not None and len(servers.value) == 3, servers
        peers = [PeerID(subkey) for subkey in servers.value]
        handle = f"{prefix}::TrainingStateAverager.rpc_download_state"
        token = MemberToken.issue(SwarmKey(text), prefix, member.peer_id.to_bytes())
        assert member.store(MEMBERS_RECORD.format(prefix=prefix), token.to_bytes(), token.expires,
                            subkey=member.peer_id.to_bytes())
        # each member's address, as its join message printed it: the averaging services are open to anyone who can
        # connect, whatever the DHT's authorizer
        addresses, names = {}, {}
        for name in MEMBERS:
            for maddr in re.findall(r"INITIAL_PEERS=(\S+)", procs[name].log())[0].split(","):
                addresses[maddr.rsplit("/p2p/", 1)[1]] = maddr
                names[maddr.rsplit("/p2p/", 1)[1]] = name
        for peer in peers:
            for node in (outsider, member):
                node.run_coroutine(functools.partial(_connect, addresses[peer.to_base58()]))
            assert outsider.run_coroutine(functools.partial(_download, handle, peer)) == 0, "sent to an outsider"
            refused = f"refused to send this peer's state to {outsider.peer_id}"
            assert _within(10, functools.partial(_logged, procs[names[peer.to_base58()]], refused)), \
                "the outsider's download was not refused as an outsider's"
            # (a member ending an epoch declines any download for a moment, with the same empty answer: ask again)
            assert _within(30, functools.partial(_sends_state, member, handle, peer)), "refused to a member"
            assert outsider.run_coroutine(functools.partial(_store, f"{run_id}_progress", peer)) is None
        assert outsider.get(f"{run_id}_progress") is None
        assert all(proc.poll() is None for proc in procs.values()), "a member left before the outsider was tried"

        (tmp_path / "gate.progress").write_text(json.dumps(dict(epoch=10**6)))
        finish(procs, timeout=90)
    finally:
        for dht in dhts:
            dht.shutdown()
        for proc in procs.values():
            proc.kill_tree()
        bootstrap.kill_tree()

    results = {name: read_result(tmp_path, name) for name in MEMBERS}
    params = {name: read_params(tmp_path, name) for name in MEMBERS}
    final_epochs = {result["final_epoch"] for result in results.values()}
    assert len(final_epochs) == 1 and min(final_epochs) >= 4, results
    assert all(max_param_diff(params["m0"], params[name]) < 1e-6 for name in MEMBERS[1:])
    logs = "".join(procs[name].log() for name in MEMBERS)
    assert "is no member of the swarm" not in logs and "in matchmaking" not in logs, "a member refused a member"


async def _dialback_without_proof(maddr: str) -> dict:
    from collabopt.engine import p2p
    from collabopt.engine.dialback import DIALBACK_PROTOCOL, read_message, write_message

    daemon = await p2p.create_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        await p2p.connect(daemon, maddr)
        reader, writer = await p2p.open_stream(daemon, maddr, DIALBACK_PROTOCOL)
        await write_message(writer, json.dumps(dict(ports=[1])).encode())
        answer = json.loads(await read_message(reader, 65536))
        writer.close()
        return answer
    finally:
        await p2p.shutdown_p2p(daemon)


def test_doctor_is_a_member_with_the_key_only(monkeypatch):
    """`collabopt doctor` against a DHT with a swarm key: with the key every check passes (its ping and dial-back
    carry the key's proofs); without it, or with another, the initial peer fails with the key named; and a dial-back
    request without the key's proof is refused."""
    import asyncio

    from collabopt.doctor import DoctorOptions, run_checks
    from collabopt.membership import SwarmKey, new_swarm_key
    from collabopt.swarm import SwarmOptions, start_dht

    key = SwarmKey(new_swarm_key())
    dht = start_dht(SwarmOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], swarm_key=key))
    try:
        maddr = str(dht.get_visible_maddrs()[0])
        options = dict(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], timeout=5.0)
        checks = {c.name: c for c in run_checks(DoctorOptions(**options, swarm_key=key))}
        assert all(c.status == "PASS" for c in checks.values()), checks
        assert "members only" in checks["membership"].detail
        for other, says in ((None, "admits members only"), (SwarmKey(new_swarm_key()), "refused this machine's key")):
            checks = {c.name: c for c in run_checks(DoctorOptions(**options, swarm_key=other))}
            assert checks[f"initial peer {maddr}"].status == "FAIL" and says in checks[f"initial peer {maddr}"].detail
        assert "members only" in asyncio.run(_dialback_without_proof(maddr)).get("refused", "")
    finally:
        dht.shutdown()


def test_a_key_for_an_open_swarm_is_named():
    """A peer with a key, whose initial peer has none: hivemind's bootstrap fails (the open swarm's answers are not
    signed), and the error says the swarm is open."""
    from collabopt import SwarmKeyError
    from collabopt.membership import SwarmKey, new_swarm_key
    from collabopt.swarm import SwarmOptions, start_dht

    open_dht = start_dht(SwarmOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:
        started = time.monotonic()
        with pytest.raises(SwarmKeyError, match="has no key .an open swarm.: drop swarm_key"):
            start_dht(SwarmOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], swarm_key=SwarmKey(new_swarm_key()),
                                   initial_peers=[str(m) for m in open_dht.get_visible_maddrs()]))
        assert time.monotonic() - started < 30
    finally:
        open_dht.shutdown()
