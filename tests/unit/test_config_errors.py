"""Bad input is refused with a clear error naming the parameter and the fix, before any network starts."""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
from collabopt.integrations.pytorch import collaborate
from hivemind.compression import Float16Compression

import collabopt.optimizer as optimizer_module
import collabopt.swarm as swarm_module
from collabopt import CollabConfig, CollaborativeOptimizer, ConfigurationError
from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.errors import DROP, apply_fix

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWJ7CitovXMdKJp8FY7EcxfuMcxBHcQotgYjYMNxQAiAkX"


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to start a DHT fails the test: errors must come first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a DHT was started although the configuration is invalid")

    monkeypatch.setattr(swarm_module, "start_dht", forbidden)
    monkeypatch.setattr(optimizer_module, "HivemindPeer", forbidden)
    monkeypatch.delenv("INITIAL_PEERS", raising=False)


def model_and_opt():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def other_scheduler(_opt):
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.StepLR(other, step_size=1)


def foreign_plateau(_opt):
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.ReduceLROnPlateau(other)


def frozen_optimizer(_opt):
    p = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    return torch.optim.SGD([p], lr=0.1)


# (case id, keyword overrides or a callable(opt) -> overrides, parameter named in the message, text in the message)
CASES = [
    ("bad multiaddr", dict(initial_peers=["/ip4/1.2.3/tcp/5/p2p/Qm"]), "initial_peers", "not a valid multiaddr"),
    ("not a multiaddr", dict(initial_peers="localhost:31337"), "initial_peers", "not a valid multiaddr"),
    ("missing peer id", dict(initial_peers=["/ip4/127.0.0.1/tcp/31337"]), "initial_peers", "/p2p/"),
    ("peers not strings", dict(initial_peers=[31337]), "initial_peers", "expected multiaddr strings"),
    ("peers wrong type", dict(initial_peers=31337), "initial_peers", "comma-separated string"),
    ("bad host_maddrs", dict(host_maddrs=["0.0.0.0:31337"]), "host_maddrs", "not a valid multiaddr"),
    ("target_batch_size zero", dict(target_batch_size=0), "target_batch_size", "positive integer"),
    ("target_batch_size negative", dict(target_batch_size=-5), "target_batch_size", "positive integer"),
    ("target_batch_size float", dict(target_batch_size=10.5), "target_batch_size", "positive integer"),
    ("batch_size zero", dict(batch_size=0), "batch_size", "positive integer"),
    ("empty run_id", dict(run_id=""), "run_id", "letters, digits"),
    ("run_id with spaces", dict(run_id="my run"), "run_id", "letters, digits"),
    ("scheduler of another optimizer", lambda opt: dict(scheduler=other_scheduler(opt)), "scheduler",
     "different optimizer"),
    ("plateau of another optimizer", lambda opt: dict(scheduler=foreign_plateau(opt)), "scheduler",
     "different optimizer"),
    ("scheduler_fn not callable", dict(scheduler_fn=5), "scheduler_fn", "callable"),
    ("scheduler not a scheduler", dict(scheduler="cosine"), "scheduler", "expected a torch LR scheduler"),
    ("scheduler and scheduler_fn", lambda opt: dict(
        scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
        scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)), "scheduler", "only one"),
    ("scheduler_fn is an instance", lambda opt: dict(scheduler_fn=torch.optim.lr_scheduler.StepLR(opt, 1)),
     "scheduler_fn", "callable"),
    ("delay_grad_averaging alone", dict(delay_grad_averaging=True, offload_optimizer=True, delay_state_averaging=True),
     "delay_grad_averaging",
     "delay_optimizer_step=True"),
    ("delay_optimizer_step without offload", dict(delay_optimizer_step=True), "delay_optimizer_step",
     "offload_optimizer=True"),
    ("delay_optimizer_step without delayed state averaging", dict(delay_optimizer_step=True, offload_optimizer=True),
     "delay_optimizer_step", "delay_state_averaging=True"),
    ("reuse with local updates", dict(reuse_grad_buffers=True, use_local_updates=True), "reuse_grad_buffers",
     "use_local_updates"),
    ("client auxiliary", dict(client_mode=True, auxiliary=True), "auxiliary", "client-mode"),
    ("relay without peer id", dict(relay_peers="/ip4/127.0.0.1/tcp/31337"), "relay_peers", "no /p2p/"),
    ("relay empty", dict(relay_peers=[]), "relay_peers", "is empty"),
    ("relay in client mode", dict(relay_peers=[PEER], client_mode=True), "client_mode", "relay_peers"),
    ("relay without use_relay", dict(relay_peers=[PEER], use_relay=False), "use_relay", "relay_peers"),
    ("matchmaking_time zero", dict(matchmaking_time=0), "matchmaking_time", "positive number"),
    ("averaging_timeout negative", dict(averaging_timeout=-1.0), "averaging_timeout", "positive number"),
    ("average_state_every zero", dict(average_state_every=0), "average_state_every", "positive integer"),
    ("unknown option", dict(matchmaking_tmie=5.0), "matchmaking_tmie", "not an argument"),
    ("managed option", dict(batch_size_per_step=32), "batch_size_per_step", "not an argument"),
    ("bad compression", dict(grad_compression="fp16"), "grad_compression", "hivemind compression"),
    ("dht of wrong type", dict(dht="127.0.0.1"), "dht", "hivemind.DHT"),
    ("model not a module", dict(model=lambda x: x), "model", "torch.nn.Module"),
    ("wait_timeout zero", dict(wait_timeout=0), "wait_timeout", "positive number"),
    ("optimizer without trainable params", lambda opt: dict(optimizer=frozen_optimizer(opt)), "optimizer",
     "requires grad"),
    ("optimizer is not an optimizer", dict(optimizer="adam"), "optimizer", "torch.optim.Optimizer"),
    ("averager_opts not a dict", dict(averager_opts=[("request_timeout", 1.0)]), "averager_opts", "expected a dict"),
    ("LBFGS offloaded", lambda opt: dict(
        optimizer=torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters()), offload_optimizer=True), "optimizer",
     "LBFGS"),
]


