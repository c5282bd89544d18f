"""The swarm_key option (issue 35, section 1): where a key comes from, and a malformed one refused before any
network starts. What a key does on a swarm: tests/swarm/test_swarm_membership.py."""

from __future__ import annotations

import pytest
import torch

from collabopt import CollabConfig, CollaborativeOptimizer, ConfigurationError
from collabopt.cli import main
from collabopt.membership import SWARM_KEY_ENV, SwarmKey, new_swarm_key
from collabopt.swarm import MEMBERS_ONLY, OPEN_SWARM, join_message

MADDR = "/ip4/10.0.0.2/tcp/31337/p2p/QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4"


def test_a_malformed_key_is_refused_before_any_network_starts(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a DHT was started")

    monkeypatch.setattr("collabopt.swarm.p2p.start_dht", no_network)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in ("secret", new_swarm_key()[:30], 42):
        with pytest.raises(ConfigurationError, match="swarm_key.*collabopt keygen"):
            CollaborativeOptimizer(opt, run_id="r", target_batch_size=8, swarm_key=bad)


def test_the_key_is_parsed_once_and_never_shown():
    text = new_swarm_key()
    config = CollabConfig.from_options(run_id="r", target_batch_size=8, swarm_key=text)
    assert isinstance(config.swarm_key, SwarmKey)
    assert text not in repr(config) and text not in repr(config.swarm_options())


def test_the_environment_variable_is_the_default_and_checked(monkeypatch):
    config = CollabConfig.from_options(run_id="r", target_batch_size=8)
    monkeypatch.delenv(SWARM_KEY_ENV, raising=False)
    assert config.swarm_options().swarm_key is None
    monkeypatch.setenv(SWARM_KEY_ENV, new_swarm_key())
    assert isinstance(config.swarm_options().swarm_key, SwarmKey)
    monkeypatch.setenv(SWARM_KEY_ENV, "not a key")
    with pytest.raises(ConfigurationError, match=SWARM_KEY_ENV):
        config.swarm_options()


def test_a_key_and_a_dht_of_your_own_are_refused_together(monkeypatch):
    from collabopt.config import check_dht

    monkeypatch.setattr("collabopt.engine.compat.is_dht", lambda dht: True)
    config = CollabConfig.from_options(run_id="r", target_batch_size=8, swarm_key=new_swarm_key())
    with pytest.raises(ConfigurationError, match="swarm_key"):
        check_dht(object(), config)


def test_keygen_prints_a_key_every_peer_can_parse(capsys):
    assert main(["keygen"]) == 0
    SwarmKey(capsys.readouterr().out)


def test_a_bad_key_file_is_refused_with_its_name(tmp_path, capsys):
    path = tmp_path / "swarm.key"
    path.write_text("not a key\n")
    assert main(["monitor", "--run-id", "r", "--initial-peers", MADDR, "--swarm-key-file", str(path)]) == 2
    assert f"--swarm-key-file {path}" in capsys.readouterr().err
    assert main(["dht", "--swarm-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_the_join_message_says_whether_the_swarm_is_open():
    assert OPEN_SWARM in join_message([MADDR], "r", command="python t.py")
    assert MEMBERS_ONLY in join_message([MADDR], "r", command="python t.py", members_only=True)
    assert OPEN_SWARM not in join_message([MADDR], "r", command="python t.py", members_only=True)


def test_every_adapter_and_the_node_accept_the_key():
    from collabopt.config import option_names

    assert "swarm_key" in option_names()  # (the names NodeOptimizer, accelerate, transformers and pytorch pass on)
    try:
        from collabopt.integrations._lightning_options import accepted_option_names
    except ImportError:  # (Lightning not installed)
        return
    assert "swarm_key" in accepted_option_names()
