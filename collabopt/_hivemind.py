"""Every use of hivemind beyond its documented constructor arguments, behind one module.

collabopt drives ``hivemind.Optimizer`` through a handful of internals (its progress tracker, state averager and
gradient averager). They are reached only from here, and ``pyproject.toml`` pins the hivemind version this module
was tested with (``hivemind==1.1.12``), so a hivemind upgrade is this one file's work. The rest of the package talks
to :class:`HivemindPeer`, whose small surface is also what the in-process fakes of ``tests/unit`` implement.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

try:  # hivemind >= 1.1.11 vendors its multiaddr implementation
    from hivemind.utils.multiaddr import Multiaddr
except ImportError:  # pragma: no cover - older layouts
    from multiaddr import Multiaddr

HIVEMIND_REQUEST_TIMEOUT = 3.0  # hivemind's default averager request_timeout (seconds)

__all__ = [
    "HIVEMIND_REQUEST_TIMEOUT",
    "HivemindPeer",
    "Multiaddr",
    "check_compression",
    "dht_time",
    "gradient_averager_factory",
    "is_dht",
    "is_hivemind_object",
    "optimizer_parameter_names",
    "read_progress_records",
    "reader_validators",
    "start_dht",
]


@functools.lru_cache(maxsize=1)
def optimizer_parameter_names() -> frozenset[str]:
    """Names of ``hivemind.Optimizer.__init__``'s arguments."""
    import hivemind

    return frozenset(inspect.signature(hivemind.Optimizer.__init__).parameters) - {"self"}


def is_dht(obj: Any) -> bool:
    import hivemind

    return isinstance(obj, hivemind.DHT)


def is_hivemind_object(obj: Any) -> bool:
    return type(obj).__module__.startswith("hivemind")


def check_compression(value: Any) -> bool:
    from hivemind.compression import CompressionBase

    return isinstance(value, CompressionBase)


def gradient_averager_factory(factory: Callable[..., Any] | None, request_timeout: float) -> Callable[..., Any]:
    """hivemind 1.1.12 hands ``averager_opts`` to its state averager only: give the gradient averager the same
    join-request timeout."""
    from hivemind.optim.grad_averager import GradientAverager

    return functools.partial(factory or GradientAverager, request_timeout=request_timeout)


def start_dht(**kwargs: Any) -> Any:
    import hivemind

    return hivemind.DHT(start=True, **kwargs)


def dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


def reader_validators() -> list:
    """Validators a DHT must be *created* with to read the signed progress records (they strip signatures).

    Added later with ``dht.add_validators`` they do not help, and without them hivemind cannot decode the
    records (its get() then never returns): pass ``record_validators=reader_validators()`` to the DHT.
    """
    from hivemind.dht.crypto import RSASignatureValidator

    return [RSASignatureValidator()]


