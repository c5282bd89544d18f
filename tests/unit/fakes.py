"""In-process stand-ins for hivemind (in the style of torchft's mocked-manager tests).

:class:`FakePeer` has the interface of :class:`collabopt.engine.peer.HivemindPeer`: the core and the node run on it
unchanged, with no DHT and no averager process, so the paths that only swarms reached before (giving up after
failed syncs, discarding local progress, the node's step protocol) are tested in milliseconds.
"""

from __future__ import annotations

from typing import Any

import torch

from collabopt import CollaborativeOptimizer, RoundOutcome
from collabopt.engine import protocol


class FakePeer:
    """One peer alone in a swarm: a global epoch happens when this peer's own samples reach the target.

    ``swarm_epoch`` makes the swarm look ahead; while ``serves_state`` is False, the peer drops every step (it tries
    to download state nobody serves), which is what :class:`FakePeer` then does. ``round_ahead``: its boundaries'
    gradient rounds gather its group at the next epoch (it is behind them: it does not step, and downloads). Whether
    a step downloads, whether its samples count and each round's outcome are the engine's decisions
    (:mod:`collabopt.engine.protocol`): the fake always holds a fresh view of its swarm.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, target_batch_size: int, reuse_grad_buffers: bool = False):
        self.optimizer = optimizer
        self.target_batch_size = target_batch_size
        self.reuse_grad_buffers = reuse_grad_buffers
        self.local_epoch = 0
        self.swarm_epoch = 0
        self.serves_state = True
        self.round_ahead = False
        self.accumulated_samples = 0
        self.accumulated_steps = 0
        self.num_peers = 1
        self.samples_per_second = 0.0
        self.eta_next_epoch = 0.0
        self.out_of_sync = False  # alone: never apart from its swarm
        self.last_round: RoundOutcome | None = None
        self.dht = None
        self.calls: list[str] = []
        self.fail_next: BaseException | None = None  # raised by the next step()
        self.poison: str | None = None  # "gradients" / "parameters": what a rogue peer's averaging round brings
        self.before_averaging: Any = None  # the core's callback at a boundary (HivemindPeer.set_before_averaging)
        self._accumulators: list[torch.Tensor] | None = None  # without reuse_grad_buffers: the sum of the grads

    @property
    def global_epoch(self) -> int:
        return max(self.local_epoch, self.swarm_epoch)

    @property
    def samples_accumulated(self) -> int:
        return self.accumulated_samples

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, samples: int | None) -> bool:
        self.calls.append("step")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        if samples is None:
            return False
        decision = protocol.sync_step(protocol.SyncStepEvidence(
            protocol.SwarmView(self.local_epoch, self.global_epoch, self.num_peers), fresh_view=True))
        if decision.download:
            if self.serves_state:  # (else the download finds nobody: the step is dropped, tried again next time)
                self.load_state_from_peers()
            return protocol.step_accepted(decision, behind_after=self.local_epoch < self.global_epoch)
        self.accumulated_samples += samples
        self.accumulated_steps += 1
        if not self.reuse_grad_buffers:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
            if self._accumulators is None:
                self._accumulators = [g.detach().clone() for g in grads]
            else:
                torch._foreach_add_(self._accumulators, grads)
        if self.accumulated_samples >= self.target_batch_size and self.round_ahead:
            return self._behind_its_round()
        if self.accumulated_samples >= self.target_batch_size:
            if self.before_averaging is not None:
                self.before_averaging()
            with torch.no_grad():
                if self.accumulated_samples == 0:  # dropped: this peer takes part with nothing (weight 0)
                    for p in self.parameters:
                        p.grad = torch.zeros_like(p)
                if self.poison == "gradients":  # averaged with a peer that sent NaN
                    for p in self.parameters:
                        p.grad.fill_(float("nan"))
                self.optimizer.step()
                if self.poison == "parameters":  # state averaging with a peer whose parameters are NaN
                    for p in self.parameters:
                        p.fill_(float("nan"))
            self.last_round = protocol.sync_round(protocol.SyncRoundEvidence(self.local_epoch,
                                                                             self.num_peers)).outcome
            self.local_epoch += 1
            self._reset()
        return True

    def _behind_its_round(self) -> bool:
        """A boundary whose gradient round gathered its group at the next epoch, as the engine decides it."""
        group = {"me": {"epoch": self.local_epoch}, "b": {"epoch": self.local_epoch + 1}}
        decision = protocol.sync_round(protocol.SyncRoundEvidence(self.local_epoch, max(self.num_peers, 2),
                                                                  group=group, me="me"))
        self.last_round = decision.outcome
        if not decision.steps:
            self.swarm_epoch = max(self.swarm_epoch, decision.download_epoch)  # (its group stepped on)
            self._reset()
            if self.serves_state:
                self.load_state_from_peers()
        return protocol.boundary_accepted(decision.outcome)

    def accumulators(self) -> list[torch.Tensor]:
        if self.reuse_grad_buffers:
            return [p.grad for p in self.parameters]
        return list(self._accumulators or [])

    def set_before_averaging(self, callback: Any) -> None:
        self.before_averaging = callback

    @property
    def parameter_round_due(self) -> bool:  # every boundary of the fake averages its parameters (see poison)
        return True

    def _reset(self) -> None:
        self.accumulated_samples = self.accumulated_steps = 0
        self._accumulators = None
        if self.reuse_grad_buffers:
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.zero_()

    def drop_accumulated(self) -> None:
        self.calls.append("drop_accumulated")
        self._reset()

    def jump_to_epoch(self, epoch: int) -> None:
        self.calls.append(f"jump_to_epoch({epoch})")
        self.local_epoch = epoch

    def restore_epoch(self, epoch: int) -> None:
        self.local_epoch = epoch

    def finish_background_work(self, apply: bool = True) -> None:
        self.calls.append("finish_background_work")

    def load_state_from_peers(self) -> None:
        self.calls.append("load_state_from_peers")
        with torch.no_grad():
            for p in self.parameters:
                p.add_(1.0)  # "the swarm's parameters"
        self.local_epoch = self.global_epoch

    def announce(self, timeout: float = 10.0) -> None:
        self.calls.append("announce")

    def serve_final_state(self, bound: float | None = None) -> str:
        self.calls.append(f"serve_final_state({bound})")
        return f"no live peer is behind epoch {self.local_epoch}"

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def fake_core(optimizer: torch.optim.Optimizer, **kwargs: Any) -> CollaborativeOptimizer:
    """A CollaborativeOptimizer over a :class:`FakePeer` (``core_factory`` of a node)."""
    config = kwargs["config"]
    peer = FakePeer(optimizer, config.target_batch_size, config.reuse_grad_buffers)
    return CollaborativeOptimizer(optimizer, peer=peer, **kwargs)


def model_and_optimizer(lr: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def backward(model: torch.nn.Module, samples: int, scale: float = 1.0) -> None:
    x = torch.randn(samples, 3)
    (model(x).pow(2).mean() * scale).backward()
