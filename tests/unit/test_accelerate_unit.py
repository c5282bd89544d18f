"""Accelerate adapter and node: what is refused before any network starts, and the 2-line diff of the example."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from collabopt.integrations.accelerate import CollaborativeAccelerator

from collabopt import ConfigurationError, Terminated
from collabopt.interface import SNAPSHOT_FIELDS, SwarmOptimizerBase, swarm_metrics, swarm_snapshot
from collabopt.node import NodeOptimizer, collaborative_optimizer, is_node_job

ROOT = Path(__file__).resolve().parents[2]
SWARM = dict(run_id="unit_accelerate", target_batch_size=64)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(deepspeed_plugin=object()), ["deepspeed_plugin", "DeepSpeed"]),
        (dict(fsdp_plugin=object()), ["fsdp_plugin", "FSDP"]),
        (dict(megatron_lm_plugin=object()), ["megatron_lm_plugin", "Megatron-LM"]),
        (dict(scheduler=object()), ["scheduler", "prepare"]),
        (dict(model=torch.nn.Linear(2, 2)), ["model", "prepare"]),
        (dict(scaler=object()), ["scaler", "prepare"]),
        (dict(grad_scaler=object()), ["grad_scaler", "prepare"]),
        (dict(learning_rate=0.1), ["learning_rate", "spelling"]),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs, names):
    with pytest.raises(ConfigurationError) as info:
        CollaborativeAccelerator(cpu=True, **SWARM, **kwargs)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("kind", [DistributedType.XLA, DistributedType.DEEPSPEED, DistributedType.FSDP,
                                  DistributedType.MEGATRON_LM])
def test_sharding_or_xla_launch_configs_are_refused(monkeypatch, kind):
    """An `accelerate config` choosing these (environment, not arguments) is refused too."""
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: kind))
    with pytest.raises(ConfigurationError, match="not supported by collabopt"):
        CollaborativeAccelerator(cpu=True, **SWARM)


def test_prepare_refuses_two_optimizers_and_a_lone_scheduler():
    accelerator = CollaborativeAccelerator(cpu=True, **SWARM)
    model = torch.nn.Linear(2, 2)
    opt_a, opt_b = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="one optimizer"):
        accelerator.prepare(model, opt_a, opt_b)
    with pytest.raises(ConfigurationError, match="without its optimizer"):
        accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt_a, 1))
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="different optimizer"):
        accelerator.prepare(model, opt_a, torch.optim.lr_scheduler.StepLR(other, 1))
    assert accelerator.collaborative_optimizer is None  # nothing joined a swarm


def test_log_adds_the_swarm_metrics_under_the_names_every_adapter_logs(monkeypatch):
    logged = []
    monkeypatch.setattr(Accelerator, "log", lambda self, values, step=None, log_kwargs=None: logged.append(values))
    accelerator = CollaborativeAccelerator(cpu=True, **SWARM)
    accelerator.log({"loss": 1.0})
    assert logged[-1] == {"loss": 1.0}  # before prepare: no swarm
    fake = SimpleNamespace(closed=False, get_lr=lambda: [0.1], **dict(dict.fromkeys(SNAPSHOT_FIELDS, 0),
                                                                          num_peers=2, local_epoch=3))
    fake.metrics = lambda: swarm_snapshot(fake)
    accelerator.collaborative_optimizer = fake
    accelerator.log({"loss": 0.5})
    assert logged[-1]["swarm/num_peers"] == 2.0 and logged[-1]["swarm/local_epoch"] == 3.0
    assert logged[-1] == {**swarm_metrics(fake), "loss": 0.5} and "swarm/samples_per_second" in logged[-1]


class EndingCore(SwarmOptimizerBase):
    """A core that records the end of a run; its serve_final_state raises ``fails`` where given."""

    def __init__(self, calls: list, fails: type[BaseException] | None = None):
        self._closed, self.calls, self.fails = False, calls, fails

    def serve_final_state(self, timeout=None) -> str:
        self.calls.append("serve_final_state")
        if self.fails is not None:
            raise self.fails()
        return "no live peer is behind epoch 3"

    def close(self) -> None:
        self.calls.append("close")
        self._closed = True


@pytest.mark.parametrize("raised", [None, KeyboardInterrupt, ValueError])
def test_end_training_serves_the_final_state_unless_an_exception_propagates(monkeypatch, raised):
    """end_training() after the loop serves the final state for peers still behind, then leaves; called from a
    finally while an error or Ctrl+C propagates, it only leaves. Accelerate's own end_training runs last."""
    calls = []
    monkeypatch.setattr(Accelerator, "end_training", lambda self: calls.append("Accelerator.end_training"))
    accelerator = CollaborativeAccelerator(cpu=True, **SWARM)
    accelerator.collaborative_optimizer = EndingCore(calls)
    if raised is None:
        accelerator.end_training()
    else:
        with pytest.raises(raised):
            try:
                raise raised()
            finally:
                accelerator.end_training()
    served = ["serve_final_state"] if raised is None else []
    assert calls == [*served, "close", "Accelerator.end_training"]


@pytest.mark.parametrize("interrupt", [Terminated, KeyboardInterrupt])
def test_an_interrupt_during_the_final_wait_still_ends_accelerate(monkeypatch, interrupt):
    """SIGTERM or Ctrl+C during serve_final_state: the optimizer closes, and Accelerate's end_training (trackers,
    process group) still runs before the interrupt propagates."""
    calls = []
    monkeypatch.setattr(Accelerator, "end_training", lambda self: calls.append("Accelerator.end_training"))
    accelerator = CollaborativeAccelerator(cpu=True, **SWARM)
    accelerator.collaborative_optimizer = EndingCore(calls, fails=interrupt)
    with pytest.raises(interrupt):
        accelerator.end_training()
    assert calls == ["serve_final_state", "close", "Accelerator.end_training"]


def test_node_needs_torch_distributed():
    assert not is_node_job()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigurationError, match="init_process_group"):
        NodeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **SWARM)
    with pytest.raises(ConfigurationError, match="run_id"):  # without torch.distributed: the plain core object
        collaborative_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run_id="bad id!",
                                target_batch_size=64)


def test_example_is_a_plain_accelerate_script_with_two_lines_changed():
    """The README's diff turns examples/accelerate_train.py back into a plain Accelerate script."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("<!-- section: accelerate -->"):readme.index("<!-- section: lightning -->")]
    diff_block = re.search(r"```diff\n(.*?)```", section, re.S).group(1).splitlines()
    removed = [line[1:] for line in diff_block if line.startswith("-")]
    added = [line[1:] for line in diff_block if line.startswith("+")]
    assert len(removed) == len(added) == 2
    example = (ROOT / "examples" / "accelerate_train.py").read_text().splitlines()
    plain = list(example)
    for old, new in zip(removed, added, strict=True):
        assert example.count(new) == 1, new
        plain[example.index(new)] = old
    code = "\n".join(plain)
    assert "CollaborativeAccelerator" not in code and "target_batch_size=" not in code
    assert not re.search(r"^\s*(from|import) collabopt", code, re.M)
    changed = [line for line in difflib.unified_diff(plain, example, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) == 4  # 2 lines out, 2 lines in