def read_progress_records(dht: Any, run_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The progress records peers of ``run_id`` published (hivemind's ``LocalTrainingProgress``), as dicts;
    malformed records are skipped."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import ValueWithExpiration

    try:
        found = dht.get(f"{run_id}_progress", latest=True, return_future=True).result(timeout=timeout)
    except FutureTimeout:
        found = None
    records = found.value if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict) else {}
    peers = []
    for entry in records.values():
        value = getattr(entry, "value", None)
        if value is None:
            continue
        try:
            progress = LocalTrainingProgress.parse_obj(value)
        except Exception:
            continue  # not a valid record: ignore it
        peers.append(dict(
            peer_id=progress.peer_id.hex() if isinstance(progress.peer_id, bytes) else str(progress.peer_id),
            epoch=progress.epoch,
            samples_accumulated=progress.samples_accumulated,
            samples_per_second=progress.samples_per_second,
            client_mode=progress.client_mode,
            time=progress.time,
        ))
    return peers


class HivemindPeer:
    """This process's ``hivemind.Optimizer``, seen through what collabopt needs of it.

    Built in the process's main thread (hivemind installs signal handlers). ``arguments`` are
    ``hivemind.Optimizer`` keyword arguments without ``dht``.
    """

    def __init__(self, dht: Any, arguments: dict[str, Any]):
        import hivemind

        # hivemind's Optimizer ignores its own client_mode argument: the DHT's is the one that counts
        self.hivemind_optimizer = hivemind.Optimizer(dht=dht, **dict(arguments, client_mode=dht.client_mode))
        self.dht = dht

    # ---- stepping

    def step(self, samples: int | None) -> bool:
        """One local step of ``samples`` samples (``None``: an auxiliary peer's step). Returns whether hivemind
        accepted the samples (False when it dropped the step to download the swarm's state first)."""
        opt = self.hivemind_optimizer
        if samples is None:
            opt.step()
            return False
        reported_before = opt.tracker.local_progress.samples_accumulated
        epoch_before = opt.local_epoch
        opt.step(batch_size=samples)
        return opt.local_epoch != epoch_before or opt.tracker.local_progress.samples_accumulated != reported_before

    @property
    def accumulated_steps(self) -> int:
        """Local steps whose gradients hivemind holds toward the next global epoch (0 right after one)."""
        averager = self.hivemind_optimizer.grad_averager
        return averager.local_times_accumulated if averager is not None else 0

    @property
    def accumulated_samples(self) -> int:
        averager = self.hivemind_optimizer.grad_averager
        return averager.local_samples_accumulated if averager is not None else 0

    def drop_accumulated(self) -> None:
        """Forget the gradients and samples accumulated toward the next global epoch."""
        self.hivemind_optimizer.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        if self.hivemind_optimizer.grad_averager is not None:
            self.hivemind_optimizer.grad_averager.reset_accumulated_grads_()

    def jump_to_epoch(self, epoch: int) -> None:
        """Continue from this peer's own parameters at ``epoch`` (nobody could serve the swarm's state)."""
        self.hivemind_optimizer.state_averager.local_epoch = epoch
        self.hivemind_optimizer.tracker.report_local_progress(epoch, samples_accumulated=0)

    def restore_epoch(self, epoch: int) -> None:
        """Set the local epoch from a checkpoint; the tracker's view of the swarm moves along with it (otherwise
        local samples do not count toward the restored epoch until its next fetch)."""
        self.hivemind_optimizer.state_averager.local_epoch = epoch
        with self.hivemind_optimizer.tracker.pause_updates():
            self.hivemind_optimizer.tracker.update_epoch(epoch)

    def finish_background_work(self, apply: bool = True) -> None:
        """Wait for delayed optimizer steps and averaging rounds (and apply their results)."""
        self.hivemind_optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=apply)

    def load_state_from_peers(self) -> None:
        self.hivemind_optimizer.load_state_from_peers()

    # ---- what the peer holds

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer hivemind really steps (a copy of the user's when offloading)."""
        return self.hivemind_optimizer.state_averager.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return list(self.hivemind_optimizer.param_groups)

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters (those the gradients are read from)."""
        return list(self.hivemind_optimizer.state_averager.main_parameters)

    # ---- the swarm as this peer sees it

    @property
    def local_epoch(self) -> int:
        return self.hivemind_optimizer.local_epoch

    @property
    def global_epoch(self) -> int:
        return self.hivemind_optimizer.tracker.global_epoch

    @property
    def num_peers(self) -> int:
        return self.hivemind_optimizer.tracker.global_progress.num_peers

    @property
    def samples_accumulated(self) -> int:
        return self.hivemind_optimizer.tracker.global_progress.samples_accumulated

    @property
    def samples_per_second(self) -> float:
        tracker = self.hivemind_optimizer.tracker
        # hivemind 1.1.12's GlobalTrainingProgress has no samples_per_second field
        value = getattr(tracker.global_progress, "samples_per_second", None)
        if value is None:
            value = tracker.performance_ema.samples_per_second * max(1, tracker.global_progress.num_peers)
        return float(value)

    @property
    def eta_next_epoch(self) -> float:
        return max(0.0, self.hivemind_optimizer.tracker.estimated_next_update_time - dht_time())

    def announce(self, timeout: float = 10.0) -> None:
        """Publish this peer's progress record now, with zero samples, and make the tracker fetch the swarm's.

        hivemind publishes a peer's record only once it has accumulated samples, so peers that wait for each other
        before their first step never see each other. Stored under the tracker's own signed subkey; the tracker
        replaces it with its own reports as soon as this peer trains.
        """
        tracker = self.hivemind_optimizer.tracker
        future = tracker.dht.store(key=tracker.training_progress_key, subkey=tracker._local_public_key,
                                   value=tracker.local_progress.dict(),
                                   expiration_time=dht_time() + tracker.metadata_expiration, return_future=True)
        with contextlib.suppress(FutureTimeout):  # not stored in time: the next call tries again
            future.result(timeout=timeout)
        tracker.global_progress.next_fetch_time = dht_time()
        tracker.global_state_updated.set()  # wakes the fetcher, which then finds its next fetch due

    def shutdown(self) -> None:
        self.hivemind_optimizer.shutdown()