@pytest.mark.parametrize("case, overrides, parameter, text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_any_network(no_network, case, overrides, parameter, text):
    model, opt = model_and_opt()
    if callable(overrides):
        overrides = overrides(opt)
    kwargs = dict(run_id="errors", target_batch_size=64, model=model)
    kwargs.update(overrides)
    optimizer = kwargs.pop("optimizer", opt)
    with pytest.raises(ConfigurationError) as info:
        CollaborativeOptimizer(optimizer, **kwargs)
    message = str(info.value)
    assert info.value.parameter.startswith(parameter), message
    assert text in message, message
    assert "Fix:" in message


@pytest.mark.parametrize("options, expected", [
    (dict(matchmaking_time=2.0), 1.0),  # hivemind's 3 s would be >= matchmaking_time: it warns of deadlocks
    (dict(matchmaking_time=2.0, averager_opts=dict(request_timeout=0.5, min_group_size=2)), 0.5),
    (dict(matchmaking_time=10.0), None),  # hivemind's default is fine
])
def test_join_request_timeout_stays_below_matchmaking_time(options, expected):
    arguments = CollabConfig.from_options(run_id="timeouts", target_batch_size=64, **options).hivemind_arguments()
    assert (arguments.get("averager_opts") or {}).get("request_timeout") == expected
    factory = arguments["grad_averager_factory"]  # hivemind hands averager_opts to its state averager only
    assert factory.keywords.get("request_timeout") == expected
    # collabopt's gradient rounds whatever the matchmaking time (collabopt.engine.gradient_rounds)
    assert factory.func is GradientRounds
    if "averager_opts" in options:
        assert arguments["averager_opts"]["min_group_size"] == 2  # the user's other options are kept


def test_bad_initial_peers_env_names_the_variable(no_network, monkeypatch):
    monkeypatch.setenv("INITIAL_PEERS", "/ip4/127.0.0.1/tcp/31337")
    model, opt = model_and_opt()
    with pytest.raises(ConfigurationError, match="INITIAL_PEERS environment variable"):
        CollaborativeOptimizer(opt, run_id="errors", target_batch_size=64)


def test_dht_with_swarm_options_conflict(no_network):
    import hivemind

    model, opt = model_and_opt()
    fake_dht = hivemind.DHT.__new__(hivemind.DHT)  # never started: only its type matters here
    fake_dht._parent_pid = -1  # so that its __del__ does not try to shut it down
    with pytest.raises(ConfigurationError, match="together with a dht you own"):
        CollaborativeOptimizer(opt, run_id="errors", target_batch_size=64, dht=fake_dht, initial_peers=[PEER])


def test_plain_adapter_refuses_foreign_optimizer_and_bad_scaler(no_network):
    model, _ = model_and_opt()
    foreign = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="none of the model's parameters"):
        collaborate(model, foreign, run_id="errors", target_batch_size=64)
    _, opt = model_and_opt()
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="GradScaler"):
        collaborate(model2, opt2, run_id="errors", target_batch_size=64, scaler=object())


