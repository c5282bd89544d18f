"""Hugging Face ``transformers.Trainer``: ``CollaborativeTrainer`` trains as one peer of a hivemind swarm.

An existing Trainer script changes its import and adds two arguments:

.. code-block:: diff

    -from transformers import Trainer
    +from collabopt.integrations.transformers import CollaborativeTrainer as Trainer
    -trainer = Trainer(model=model, args=args, train_dataset=train)
    +trainer = Trainer(model=model, args=args, train_dataset=train, run_id="my_run", target_batch_size=4096)

What it means in a swarm (docs/guides/transformers.md):

* **steps**: every optimizer step of the Trainer is a *local* step; the swarm takes one global optimizer step (a
  global epoch) per ``target_batch_size`` samples of all peers. ``max_steps`` counts global epochs, and so do
  ``warmup_steps`` and the LR schedule, which advances once per global epoch. Without ``max_steps``,
  ``num_train_epochs`` counts passes of the whole swarm over the dataset: training ends after
  ``ceil(num_train_epochs * len(train_dataset) / target_batch_size)`` global epochs. Each peer cycles through its
  data as often as that takes. ``logging_steps``, ``save_steps`` and ``eval_steps`` count local steps, as before.
* **optimizer and scheduler**: those the Trainer builds from ``TrainingArguments``, or those passed with
  ``optimizers=``, are wrapped when ``train()`` starts; the swarm is left when it returns.
* **samples** are counted from the model's forward calls in training mode: ``per_device_train_batch_size``,
  ``gradient_accumulation_steps`` and a short last batch are counted exactly.
* **logs** (progress bar, ``logging_steps``, every ``report_to`` logger) carry the swarm's metrics
  (``swarm/num_peers``, ``swarm/local_epoch``, ``swarm/samples_per_second``, ...); the progress bar counts global
  epochs.
* **several processes** (``accelerate launch``, ``torchrun``) are ONE peer (:mod:`collabopt.node`).
* **checkpoints** (``save_steps``) hold the collaborative optimizer's state; ``train(resume_from_checkpoint=...)``
  restores it, then downloads the swarm's state if the swarm is ahead.
* ``outer_optimizer=`` selects DiLoCo mode; ``evaluate()`` and ``predict()`` are unchanged.

Refused with a :class:`~collabopt.ConfigurationError` before any network starts: a missing ``run_id``, a
``target_batch_size`` that is not a positive integer, unknown options, ``reuse_grad_buffers`` (the Trainer clears
``param.grad`` after every step), DeepSpeed and FSDP (they own the optimizer step), and fractional
``logging_steps`` / ``save_steps`` / ``eval_steps`` (fractions of a step count that has no local meaning here).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import torch

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from tqdm.auto import tqdm
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ProgressCallback
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "collabopt.integrations.transformers needs transformers: pip install 'collabopt[transformers]'"
    ) from error

from collabopt import CollabConfig, CollaborativeScheduler, ConfigurationError, collaborative_optimizer
from collabopt.config import option_names
from collabopt.interface import is_collaborative_state, swarm_metrics
from collabopt.scheduling import rebind_scheduler
from collabopt.swarm import print_join_message

LOCAL_STEP_LIMIT = 10**15
"""The Trainer's own ``max_steps`` while ``train()`` runs: the swarm's global epochs end training, not local steps."""
# taken from the Trainer (its model, optimizer and scheduler) or refused (reuse_grad_buffers, see _refuse)
_DERIVED = {"optimizer", "scheduler", "scheduler_fn", "model", "scaler", "grad_scaler", "dht"}


def swarm_epochs(max_steps: int, num_train_epochs: float, dataset_length: int | None, target_batch_size: int) -> int:
    """Global epochs a run trains for: ``max_steps`` if positive, else ``num_train_epochs`` passes of the whole
    swarm over a dataset of ``dataset_length`` samples.

        >>> swarm_epochs(-1, 3.0, 1000, 256)
        12
    """
    if max_steps > 0:
        return max_steps
    if dataset_length is None:
        raise ConfigurationError("max_steps", "must be set when the train dataset has no length",
                                 "pass TrainingArguments(max_steps=<global epochs>)")
    epochs = math.ceil(num_train_epochs * dataset_length / target_batch_size)
    if epochs <= 0:
        raise ConfigurationError("num_train_epochs", f"gives {epochs} global epochs", "pass max_steps= or more epochs")
    return epochs


class _SwarmCallback(TrainerCallback):
    """Joins the swarm once the Trainer has built (and restored) its optimizer, and ends training at the last
    global epoch."""

    def __init__(self, trainer: CollaborativeTrainer):
        self.trainer = trainer
        self.stopped = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stopped = False
        self.trainer._join_swarm()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        copt = self.trainer.collaborative_optimizer
        if copt is None or copt.local_epoch < self.trainer.target_epochs:
            return
        control.should_training_stop = True
        if not self.stopped and args.save_strategy == "steps":  # a final checkpoint, as a plain Trainer saves one
            control.should_save = True
        self.stopped = True

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict | None = None, **kwargs: Any) -> None:
        """``ReduceLROnPlateau``: the Trainer steps only a bare one; report the metric to the swarm's schedule."""
        copt = self.trainer.collaborative_optimizer
        if copt is None or copt.closed or copt.scheduler is None or not copt.scheduler.is_plateau or not metrics:
            return
        name = args.metric_for_best_model or "loss"
        value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
        if value is not None:
            copt.report_metric(value)


