"""When a DiLoCo peer downloads the swarm's state before its next step, and how often it stores its progress record
(:mod:`collabopt.diloco` re-exports both; :class:`collabopt.engine.diloco_round.DiLoCoLoop` asks them)."""

from __future__ import annotations

from typing import Any

from collabopt.engine import protocol

REPORT_SHARE = 0.25  # a DiLoCo peer stores its progress record at most once per this share of a round
MAX_REPORT_PERIOD = 30.0  # seconds: DiLoCo's default max_refresh_period (records live 60 s, renewed at half of it)


def step_decision(diloco: Any, local_epoch: int, global_epoch: int) -> protocol.StepDecision:
    """Whether a peer (``diloco``: its :class:`collabopt.diloco.DiLoCo`) downloads the swarm's state before its next
    step, and why (:func:`collabopt.engine.protocol.diloco_step`): its anchor disagreed with its group's, or the
    swarm is past its epoch, unless (``overlap_rounds``) the others started the round it trained toward."""
    return protocol.diloco_step(protocol.DiLoCoStepEvidence(
        protocol.SwarmView(local_epoch, global_epoch), needs_sync=diloco.needs_sync, overlap=diloco.overlap,
        trained=diloco.pending_samples > 0))


def should_download(diloco: Any, local_epoch: int, global_epoch: int) -> bool:
    """Whether a peer downloads the swarm's state before its next step: its anchor disagreed with its group's, or
    the swarm is past its epoch (hivemind tolerates one epoch; an anchor one round old is stale). With
    ``overlap_rounds`` the others' epoch moves when they *start* a round: a peer one epoch behind that trained
    toward that round starts it too (and joins their group) instead; if it missed the round, its own one fails and
    it downloads then. The rule: :func:`collabopt.engine.protocol.diloco_step`.

        >>> import torch
        >>> from collabopt.diloco import DiLoCo
        >>> diloco = DiLoCo(torch.optim.SGD([torch.zeros(1)], lr=1.0), overlap=True)
        >>> diloco.pending_samples = 64
        >>> should_download(diloco, 3, 4)
        False
    """
    return step_decision(diloco, local_epoch, global_epoch).download


def report_period(last_round_seconds: float | None, min_period: float, max_period: float) -> float:
    """How long a DiLoCo peer waits between two stores of its progress record (a change of epoch goes out at once).

    Each store is a signed DHT record sent to each of its key's replicas, and every fetch of the swarm's progress
    reads every peer's record from several of them; with long rounds these requests were most of what a compressed
    DiLoCo peer sent besides its payload (B6). Others extrapolate a record with its samples per second, and a peer
    fetches more often as the round's end nears, so a long round needs few: one per ``REPORT_SHARE`` of the last
    round, within ``[min_period, max_period]`` (DiLoCo's default ``max_period``, :data:`MAX_REPORT_PERIOD`, is the
    half-life of a record, when it is renewed anyway).

        >>> report_period(None, 0.5, 30.0), report_period(1.0, 0.5, 30.0), report_period(40.0, 0.5, 30.0)
        (0.5, 0.5, 10.0)
    """
    if last_round_seconds is None:
        return min_period
    return min(max_period, max(min_period, REPORT_SHARE * last_round_seconds))


__all__ = ["MAX_REPORT_PERIOD", "REPORT_SHARE", "report_period", "should_download", "step_decision"]