@pytest.mark.parametrize("width, options, expected", [
    (8, {}, 5.0),  # a small model keeps hivemind's default, matchmaking_time
    (1000, dict(averaging_timeout=120.0), 2 * 1000 * 1001 * 4 / 1.25e6),  # 4 MB: what 10 Mbit/s moves both ways
    (3000, {}, 10.0),  # 36 MB: at most a third of averaging_timeout (30 s)
    (1000, dict(next_chunk_timeout=4.0), 4.0),  # the user's choice is kept
    (1000, dict(averager_opts=dict(reducer_timeout=4.0)), None),  # hivemind's default: its timeouts must agree
])
def test_next_chunk_timeout_grows_with_the_tensors(monkeypatch, width, options, expected):
    seen = {}

    class Captured(Exception):
        pass

    def capture(_dht, arguments, *_):
        seen.update(arguments)
        raise Captured

    monkeypatch.setattr(swarm_module, "start_dht", lambda *args, **kwargs: object())
    monkeypatch.setattr(optimizer_module, "HivemindPeer", capture)
    model = torch.nn.Linear(width, width)
    with pytest.raises(Captured):
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), run_id="chunks", target_batch_size=64,
                               **options)
    assert seen.get("next_chunk_timeout") == pytest.approx(expected)


# ---------------------------------------------------------------------- every suggested fix leads to a valid config

FIX_BASE = dict(run_id="fixes", target_batch_size=64)
MODE_FLAGS = ("reuse_grad_buffers", "offload_optimizer", "delay_optimizer_step", "delay_grad_averaging",
              "delay_state_averaging", "use_local_updates", "auxiliary", "client_mode")


def refused_then_fixed(options: dict) -> ConfigurationError | None:
    """Build a config from ``options``; when refused, apply each fix the error gives (as data, not read from its
    words) and build again: each must be accepted. Returns the error (None if ``options`` were accepted)."""
    try:
        CollabConfig.from_options(**options)
        return None
    except ConfigurationError as error:
        assert error.fixes, f"{error} gives no fix as data"
        for fix in error.fixes:
            fixed = apply_fix(options, fix)
            try:
                CollabConfig.from_options(**fixed)
            except ConfigurationError as second:
                raise AssertionError(f"{options}: the fix {fix} of '{error}' leads to '{second}'") from None
            for name in fix:  # the words say what the data does
                assert name in str(error), (name, str(error))
        return error


def test_the_suggested_fix_for_delayed_gradient_averaging_is_complete():
    error = refused_then_fixed(dict(FIX_BASE, delay_grad_averaging=True))
    assert error.parameter == "delay_grad_averaging"
    assert error.fixes[0] == dict(delay_optimizer_step=True, offload_optimizer=True, delay_state_averaging=True)
    assert "delay_state_averaging=True" in error.fix


