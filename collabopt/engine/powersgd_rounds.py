"""PowerSGD gradient rounds on collabopt's own averaging service: the algorithm of hivemind's
``PowerSGDGradientAverager`` (https://arxiv.org/abs/1905.13727), without an averager process of hivemind's.

Rules, and why:

* The math is hivemind's (:class:`PowerSGDState`), so that a user's ``partial(PowerSGDGradientAverager,
  averager_rank=r, min_compression_ratio=c)`` keeps its meaning: a gradient viewed as a matrix (``tensor.flatten``
  greedily to 2-d) that saves at least ``c`` of its elements at rank ``r`` is sent as P and Q of rank ``r``; what the
  approximation leaves out stays in a local residual and is added to the next round's gradient (error feedback);
  vectors and matrices too small to gain are averaged whole.
* A round is two all-reduces in one group. Phase P (the residual times Q, averaged, then orthogonalized) is the round
  scheduled ahead, with everything a synchronous gradient round has (the swarm key's gate, the epochs gathered:
  :class:`~collabopt.engine.gradient_rounds.GradientRounds`). Phase Q (the residual's transpose times P, averaged, with
  the whole tensors) follows at once among the same members, without matchmaking (:func:`run_in_group`).
* All or nothing (:func:`collabopt.engine.protocol.sync_gradients`): the average replaces this peer's gradients only
  where both phases are whole and its gradients are in them; the residual then keeps what the approximation left
  out. Otherwise the peer steps with its own gradients, whole, and its residual stays as it was (nothing of this
  epoch is left to feed back). A member whose phase P was not whole, or that tags along, still takes part in phase
  Q with zeros of weight 0, so that the others' phase Q stays whole.
* Every peer starts from the same Q (drawn from a seed of the round's prefix: the run id), and a whole phase Q leaves
  every member the same Q (the group's average, the next round's warm start). The members that install the average
  hold bit-identical gradients: each phase's results are the same bytes on every member (engine/allreduce.py).
* A peer's rounds run one after the other (:meth:`PowerSGDRounds.submit`): each round reads the residual the last
  one left (``delay_grad_averaging`` may hand the next epoch's round its tensors before the last one's result is
  read).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from collabopt.engine import protocol
from collabopt.engine.allreduce import AllReduceRound, RoundEvidence
from collabopt.engine.averager import AveragingResult, AveragingService
from collabopt.engine.gradient_rounds import GradientRound, GradientRounds
from collabopt.engine.part_reducer import AGGREGATES
from collabopt.errors import ConfigurationError

Shape = tuple[torch.Size, torch.dtype]
logger = logging.getLogger(__name__)


def matrix_dims(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-d view of a tensor of ``shape``: its smallest neighbouring axes merged until two are left
    (hivemind's ``get_flatten_greedy_dims``)."""
    dims = list(shape)
    while len(dims) > 2:
        i = min(range(len(dims) - 1), key=lambda k: dims[k] * dims[k + 1])
        dims[i] *= dims.pop(i + 1)
    return dims[0], dims[1]


@torch.no_grad()
def orthogonalize_(matrix: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt over the columns of a 2-d tensor, in place (hivemind's ``orthogonalize_``, without TorchScript:
    importing hivemind's warns on torch 2.13)."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i]
        torch.nn.functional.normalize(column, dim=0, eps=eps, out=column)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.addmm_(column[:, None], (column @ rest)[None, :], alpha=-1)


def compresses(shape: torch.Size, rank: int, min_compression_ratio: float) -> bool:
    """hivemind's rule: a tensor of 2 or more dimensions whose rank-``rank`` factors save at least
    ``min_compression_ratio`` of its elements. A tensor with no element has nothing to save: it is averaged whole
    (hivemind's rule divides by its 0 elements)."""
    if len(shape) <= 1 or torch.Size(shape).numel() == 0:
        return False
    rows, cols = matrix_dims(shape)
    return 1 - rank * (rows + cols) / (rows * cols) >= min_compression_ratio


def seed_of(prefix: str) -> int:
    """The seed of the first Q matrices: the same on every peer of a run (its prefix), whatever its process."""
    return int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:8], "big") & (2**63 - 1)


