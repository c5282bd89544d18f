"""`collabopt doctor` in network namespaces: behind NAT (a masquerading router: it connects out, nothing connects in)
it must say the machine is not reachable from outside and what to pass; on a public address it passes."""

from __future__ import annotations

import json
import sys

from helpers import Process, start_bootstrap

from harness.testnet import TestNet

PUBLIC, NATTED = 0, 1


def run_doctor(tmp_path, net: TestNet, peer: int, initial_peers: str, *extra: str) -> tuple[int, dict[str, dict]]:
    """Run `collabopt doctor --json` (listening on all interfaces, as a newcomer would) in peer ``peer``'s namespace;
    its exit status and checks by name."""
    name = f"doctor{peer}{''.join(extra).replace('-', '')}"
    proc = Process([sys.executable, "-m", "collabopt", "doctor", "--initial-peers", initial_peers, "--json", *extra],
                   tmp_path / f"{name}.log", netns=net.peers[peer])
    try:
        code = proc.wait(120)
    finally:
        proc.kill_tree()
    assert code is not None, f"the doctor did not finish:\n{proc.tail()}"
    reports = [line for line in proc.log().splitlines() if line.startswith('{"ok"')]
    assert reports, proc.tail()
    return code, {check["name"]: check for check in json.loads(reports[-1])["checks"]}


def test_doctor_says_a_machine_behind_nat_is_not_reachable_and_what_to_pass(tmp_path, make_net):
    net = make_net(2, nat=[NATTED])
    bootstrap, initial_peers = start_bootstrap(tmp_path, host=net.bootstrap_addr, netns=net.bootstrap)
    try:
        nat_code, nat = run_doctor(tmp_path, net, NATTED, initial_peers)
        client_code, client = run_doctor(tmp_path, net, NATTED, initial_peers, "--client-mode")
        public_code, public = run_doctor(tmp_path, net, PUBLIC, initial_peers)
    finally:
        bootstrap.kill_tree()

    # behind NAT: the bootstrap is reached (the connection goes out), but nothing can connect in
    assert nat[f"initial peer {initial_peers}"]["status"] == "PASS", nat
    incoming = nat["incoming connections"]
    assert nat_code == 1 and incoming["status"] == "FAIL", nat
    assert f"seen as {net.public_addr[NATTED]}:" in incoming["detail"], incoming  # the router's address
    assert "behind NAT" in incoming["detail"] and "not reachable from outside" in incoming["detail"], incoming
    assert "client_mode=True" in incoming["fix"] and "relay_peers=" in incoming["fix"], incoming

    # the same machine, planning to join in client mode: nothing to fix
    assert client_code == 0 and client["incoming connections"]["status"] == "PASS", client
    assert "fine with client_mode=True" in client["incoming connections"]["detail"]

    # a public peer namespace: the bootstrap connects back to it
    assert public_code == 0 and all(c["status"] == "PASS" for c in public.values()), public
    assert f"connected back to {net.public_addr[PUBLIC]}:" in public["incoming connections"]["detail"], public