@pytest.mark.parametrize("diloco", [False, True], ids=["synchronous", "diloco"])
@pytest.mark.parametrize("batch_size", [None, 32])
def test_every_fix_of_every_combination_of_modes_is_accepted(diloco, batch_size):
    """All 256 combinations of hivemind's modes (with and without DiLoCo, with and without batch_size): whatever
    error a combination gets, each of its fixes, applied as given, builds a config."""
    refused = 0
    for bits in itertools.product((False, True), repeat=len(MODE_FLAGS)):
        options = dict(FIX_BASE, **{name: True for name, on in zip(MODE_FLAGS, bits, strict=True) if on})
        if diloco:
            options["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=0.7)
        if batch_size is not None:
            options["batch_size"] = batch_size
        refused += refused_then_fixed(options) is not None
    assert refused > 200  # (most combinations are refused: the loop did check fixes)


FIX_CASES = [
    ("unknown option", dict(matchmaking_tmie=2.0)),
    ("unknown option, nothing close", dict(zzz_unknown=1)),
    ("missing run_id", dict(run_id=None)),
    ("missing target_batch_size", dict(target_batch_size=None)),
    ("bad run_id", dict(run_id="my run")),
    ("zero matchmaking_time", dict(matchmaking_time=0)),
    ("batch_size zero", dict(batch_size=0)),
    ("batch_size zero on an auxiliary", dict(batch_size=0, auxiliary=True)),
    ("auxiliary without a target", dict(target_batch_size=0, auxiliary=True, client_mode=True)),
    ("bad node_timeout", dict(node_timeout=-1)),
    ("bad average_state_every", dict(average_state_every=0)),
    ("overlap without DiLoCo", dict(overlap_rounds=True)),
    ("overlap without DiLoCo, delayed modes", dict(overlap_rounds=True, delay_grad_averaging=True)),
    ("bad outer optimizer", dict(outer_optimizer=0.7)),
    ("DiLoCo with a gradient averager", dict(outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7),
                                             grad_averager_factory=object, offload_optimizer=True)),
    ("bad compression", dict(grad_compression="fp16")),
    ("bad compression, robust", dict(state_averaging_compression="fp16", aggregation="centered_clip")),
    ("averager_opts not a dict", dict(averager_opts=[("request_timeout", 1.0)])),
    ("local updates with an averager factory", dict(use_local_updates=True, grad_averager_factory=object)),
    ("bad aggregation", dict(aggregation="median")),
    ("robust with an averager factory", dict(aggregation="centered_clip", grad_averager_factory=object)),
    ("robust with lossy downloads", dict(aggregation="centered_clip", load_state_compression=Float16Compression())),
    ("robust with lossy parameter rounds", dict(aggregation="centered_clip",
                                                state_averaging_compression=Float16Compression())),
    ("robust with lossy gradients between parameter rounds", dict(
        aggregation="centered_clip", grad_compression=Float16Compression(), average_state_every=4)),
    # the DHT's options (collabopt/swarm.py, collabopt/membership.py)
    ("host address as IP:PORT", dict(host_maddrs=["0.0.0.0:31337"])),
    ("bad announce address", dict(announce_maddrs=["/ip4/203.0.113.5/tcp/1", "somewhere"])),
    ("empty relay list", dict(relay_peers=[])),
    ("relay in client mode", dict(relay_peers=[PEER], client_mode=True)),
    ("relay without use_relay", dict(relay_peers=[PEER], use_relay=False)),
    ("identity_path not a path", dict(identity_path=5)),
    ("zero wait_timeout", dict(wait_timeout=0)),
    ("negative bootstrap_timeout", dict(bootstrap_timeout=-1)),
]


@pytest.mark.parametrize("case, overrides", FIX_CASES, ids=[c[0] for c in FIX_CASES])
def test_each_suggested_fix_builds_the_config(case, overrides):
    options = {name: value for name, value in dict(FIX_BASE, **overrides).items() if value is not None}
    assert refused_then_fixed(options) is not None, "these options were accepted"


def test_an_unknown_option_gets_the_closest_names_and_the_options_page_not_every_name():
    with pytest.raises(ConfigurationError) as info:
        CollabConfig.from_options(run_id="cfg", target_batch_size=64, matchmaking_tmie=2.0)
    assert "did you mean matchmaking_time?" in info.value.fix and "docs/options.md" in info.value.fix
    assert "averaging_timeout" not in str(info.value) and len(str(info.value)) < 200
    assert info.value.fixes[0] == {"matchmaking_tmie": DROP, "matchmaking_time": 2.0}


# ---------------------------------------------------------------------- one name for the scaler: scaler=