class _SwarmProgressCallback(ProgressCallback):
    """The Trainer's progress bar, counting global epochs, with the swarm's peers and samples/s."""

    def __init__(self, trainer: CollaborativeTrainer):
        super().__init__()
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=self.trainer.target_epochs, desc="global epochs", dynamic_ncols=True)
        self.current_step = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        copt = self.trainer.collaborative_optimizer
        if self.training_bar is None or copt is None or copt.closed:
            return
        self.training_bar.n = min(copt.local_epoch, self.trainer.target_epochs)
        self.training_bar.set_postfix(peers=copt.num_peers, samples_per_s=f"{copt.samples_per_second:.1f}",
                                      local_step=state.global_step, refresh=False)
        self.training_bar.refresh()


class CollaborativeTrainer(Trainer):
    """A ``transformers.Trainer`` that trains as one peer of a hivemind swarm.

    Args:
        *args: every ``Trainer`` argument (``model``, ``args``, ``train_dataset``, ``optimizers``, ...).
        run_id: name of the run; all its peers use the same one.
        target_batch_size: samples the swarm accumulates per global optimizer step (a global epoch).
        log_swarm_metrics: logs carry the swarm's metrics (``swarm/num_peers``, ``swarm/local_epoch``, ...; default
            True).
        **kwargs: every other ``Trainer`` argument, and every :class:`~collabopt.CollaborativeOptimizer` /
            ``hivemind.Optimizer`` option (``initial_peers``, ``outer_optimizer``, ``matchmaking_time``, ...).
    """

    def __init__(self, *args: Any, run_id: str | None = None, target_batch_size: int | None = None,
                 log_swarm_metrics: bool = True, **kwargs: Any):
        trainer_kwargs, collab_kwargs = _split_kwargs(kwargs)
        if run_id is None:
            raise ConfigurationError("run_id", "is required: it names the run all peers join",
                                     "pass CollaborativeTrainer(..., run_id='my_run', target_batch_size=4096)")
        if target_batch_size is None:
            raise ConfigurationError("target_batch_size", "is required: the samples of one global epoch",
                                     "pass CollaborativeTrainer(..., run_id='my_run', target_batch_size=4096)")
        self.collab_options: dict[str, Any] = dict(run_id=run_id, target_batch_size=target_batch_size,
                                                   **collab_kwargs)
        # every option is checked now, before the Trainer (or any network) starts
        self.collab_config = CollabConfig.from_options(
            **{k: v for k, v in self.collab_options.items() if k in option_names()})
        super().__init__(*args, **trainer_kwargs)
        _refuse(self.args, self.collab_config)
        self.log_swarm_metrics = log_swarm_metrics
        self.target_epochs = 0  # global epochs of the current train() call
        self._copt: Any = None
        self._plain: tuple[Any, Any] | None = None  # the Trainer's own optimizer and scheduler while in the swarm
        self._saved_state: dict[str, Any] | None = None  # a checkpoint's collaborative state, applied on joining
        self.add_callback(_SwarmCallback(self))
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(_SwarmProgressCallback(self))

    # ------------------------------------------------------------------ training

    @property
    def collaborative_optimizer(self) -> Any:
        """The :class:`~collabopt.CollaborativeOptimizer` (or node) of the current or last ``train()``."""
        return self._copt

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, as one peer of the swarm until ``target_epochs`` global epochs are reached."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        length = len(dataset) if hasattr(dataset, "__len__") else None
        self.target_epochs = swarm_epochs(self.args.max_steps, self.args.num_train_epochs, length,
                                          self.collab_config.target_batch_size)
        max_steps, self.args.max_steps = self.args.max_steps, LOCAL_STEP_LIMIT
        finished = False
        try:
            output = super().train(*args, **kwargs)
            finished = True
            return output
        finally:
            self.args.max_steps = max_steps
            self._leave_swarm(flush=finished)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The Trainer's scheduler, spanning the run's global epochs (it advances once per global epoch)."""
        if self.target_epochs > 0:
            num_training_steps = self.target_epochs
        return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)

    def _join_swarm(self) -> None:
        """Wrap the Trainer's optimizer and scheduler (called once they exist and a checkpoint is restored)."""
        prepared, scheduler = self.optimizer, self.lr_scheduler
        optimizer = prepared.optimizer if isinstance(prepared, AcceleratedOptimizer) else prepared
        if scheduler is not None:  # built on Accelerate's wrapper, which shows the same param groups
            rebind_scheduler(scheduler, optimizer)
        several = self.args.world_size > 1
        options = dict(self.collab_options)
        print_join = options.pop("print_join_message", True)
        load_on_start = options.get("load_state_on_start", True)
        options["print_join_message"] = False  # printed below, naming this class
        if not several:
            options["load_state_on_start"] = False  # after the checkpoint is restored, below
        scaler = getattr(self.accelerator, "scaler", None)
        copt = collaborative_optimizer(optimizer, model=self.model, scaler=scaler,
                                       scheduler=CollaborativeScheduler(scheduler) if scheduler is not None else None,
                                       **options)
        self._copt, self._plain = copt, (prepared, scheduler)
        if self._saved_state is not None:
            copt.load_state_dict(self._saved_state)
            self._saved_state = None
        if load_on_start and not several:
            copt.catch_up()  # the swarm is ahead of this peer (or of its checkpoint); a node caught up when built
        if print_join and copt.dht is not None:
            print_join_message(copt.dht, copt.run_id, copt.dht.client_mode, constructor="CollaborativeTrainer")
        wrapped = AcceleratedOptimizer(copt, device_placement=False, scaler=scaler)
        self._swap(prepared, wrapped, copt.scheduler)

    def _swap(self, old: Any, optimizer: Any, scheduler: Any) -> None:
        """Make ``optimizer`` / ``scheduler`` the ones the Trainer, its callbacks and its accelerator use."""
        accelerator_optimizers = self.accelerator._optimizers
        self.accelerator._optimizers = [optimizer if o is old else o for o in accelerator_optimizers]
        self.optimizer, self.lr_scheduler = optimizer, scheduler
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = optimizer, scheduler

    def _leave_swarm(self, flush: bool) -> None:
        """Apply background updates (after a finished run), leave the swarm, give the Trainer its own objects back."""
        copt, plain = self._copt, self._plain
        if copt is None or plain is None:
            return
        self._plain = None
        try:  # serve_final_state flushes; a peer one epoch behind downloads the final state meanwhile
            copt.end_run(serve=flush)  # a node's ranks decide together: it serves only where every rank finished
        finally:
            self._swap(self.optimizer, *plain)

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Trainer.training_step``; the loss also goes to the swarm's monitor (``collabopt monitor``)."""
        loss = super().training_step(model, inputs, *args, **kwargs)
        copt = self._copt
        if copt is not None and not copt.closed and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            copt.report_loss(loss)
        return loss

    # ------------------------------------------------------------------ checkpoints and logs

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A checkpoint of this class holds the collaborative state (optimizer, scheduler, global epoch): it is
        applied when the swarm is joined. Other checkpoints load as in ``Trainer``."""
        path = os.path.join(checkpoint, "optimizer.pt") if checkpoint is not None else None
        if path is not None and os.path.isfile(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
            if is_collaborative_state(state):
                self._saved_state = state
                return
        super()._load_optimizer_and_scheduler(checkpoint)

    def swarm_metrics(self) -> dict[str, float]:
        """``swarm/num_peers``, ``swarm/local_epoch``, ``swarm/samples_per_second``, ... while training (empty
        otherwise): :func:`collabopt.interface.swarm_metrics`, the names every adapter logs."""
        return swarm_metrics(self._copt)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log`` with the swarm's metrics (unless ``log_swarm_metrics=False``)."""
        if self.log_swarm_metrics:
            logs = {**logs, **self.swarm_metrics()}
        super().log(logs, *args, **kwargs)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trainer arguments and collabopt options; anything else is refused by name."""
    trainer_names = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    collab_names = set(option_names()) | {"optimizer_factory"}
    trainer_kwargs, collab_kwargs = {}, {}
    for name, value in kwargs.items():
        if name in trainer_names:
            trainer_kwargs[name] = value
        elif name in _DERIVED:
            raise ConfigurationError(name, "is taken from the Trainer (its model, optimizer and LR scheduler)",
                                     f"drop {name}=; pass optimizers=(optimizer, scheduler) to the Trainer if needed")
        elif name in collab_names:
            collab_kwargs[name] = value
        else:
            raise ConfigurationError(
                name, "is not an argument of Trainer, CollaborativeOptimizer or hivemind.Optimizer",
                "check the spelling (see transformers.Trainer and collabopt.CollaborativeOptimizer)",
            )
    return trainer_kwargs, collab_kwargs


def _refuse(args: Any, config: CollabConfig) -> None:
    """Combinations that cannot work, refused before any network starts."""
    if config.reuse_grad_buffers:
        raise ConfigurationError("reuse_grad_buffers", "the Trainer clears param.grad after every optimizer step "
                                 "(model.zero_grad()), which would drop the accumulation", "drop reuse_grad_buffers")
    if args.deepspeed or args.fsdp:
        name = "deepspeed" if args.deepspeed else "fsdp"
        raise ConfigurationError(name, "is not supported by collabopt (it shards or owns the optimizer step that "
                                 "hivemind must run)", f"drop TrainingArguments({name}=...); plain DDP works")
    for kind in ("logging", "save", "eval"):
        value = getattr(args, f"{kind}_steps", None)
        if value is not None and 0 < value < 1:
            raise ConfigurationError(f"{kind}_steps", f"is a fraction ({value}) of the Trainer's step count, "
                                     "which a swarm does not fix",
                                     f"pass a whole number of local steps, e.g. {kind}_steps=50")


__all__ = ["CollaborativeTrainer", "LOCAL_STEP_LIMIT", "swarm_epochs"]
