"""``CollaborativeTrainer`` without a swarm: bad input is refused by the constructor (no network is started before
``train()``), the schedule spans global epochs, checkpoints route collabopt's state, logs carry the swarm's state."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collabopt.integrations.transformers import (  # noqa: E402
    LOCAL_STEP_LIMIT,
    CollaborativeTrainer,
    _SwarmCallback,
    _SwarmProgressCallback,
    swarm_epochs,
)
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from collabopt import ConfigurationError  # noqa: E402
from collabopt.interface import SNAPSHOT_FIELDS, pack_state, swarm_metrics, swarm_snapshot  # noqa: E402


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=1, n_head=2))


def data(n: int = 10) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 16, (n, 8))
    return [{"input_ids": row, "labels": row} for row in ids]


def make(tmp_path, args: dict | None = None, **kwargs) -> CollaborativeTrainer:
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **(args or {}))
    options = dict(run_id="unit_run", target_batch_size=64)
    options.update(kwargs)
    options = {k: v for k, v in options.items() if v is not None}
    return CollaborativeTrainer(model=tiny_model(), args=arguments, train_dataset=data(), **options)


def refused(tmp_path, parameter: str, args: dict | None = None, **kwargs) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as caught:
        make(tmp_path, args, **kwargs)
    assert caught.value.parameter == parameter, caught.value
    return caught.value


def test_missing_run_id_is_refused_with_the_fix(tmp_path):
    error = refused(tmp_path, "run_id", run_id=None)
    assert "run_id=" in error.fix and "CollaborativeTrainer" in error.fix


@pytest.mark.parametrize("target", [None, 0, -5, 2.5, True])
def test_target_batch_size_must_be_a_positive_integer(tmp_path, target):
    refused(tmp_path, "target_batch_size", target_batch_size=target)


def test_bad_option_values_and_names_are_refused(tmp_path):
    refused(tmp_path, "matchmaking_time", matchmaking_time=-1.0)
    refused(tmp_path, "run_id", run_id="no spaces allowed")
    error = refused(tmp_path, "matchmakng_time", matchmakng_time=2.0)
    assert "spelling" in error.fix
    error = refused(tmp_path, "optimizer", optimizer=torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    assert "optimizers=" in error.fix


def test_combinations_that_cannot_work_are_refused(tmp_path):
    refused(tmp_path, "reuse_grad_buffers", reuse_grad_buffers=True)
    refused(tmp_path, "logging_steps", args=dict(logging_steps=0.1))
    refused(tmp_path, "save_steps", args=dict(save_steps=0.5))


def test_collabopt_options_are_split_from_the_trainers(tmp_path):
    outer = torch.optim.SGD
    trainer = make(tmp_path, matchmaking_time=2.0, outer_optimizer=outer, initial_peers=None)
    assert trainer.collab_options == dict(run_id="unit_run", target_batch_size=64, matchmaking_time=2.0,
                                          outer_optimizer=outer)
    assert trainer.collab_config.outer_optimizer is outer
    assert trainer.collaborative_optimizer is None
    progress = [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__.endswith("ProgressCallback")]
    assert len(progress) == 1 and isinstance(progress[0], _SwarmProgressCallback)


def test_swarm_epochs_max_steps_or_swarm_passes_over_the_dataset():
    assert swarm_epochs(7, 3.0, 1000, 64) == 7  # max_steps counts global epochs
    assert swarm_epochs(-1, 2.0, 100, 64) == 4  # ceil(2 * 100 / 64)
    assert swarm_epochs(0, 0.5, 128, 64) == 1
    with pytest.raises(ConfigurationError) as caught:
        swarm_epochs(-1, 3.0, None, 64)
    assert caught.value.parameter == "max_steps"


def test_the_trainers_schedule_spans_the_global_epochs(tmp_path):
    trainer = make(tmp_path, args=dict(learning_rate=1.0, warmup_steps=1, lr_scheduler_type="linear"))
    trainer.target_epochs = 5  # as train() sets it; the Trainer asks for its (huge) local step count
    trainer.create_optimizer_and_scheduler(num_training_steps=LOCAL_STEP_LIMIT)
    lrs = []
    for _ in range(6):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert lrs == pytest.approx([0.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_a_collaborative_checkpoint_waits_for_the_swarm_a_plain_one_loads(tmp_path):
    trainer = make(tmp_path)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    optimizer = trainer.optimizer
    ours = tmp_path / "ours"
    ours.mkdir()
    state = pack_state(optimizer.state_dict(), None, local_epoch=3, samples_reported=500)
    torch.save(state, ours / "optimizer.pt")
    trainer._load_optimizer_and_scheduler(str(ours))
    assert trainer._saved_state["local_epoch"] == 3  # applied when train() joins the swarm

    plain = tmp_path / "plain"
    plain.mkdir()
    other = optimizer.state_dict()
    for group in other["param_groups"]:
        group["lr"] = 0.123
    torch.save(other, plain / "optimizer.pt")
    torch.save(trainer.lr_scheduler.state_dict(), plain / "scheduler.pt")
    trainer._saved_state = None
    trainer._load_optimizer_and_scheduler(str(plain))
    assert trainer._saved_state is None and optimizer.param_groups[0]["lr"] == 0.123  # loaded as Trainer loads


def swarm_optimizer(**values: float) -> SimpleNamespace:
    """An open collaborative optimizer as far as its metrics go (``metrics()`` as the real ones build it)."""
    fake = SimpleNamespace(closed=False, get_lr=lambda: [0.1], **dict(dict.fromkeys(SNAPSHOT_FIELDS, 0), **values))
    fake.metrics = lambda: swarm_snapshot(fake)
    return fake


def test_logs_carry_the_swarm_state_while_training(tmp_path):
    trainer = make(tmp_path)
    trainer.log({"loss": 1.0})
    assert not any(name.startswith("swarm/") for name in trainer.state.log_history[-1])  # not in a swarm
    trainer._copt = swarm_optimizer(local_epoch=3, num_peers=2, samples_per_second=12.5)
    trainer.log({"loss": 0.5})
    expected = {"loss": 0.5, "swarm/local_epoch": 3.0, "swarm/num_peers": 2.0, "swarm/samples_per_second": 12.5}
    assert expected.items() <= trainer.state.log_history[-1].items()
    # the names every adapter logs, from the core
    assert trainer.swarm_metrics() == swarm_metrics(trainer._copt) and "swarm/lr" in trainer.swarm_metrics()
    trainer.log_swarm_metrics = False
    trainer.log({"loss": 0.25})
    assert "swarm/num_peers" not in trainer.state.log_history[-1]


def test_the_readme_diff_turns_the_example_into_a_plain_trainer_script():
    """The README's diff is the whole change: undone, examples/transformers_train.py is a plain Trainer script."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("<!-- section: transformers -->"):readme.index("<!-- section: lightning -->")]
    diff = re.search(r"```diff\n(.*?)```", section, re.S).group(1).splitlines()
    removed = [line[1:] for line in diff if line.startswith("-")]
    added = [line[1:] for line in diff if line.startswith("+")]
    assert len(removed) == 2 and len(added) == 3
    example = (root / "examples" / "transformers_train.py").read_text()
    changes = [(added[0] + "\n", removed[0] + "\n"), (added[1] + "\n" + added[2] + "\n", removed[1] + "\n")]
    plain = example
    for new, old in changes:
        assert plain.count(new) == 1, new
        plain = plain.replace(new, old)
    assert not re.search(r"^\s*(from|import) collabopt", plain, re.M)
    assert "run_id=" not in plain and "target_batch_size=" not in plain and "CollaborativeTrainer" not in plain
    assert "from transformers import Trainer\n" in plain


def test_evaluation_metrics_reach_a_plateau_schedule(tmp_path):
    """The Trainer steps only a bare ReduceLROnPlateau with the metric; the swarm's wrapper gets it reported."""
    trainer = make(tmp_path, args=dict(metric_for_best_model="loss"))
    reported: list[float] = []
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, _SwarmCallback))
    plateau = SimpleNamespace(is_plateau=True)
    trainer._copt = SimpleNamespace(closed=False, scheduler=plateau, report_metric=reported.append)
    callback.on_evaluate(trainer.args, trainer.state, trainer.control, metrics={"eval_loss": 0.5, "epoch": 1.0})
    plateau.is_plateau = False
    callback.on_evaluate(trainer.args, trainer.state, trainer.control, metrics={"eval_loss": 0.4})
    assert reported == [0.5]