def test_scaler_is_the_name_everywhere_and_grad_scaler_still_works_with_one_warning():
    from fakes import FakePeer

    from collabopt.node import NodeOptimizer

    model, opt = model_and_opt()
    scaler = torch.amp.GradScaler("cpu")

    def build(entry, **kwargs):
        options = dict(run_id="scaler", target_batch_size=64, peer=FakePeer(opt, 64), handle_signals=False, **kwargs)
        if entry == "collaborate":
            return collaborate(model, opt, **options)
        return CollaborativeOptimizer(opt, model=model, **options)

    for entry in ("core", "collaborate"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copt = build(entry, grad_scaler=scaler)
        deprecated = [w for w in caught if w.category is DeprecationWarning and "grad_scaler" in str(w.message)]
        assert len(deprecated) == 1, [str(w.message) for w in caught]
        assert deprecated[0].filename == __file__ and "scaler=" in str(deprecated[0].message)  # the caller's line
        assert copt.scaler is scaler
        copt.close()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*grad_scaler", category=DeprecationWarning)
            copt = build(entry, scaler=scaler)
        assert copt.scaler is scaler
        copt.close()
        with pytest.raises(ConfigurationError, match="scaler, grad_scaler: are the same argument") as info:
            build(entry, scaler=scaler, grad_scaler=scaler)
        assert info.value.fixes == [{"grad_scaler": DROP}]
    # the node (every rank): the same names, checked before torch.distributed is needed
    with pytest.raises(ConfigurationError, match="same argument"):
        NodeOptimizer(opt, model=model, run_id="scaler", target_batch_size=64, scaler=scaler, grad_scaler=scaler)
    with pytest.warns(DeprecationWarning, match="NodeOptimizer\\(grad_scaler="), \
            pytest.raises(ConfigurationError, match="init_process_group"):
        NodeOptimizer(opt, model=model, run_id="scaler", target_batch_size=64, grad_scaler=scaler)


# ---------------------------------------------------------------------- the DHT's options: fixes, or what to do next


def test_an_ip_and_port_is_written_as_the_multiaddr_to_pass():
    error = refused_then_fixed(dict(FIX_BASE, host_maddrs=["0.0.0.0:31337"]))
    assert error.fixes[0] == {"host_maddrs": ["/ip4/0.0.0.0/tcp/31337"]}
    assert "host_maddrs=['/ip4/0.0.0.0/tcp/31337']" in error.fix
    error = refused_then_fixed(dict(FIX_BASE, announce_maddrs=["/ip4/203.0.113.5/tcp/4001", "[::1]:4001"]))
    assert error.fixes[0] == {"announce_maddrs": ["/ip4/203.0.113.5/tcp/4001", "/ip6/::1/tcp/4001"]}


def test_a_key_files_path_given_as_the_key_gets_the_key_it_holds(tmp_path, monkeypatch):
    from collabopt.membership import new_swarm_key, swarm_key_from

    key_file = tmp_path / "swarm.key"
    key_file.write_text(new_swarm_key() + "\n")
    error = refused_then_fixed(dict(FIX_BASE, swarm_key=str(key_file)))
    assert error.parameter == "swarm_key" and "names a file" in error.problem
    assert key_file.read_text().strip() not in str(error) and repr(error.fixes[0]["swarm_key"]) == "SwarmKey(<hidden>)"
    monkeypatch.setenv("COLLABOPT_SWARM_KEY", str(key_file))
    with pytest.raises(ConfigurationError) as info:
        swarm_key_from(None)
    assert f'COLLABOPT_SWARM_KEY="$(cat {key_file})"' in info.value.fix and not info.value.fixes


@pytest.mark.parametrize("options", [dict(initial_peers=["localhost:31337"]), dict(initial_peers=[31337]),
                                     dict(relay_peers=["/ip4/203.0.113.5/tcp/31337"]), dict(swarm_key="short")],
                         ids=["address", "not a string", "relay without peer id", "not a key"])
def test_a_value_no_fix_can_guess_says_where_to_copy_it_from(options):
    """A peer's address or the swarm's key cannot be made up: no fix as data, and the words say where it is."""
    with pytest.raises(ConfigurationError) as info:
        CollabConfig.from_options(**FIX_BASE, **options)
    assert not info.value.fixes
    assert "collabopt keygen" in info.value.fix or "join line" in info.value.fix, info.value.fix