class PowerSGDState:
    """One peer's PowerSGD state over tensors of ``shapes`` (shape, dtype): which are compressed, their residuals
    (M) and Q matrices, and the steps of a round as functions of tensors (a round feeds them the averages; a test can
    feed them its own). Nothing changes until :meth:`finish` (the round is installed) or :meth:`adopt_q`."""

    def __init__(self, shapes: Sequence[Shape], rank: int, min_compression_ratio: float = 0.5, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"averager_rank must be an integer >= 1, got {rank!r}")
        self.rank, self.shapes = rank, [(torch.Size(shape), dtype) for shape, dtype in shapes]
        self.compressed = tuple(i for i, (shape, _) in enumerate(self.shapes)
                                if compresses(shape, rank, min_compression_ratio))
        self.whole = tuple(i for i in range(len(self.shapes)) if i not in self.compressed)
        generator = torch.Generator().manual_seed(seed)
        dims = [matrix_dims(self.shapes[i][0]) for i in self.compressed]
        self.ms = [torch.zeros(self.shapes[i][0], dtype=self.shapes[i][1]) for i in self.compressed]
        self.qs = [torch.rand((cols, rank), generator=generator) for _, cols in dims]
        self.p_shapes: list[Shape] = [(torch.Size((rows, rank)), torch.float32) for rows, _ in dims]

    def q_shapes(self) -> list[Shape]:
        """Phase Q's tensors: the Q matrices, then the tensors averaged whole."""
        return [(q.shape, q.dtype) for q in self.qs] + [self.shapes[i] for i in self.whole]

    @torch.no_grad()
    def phase_p(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This round's residuals (the last ones plus ``grads``) and this peer's P matrices (residual @ Q)."""
        residuals = [m + grads[i].to(m) for m, i in zip(self.ms, self.compressed, strict=True)]
        ps = [m.reshape(-1, q.shape[0]).to(q.dtype) @ q for m, q in zip(residuals, self.qs, strict=True)]
        return residuals, ps

    @torch.no_grad()
    def phase_q(self, residuals: Sequence[torch.Tensor], averaged_ps: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The group's P matrices orthogonalized, and this peer's phase-Q tensors (residual.T @ P, then the tensors
        averaged whole, contiguous: the round cuts them as flat views, and a parameter's gradient buffer keeps the
        parameter's strides)."""
        ps = [p.clone() for p in averaged_ps]
        for p in ps:
            orthogonalize_(p)
        qs = [m.reshape(-1, q.shape[0]).to(p.dtype).t() @ p for m, q, p in zip(residuals, self.qs, ps, strict=True)]
        return ps, qs + [grads[i].to("cpu", copy=True, memory_format=torch.contiguous_format) for i in self.whole]

    @torch.no_grad()
    def finish(self, residuals: Sequence[torch.Tensor], ps: Sequence[torch.Tensor],
               averaged: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Install a whole round: the group's gradients (P @ Q.T where compressed, the average where whole); the
        residuals keep what P @ Q.T leaves out; the group's Q becomes this peer's."""
        qs, whole = averaged[:len(self.qs)], averaged[len(self.qs):]
        out: list[Any] = [None] * len(self.shapes)
        for k, (i, m, p, q) in enumerate(zip(self.compressed, residuals, ps, qs, strict=True)):
            approximation = (p @ q.t()).reshape(m.shape).to(m.dtype)
            self.ms[k] = m - approximation
            out[i] = approximation
        for i, tensor in zip(self.whole, whole, strict=True):
            out[i] = tensor
        self.adopt_q(qs)
        return out

    @torch.no_grad()
    def adopt_q(self, qs: Sequence[torch.Tensor]) -> None:
        for mine, q in zip(self.qs, qs, strict=True):
            mine.copy_(q)


async def run_in_group(service: AveragingService, group_id: bytes, members: Sequence[Any], me: int,
                       tensors: Sequence[torch.Tensor], weight: float, fractions: Sequence[float],
                       timeout: float) -> tuple[list[torch.Tensor], RoundEvidence]:
    """One more all-reduce among the members of a round of ``service`` that just ran (no matchmaking: their
    membership was checked there), under its own ``group_id``, with the service's aggregation and timeouts.
    Runs in the service's event loop. A member's parts that come before this member registers the round wait
    (``REGISTRATION_WAIT`` in engine/allreduce.py)."""
    round_ = AllReduceRound(
        group_id=group_id, members=members, me=me, tensors=tensors, weight=weight, stub_for=service._stub_for,
        fractions=fractions, aggregate=AGGREGATES[service.aggregation], compression=service.compression,
        part_size_bytes=service.part_size_bytes, sender_timeout=service.sender_timeout,
        reducer_timeout=service.reducer_timeout)
    with service.servicer.registered(round_):
        return await round_.run(time.monotonic() + max(timeout, service.reducer_timeout))


class PowerSGDRound(GradientRound):
    """A PowerSGD round as the loop holds it (:class:`~collabopt.engine.gradient_rounds.GradientRound`'s interface).
    Handed its tensors (:meth:`allow_allreduce`, :meth:`tag_along`), it runs both phases after the last round;
    :meth:`result` is read as a plain round's, its evidence the two phases' (``received``: the lesser share)."""

    def __init__(self, rounds: PowerSGDRounds, scheduled: Any):
        super().__init__(rounds, scheduled)
        self.rounds: PowerSGDRounds = rounds
        self._phases: concurrent.futures.Future | None = None
        self._q_future: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._abandoned = self._finished = False

    @property
    def triggered(self) -> bool:
        return self._phases is not None or self.scheduled.triggered

    def allow_allreduce(self) -> None:
        with self.rounds.get_tensors() as buffers:
            grads = [buffer.detach().to("cpu", copy=True) for buffer in buffers]
        self._phases = self.rounds.submit(self._run, grads, self.weight)

    def tag_along(self) -> None:
        self.weight = 0.0
        self._phases = self.rounds.submit(self._run, None, 0.0)

    def done(self) -> bool:
        return self._phases.done() if self._phases is not None else self.scheduled.done()

    def cancel(self) -> None:
        self._give_up()
        self.scheduled.cancel()
        if self._q_future is not None:
            self._q_future.cancel()

    def _give_up(self) -> bool:
        """Whether the round was installed already; if not, it never will be (its residual stays as it was)."""
        with self._lock:
            self._abandoned = not self._finished
            return self._finished

    def _ended(self, timeout: float | None = None) -> AveragingResult:
        if self.evidence is None:
            if self._phases is None:  # (never handed its tensors: it failed or was cancelled first)
                self.evidence = self.scheduled.result(timeout)
                return self.evidence
            if timeout is None:
                timeout = 2 * (self.scheduled.timeout + self.rounds.service.reducer_timeout) + 30
            try:
                self.evidence = self._phases.result(timeout)
            except concurrent.futures.TimeoutError:
                if not self._give_up():
                    raise
                self.evidence = self._phases.result()
            except Exception as e:  # (a fault of this peer's round: it steps with its own gradients)
                self.evidence = AveragingResult(None, self.scheduled.group or (), {}, None,
                                                f"PowerSGD round failed: {e!r}")
        return self.evidence

    def _run(self, grads: list[torch.Tensor] | None, weight: float) -> AveragingResult:
        """Both phases (in :meth:`PowerSGDRounds.submit`'s thread). ``grads`` None: tag along (zeros, weight 0)."""
        state, me = self.rounds.powersgd, self.rounds.service.p2p.peer_id
        try:
            if grads is None:
                self.scheduled.tag_along()
            else:
                residuals, ps = state.phase_p(grads)
                self.scheduled.run(ps, weight)
        except RuntimeError:  # (cancelled before: the round ends without this member's tensors)
            return self.scheduled.result()
        first = self.scheduled.result()
        if first.tensors is None or first.evidence is None or first.error is not None:
            return first  # (no all-reduce ran: there is no phase Q to take part in)
        contributes = grads is not None and weight > 0 and protocol.sync_contributes(first.gathered.get(me),
                                                                                     first.gathered)
        if contributes and protocol.sync_gradients(first.evidence.received):
            ps, tensors = state.phase_q(residuals, first.tensors, grads)
        else:  # (this member's values are not the group's: it keeps the others' phase Q whole, with nothing)
            tensors, weight = [torch.zeros(shape, dtype=dtype) for shape, dtype in state.q_shapes()], 0.0
        try:
            outputs, second = self._phase_q(first, tensors, weight)
        except BaseException as e:
            return AveragingResult(None, first.group, first.gathered, None, f"PowerSGD's phase Q failed: {e!r}")
        if protocol.sync_gradients(second.received):  # (every member of a whole phase Q holds the same Q)
            state.adopt_q(outputs[:len(state.qs)])
        evidence = _both(first.evidence, second)
        with self._lock:
            installs = contributes and protocol.sync_gradients(evidence.received) and not self._abandoned
            self._finished = installs
            final = state.finish(residuals, ps, outputs) if installs else [t.clone() for t in grads or tensors]
        return AveragingResult(final, first.group, first.gathered, evidence)

    def _phase_q(self, first: AveragingResult, tensors: list[torch.Tensor],
                 weight: float) -> tuple[list[torch.Tensor], RoundEvidence]:
        service, evidence = self.rounds.service, first.evidence
        assert evidence is not None
        fractions = [1.0 if _reduces(first.gathered.get(peer)) else 0.0 for peer in evidence.members]
        self._q_future = asyncio.run_coroutine_threadsafe(run_in_group(
            service, evidence.group_id + b".Q", evidence.members, evidence.me, tensors, weight, fractions,
            self.scheduled.timeout), service._event_loop)
        return self._q_future.result(self.scheduled.timeout + service.reducer_timeout + 30)


def _reduces(entry: Any) -> bool:
    return not isinstance(entry, dict) or entry.get("reduces", True) is not False


def _both(first: RoundEvidence, second: RoundEvidence) -> RoundEvidence:
    """Phase Q's evidence, with the lesser share received and the parts refused in either phase."""
    refused = {s: tuple(a + b for a, b in zip(first.my_slice.get(s, (0, 0)), second.my_slice.get(s, (0, 0)),
                                              strict=True)) for s in set(first.my_slice) | set(second.my_slice)}
    return dataclasses.replace(second, received=min(first.received, second.received), my_slice=refused)


class PowerSGDRounds(GradientRounds):
    """A synchronous peer's gradient rounds with PowerSGD (see above): hivemind's ``averager_rank`` and
    ``min_compression_ratio``, and :class:`~collabopt.engine.gradient_rounds.GradientRounds`' other arguments.
    Where no tensor compresses, its rounds are plain ones."""

    def __init__(self, *, averager_rank: int, min_compression_ratio: float = 0.5, prefix: str,
                 parameters: Sequence[torch.Tensor], **kwargs: Any):
        parameters = tuple(parameters)
        self.powersgd = PowerSGDState([(p.shape, p.dtype) for p in parameters], averager_rank,
                                      min_compression_ratio, seed=seed_of(prefix))
        self._last: concurrent.futures.Future | None = None
        super().__init__(prefix=prefix, parameters=parameters, **kwargs)
        logger.info("collabopt: PowerSGD gradient rounds of rank %d: %d of %d tensors compressed, the others "
                    "averaged whole", averager_rank, len(self.powersgd.compressed), len(parameters))

    def schedule_step(self, timeout: float | None = None, gather: Any = None, **_: Any) -> GradientRound:
        if not self.powersgd.compressed:
            return super().schedule_step(timeout, gather)
        # every member learns which members reduce a slice (not client-mode ones): phase Q shares the vector alike
        gather = dict(gather if isinstance(gather, dict) else {}, reduces=not self.service.client_mode)
        scheduled = self.service.schedule(
            [torch.empty(shape, dtype=dtype) for shape, dtype in self.powersgd.p_shapes],
            timeout=timeout or self.allreduce_timeout, gather=gather,
            contributes=functools.partial(protocol.sync_contributes, gather),
            admits=functools.partial(protocol.sync_admits, gather))
        return PowerSGDRound(self, scheduled)

    def submit(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``function(*args)`` once the round submitted before it ended (each round reads the residual the last
        one left), in a daemon thread: a round's waits are bounded, and none holds up the process's exit."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        previous, self._last = self._last, future

        def run() -> None:
            if previous is not None:
                concurrent.futures.wait([previous])
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args))
                except BaseException as e:  # (the caller reads it from the future)
                    future.set_exception(e)

        threading.Thread(target=run, name="collabopt-powersgd", daemon=True).start()
        return future


# hivemind's PowerSGDGradientAverager options that collabopt's round takes (the loop's own are given by the loop)
POWERSGD_OPTIONS = frozenset({"averager_rank", "min_compression_ratio", "warn"})


def powersgd_options(factory: Callable[..., Any]) -> dict[str, Any] | None:
    """The options of a ``grad_averager_factory`` that is hivemind's ``PowerSGDGradientAverager`` (the class, or a
    ``functools.partial`` of it), for :class:`PowerSGDRounds`; None for any other factory. Raises
    :class:`~collabopt.errors.ConfigurationError` for options collabopt's round does not take."""
    func, args, keywords = factory, (), {}
    if isinstance(factory, functools.partial):
        func, args, keywords = factory.func, factory.args, dict(factory.keywords)
    # (no import of hivemind's module: it warns as it loads; a factory that is its class has loaded it)
    if func is not getattr(sys.modules.get("hivemind.optim.power_sgd_averager"), "PowerSGDGradientAverager", None):
        return None
    example = "functools.partial(PowerSGDGradientAverager, averager_rank=4)"
    if args:
        raise ConfigurationError("grad_averager_factory", "PowerSGDGradientAverager takes no positional arguments "
                                 "here (collabopt passes the parameters)", f"name its options: {example}")
    rank = keywords.get("averager_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigurationError("grad_averager_factory", f"PowerSGDGradientAverager needs averager_rank, an "
                                 f"integer >= 1 (got {rank!r})", f"give it one: {example}")
    accepted = POWERSGD_OPTIONS | set(inspect.signature(GradientRounds).parameters) - {"aggregation", "dht", "prefix",
                                                                                        "parameters"}
    unknown = sorted(set(keywords) - accepted)
    if unknown:
        raise ConfigurationError("grad_averager_factory", f"collabopt's PowerSGD round takes no "
                                 f"{', '.join(unknown)} of PowerSGDGradientAverager's options",
                                 "leave them out of the partial (it takes averager_rank and min_compression_ratio)")
    keywords.pop("warn", None)
    return keywords


__all__ = ["PowerSGDRound", "PowerSGDRounds", "PowerSGDState", "compresses", "powersgd_options", "run_in_group"]
