"""This process's peer: the loop of the chosen mode (:class:`~collabopt.engine.sync_round.SyncLoop` or
:class:`~collabopt.engine.diloco_round.DiLoCoLoop`), seen through what collabopt needs of it.

The rest of the package talks to :class:`HivemindPeer` (or :class:`DiLoCoPeer`), whose small surface is also what
the in-process fakes of ``tests/unit`` implement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from hivemind.optim.grad_averager import GradientAverager

from collabopt.engine.compat import dht_time
from collabopt.engine.diloco_round import DiLoCoLoop
from collabopt.engine.final_state import serve_final_state
from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.engine.lineage_check import out_of_sync
from collabopt.engine.peer_addresses import start_address_book, stop_address_book
from collabopt.engine.records import MAX_RECORD_BYTES, RecordSizeValidator, metrics_validators, votes_validators
from collabopt.engine.sync_round import SyncLoop
from collabopt.interface import RoundOutcome
from collabopt.lifeline import children_follow_parent


class HivemindPeer:
    """This process's loop (synchronous mode), seen through what collabopt needs of it.

    Built in the process's main thread (hivemind's averagers install signal handlers). ``arguments`` are the
    loop's keyword arguments (``hivemind.Optimizer``'s) without ``dht``.
    """

    def __init__(self, dht: Any, arguments: dict[str, Any]):
        with children_follow_parent():  # its averager processes end with this process, even on SIGKILL
            self.loop = self._create_loop(dht, dict(arguments, client_mode=dht.client_mode))
        self.dht = dht
        run_id = arguments["run_id"]
        self.metrics_key = f"{run_id}_metrics"
        # this peer accepts (to store for others, or read) only metrics records signed by their owner and
        # well-formed, and no record over MAX_RECORD_BYTES under the run's keys: hivemind's progress schema leaves the
        # peer id's length open, so a well-formed, self-signed, 100 kB record would otherwise count as a peer
        # (and the votes of collabopt.engine.download_votes alike)
        dht.add_validators([*metrics_validators(run_id), *votes_validators(run_id),
                            RecordSizeValidator([f"{run_id}_progress", self.metrics_key, f"{run_id}_fingerprints"],
                                                MAX_RECORD_BYTES)])
        # the run's address book: peers that libp2p's routing does not find reach each other (peer_addresses.py)
        self.run_id = run_id
        start_address_book(dht, run_id, self.loop.tracker.local_public_key, publish=not dht.client_mode)

    def _create_loop(self, dht: Any, arguments: dict[str, Any]) -> Any:
        return SyncLoop(dht=dht, **arguments)

    # ---- stepping

    def step(self, samples: int | None) -> bool:
        """One local step of ``samples`` samples (``None``: an auxiliary peer's step). Returns whether the loop
        accepted the samples, as it says (:meth:`PeerLoop.step`): False when it dropped the step to download the
        swarm's state first, also where that download moved this peer's epoch."""
        if samples is None:
            self.loop.step()
            return False
        return bool(self.loop.step(samples))

    @property
    def accumulated_steps(self) -> int:
        """Local steps whose gradients the loop holds toward the next global epoch (0 right after one)."""
        averager = self.loop.grad_averager
        return averager.local_times_accumulated if averager is not None else 0

    @property
    def accumulated_samples(self) -> int:
        averager = self.loop.grad_averager
        return averager.local_samples_accumulated if averager is not None else 0

    def accumulators(self) -> list[torch.Tensor] | None:
        """The tensors the local steps' gradients accumulate in toward the next global epoch (``param.grad`` with
        ``reuse_grad_buffers``, else hivemind's accumulators); ``None`` where gradients are applied, not accumulated
        (``use_local_updates``), or a user's averager keeps them its own way."""
        averager = self.loop.grad_averager
        if isinstance(averager, GradientRounds):
            return list(averager._grad_accumulators())
        if not isinstance(averager, GradientAverager) or any(  # a hivemind averager that accumulates its own way
                getattr(type(averager), name) is not getattr(GradientAverager, name)
                for name in ("accumulate_grads_", "_grad_accumulators", "load_accumulators_into_averager_")):
            return None
        return list(averager._grad_accumulators())

    def set_before_averaging(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` at each global epoch's boundary, before the loop averages the accumulated gradients
        (it may drop them: :meth:`drop_accumulated`; the peer then takes part with weight 0)."""
        self.loop.sync_state.before_averaging = callback

    @property
    def parameter_round_due(self) -> bool:
        """Whether the optimizer step in progress is followed by a parameter round (which may bring non-finite
        parameters: the non-finite guard keeps a copy of the step's result only then)."""
        return self.loop.sync_state.parameter_round_due

    def drop_accumulated(self) -> None:
        """Forget the gradients and samples accumulated toward the next global epoch."""
        self.loop.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        if self.loop.grad_averager is not None:
            self.loop.grad_averager.reset_accumulated_grads_()

    def jump_to_epoch(self, epoch: int) -> None:
        """Continue from this peer's own parameters at ``epoch`` (nobody could serve the swarm's state)."""
        self.loop.state_averager.local_epoch = epoch
        self.loop.tracker.report_local_progress(epoch, samples_accumulated=0)

    def restore_epoch(self, epoch: int) -> None:
        """Set the local epoch from a checkpoint; the tracker's view of the swarm moves along with it (otherwise
        local samples do not count toward the restored epoch until its next fetch)."""
        self.loop.state_averager.local_epoch = epoch
        with self.loop.tracker.pause_updates():
            self.loop.tracker.update_epoch(epoch)

    def finish_background_work(self, apply: bool = True) -> None:
        """Wait for delayed optimizer steps and averaging rounds (and apply their results)."""
        self.loop.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=apply)

    def load_state_from_peers(self) -> None:
        self.loop.load_state_from_peers()

    # ---- what the peer holds

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer the loop really steps (a copy of the user's when offloading)."""
        return self.loop.state_averager.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return list(self.loop.param_groups)

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters (those the gradients are read from)."""
        return list(self.loop.state_averager.main_parameters)

    # ---- the swarm as this peer sees it

    @property
    def local_epoch(self) -> int:
        return self.loop.local_epoch

    @property
    def global_epoch(self) -> int:
        return self.loop.tracker.global_epoch

    @property
    def num_peers(self) -> int:
        return self.loop.tracker.global_progress.num_peers

    @property
    def samples_accumulated(self) -> int:
        return self.loop.tracker.global_progress.samples_accumulated

    @property
    def samples_per_second(self) -> float:
        tracker = self.loop.tracker
        # hivemind 1.1.12's GlobalTrainingProgress has no samples_per_second field
        value = getattr(tracker.global_progress, "samples_per_second", None)
        if value is None:
            value = tracker.performance_ema.samples_per_second * max(1, tracker.global_progress.num_peers)
        return float(value)

    @property
    def eta_next_epoch(self) -> float:
        return max(0.0, self.loop.tracker.estimated_next_update_time - dht_time())

    @property
    def local_samples_per_second(self) -> float:
        """This peer's own throughput (hivemind's moving average)."""
        return float(self.loop.tracker.performance_ema.samples_per_second)

    @property
    def client_mode(self) -> bool:
        return bool(self.dht.client_mode)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def relayed(self) -> bool:
        """Whether this peer is reached through a relay (a ``/p2p-circuit`` address among those it announces)."""
        return any("p2p-circuit" in str(m) for m in self.dht.get_visible_maddrs())

    def publish_metrics(self, record: dict[str, Any] | None, expiration: float, may_wait: float = 0.0) -> None:
        """Store this peer's metrics record (``None``: it leaves) under its signed subkey, without waiting
        (``may_wait``: seconds it may wait to leave with another store, see :mod:`collabopt.engine.replicas`)."""
        tracker = self.loop.tracker  # its DHT stores on the key's replicas (collabopt.engine.replicas)
        tracker.dht.store(key=self.metrics_key, subkey=tracker.local_public_key, value=record,
                          expiration_time=expiration, return_future=True, may_wait=may_wait)

    def announce(self, timeout: float = 10.0) -> None:
        """Publish this peer's progress record now, with zero samples, and make the tracker fetch the swarm's.

        hivemind publishes a peer's record only once it has accumulated samples, so peers that wait for each other
        before their first step never see each other. Stored under the tracker's own signed subkey; the tracker
        replaces it with its own reports as soon as this peer trains.
        """
        tracker = self.loop.tracker
        future = tracker.dht.store(key=tracker.training_progress_key, subkey=tracker.local_public_key,
                                   value=tracker.local_progress.dict(),
                                   expiration_time=dht_time() + tracker.metadata_expiration, return_future=True)
        with contextlib.suppress(FutureTimeout):  # not stored in time: the next call tries again
            future.result(timeout=timeout)
        tracker.global_progress.next_fetch_time = dht_time()
        tracker.global_state_updated.set()  # wakes the fetcher, which then finds its next fetch due

    @property
    def last_round(self) -> RoundOutcome | None:
        """The outcome of this peer's last round (None before its first)."""
        return self.loop.last_round

    @property
    def out_of_sync(self) -> bool:
        """Whether this peer knows its parameters differ from its swarm's (see :func:`lineage_check.out_of_sync`)."""
        return out_of_sync(self.loop)

    def serve_final_state(self, bound: float | None = None) -> str:
        """After the last step: serve this peer's state while live peers are behind its epoch, at most ``bound``
        seconds (default ``averaging_timeout + matchmaking_time``), longer while a download from it is open; returns
        why it ended (:mod:`collabopt.engine.final_state`)."""
        loop = self.loop
        if loop.client_mode:  # (a client serves no state: nobody could download it)
            return "a client-mode peer serves no state"
        if bound is None:
            bound = loop.averaging_timeout + loop.matchmaking_time
        return serve_final_state(loop, bound)

    def shutdown(self) -> None:
        stop_address_book(self.dht, self.run_id)
        self.loop.shutdown()


class DiLoCoPeer(HivemindPeer):
    """A DiLoCo peer (see :mod:`collabopt.diloco`): ``step()`` applies the inner optimizer at once, then reports the
    samples; the loop's optimizer is the outer one and its rounds average pseudo-gradients. ``optimizer`` is the
    inner optimizer (the one the scheduler drives, whose statistics are checkpointed)."""

    def __init__(self, dht: Any, arguments: dict[str, Any], diloco: Any):
        self.diloco = diloco
        super().__init__(dht, arguments)

    def _create_loop(self, dht: Any, arguments: dict[str, Any]) -> Any:
        return DiLoCoLoop(dht=dht, diloco=self.diloco, **arguments)

    def step(self, samples: int | None) -> bool:
        """The inner optimizer applies the step at once; its samples count toward this peer's next round also where
        the loop downloaded the swarm's state first (it keeps this peer's progress), unless nobody served it."""
        if samples is not None:
            self.diloco.inner_step(samples)
        return super().step(samples)

    def accumulators(self) -> None:
        """None: the inner optimizer applies every step's gradients at once."""
        return None

    def set_before_averaging(self, callback: Callable[[], None] | None) -> None:
        """Nothing to look at: the inner optimizer applied every step's gradients (the round checks its
        pseudo-gradient itself, see :mod:`collabopt.diloco`)."""

    @property
    def out_of_sync(self) -> bool:
        """False: a DiLoCo peer whose anchor is not the swarm's downloads before its next round instead."""
        return False

    @property
    def last_round(self) -> RoundOutcome | None:
        return self.diloco.last_round

    def restart_from_last_round(self) -> None:
        """The parameters turned non-finite: restart from the last round's (see :mod:`collabopt.diloco`)."""
        self.diloco.restart_from_last_round(self.loop)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.diloco.inner

    @property
    def param_groups(self) -> list[dict]:
        return self.diloco.inner.param_groups

    def finish_background_work(self, apply: bool = True) -> None:
        """Also wait for the round in flight (``overlap_rounds``): applied, or with ``apply=False`` dropped (a
        checkpoint is being loaded: the parameters are the checkpoint's, not those the round started from)."""
        self.loop.land(wait=True, apply=apply)
        super().finish_background_work(apply)

    def restore_epoch(self, epoch: int) -> None:
        """A checkpoint was loaded: its parameters become the anchor."""
        super().restore_epoch(epoch)
        self.diloco.reanchor(self.loop)
