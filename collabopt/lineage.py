"""Which peers of an averaging group hold the same parameters: fingerprints and the group's canonical lineage.

Peers whose parameters came out of the same rounds hold the same values (an all-reduce gives every member the same
result, and the same update of the same state gives the same state). Peers that trained apart for a while (the two
sides of a healed partition) or averaged in different groups hold different ones, a *lineage* each; averaging
gradients together does not bring them back together. Each member of a round tells its group its epoch and a
fingerprint of its parameters (hivemind's ``gather``); every member then judges the same way which lineage is the
group's (:func:`judge`), and a peer that holds another one re-synchronizes from a peer that holds it.

A member also says whether it is *apart*: its last gradient round was partial (a reducer's share of the average
did not arrive and hivemind used the member's own values for it), so its parameters are its own. The group's lineage
is then chosen among the members whose last round was whole, and an apart member adopts it even when one peer
alone holds it.

    >>> import torch
    >>> a, b = [torch.ones(3)], [torch.full((3,), 2.0)]
    >>> group = {"p1": {"epoch": 4, "lineage": fingerprint(a)}, "p2": {"epoch": 4, "lineage": fingerprint(a)},
    ...          "p3": {"epoch": 4, "lineage": fingerprint(b)}}
    >>> canonical_peers(group, epoch=4)
    ['p1', 'p2']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

FINGERPRINT_TOLERANCE = 1e-6  # relative: fingerprints that agree to this belong to the same parameters


FINGERPRINT_BLOCK = 256  # elements summed in the tensors' precision (float32 at least) before the sums go float64
FINGERPRINT_CHUNK = 1 << 20  # elements per pass: the temporary |x| and x**2 stay small


@torch.no_grad()
def fingerprint(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Sum, sum of magnitudes and sum of squares of ``tensors``: equal tensors give equal fingerprints (to rounding),
    different ones practically never do.

    Blocks of :data:`FINGERPRINT_BLOCK` elements are summed in the tensors' precision (float32 at least; rounding
    typically 1e-8 of a block's magnitude, a few 1e-7 at worst: under :data:`FINGERPRINT_TOLERANCE`), the blocks'
    sums in float64; when float32 overflows (values beyond ~1e19) everything is summed in float64. Summing every
    element in float64 cost ten times as much (47 ms against 5 ms for 4.5M parameters on one core, and several times
    that at a round's boundary on a busy machine), on the main thread at every round. (``torch.linalg.vector_norm``
    sums without cascading: 3e-5 off on a constant tensor.)"""
    totals: dict[torch.device, torch.Tensor] = {}
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        accumulate = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
        whole = flat.numel() // FINGERPRINT_BLOCK * FINGERPRINT_BLOCK
        parts = [_three_sums(flat[whole:].to(torch.float64))]
        for start in range(0, whole, FINGERPRINT_CHUNK):
            blocks = flat[start:min(whole, start + FINGERPRINT_CHUNK)].view(-1, FINGERPRINT_BLOCK).to(accumulate)
            parts.append(_three_sums(blocks).to(torch.float64).sum(dim=-1))
        sums = torch.stack(parts).sum(dim=0)
        totals[sums.device] = totals[sums.device] + sums if sums.device in totals else sums
    if not totals:
        return [0.0, 0.0, 0.0]
    result = [float(x) for x in sum(t.cpu() for t in totals.values()).tolist()]
    if not all(math.isfinite(x) for x in result):  # float32 overflowed, or the values are not finite
        result = _fingerprint_float64(tensors)
    return result


def _three_sums(x: torch.Tensor) -> torch.Tensor:
    """Sum, sum of magnitudes and sum of squares along the last dimension (stacked first)."""
    return torch.stack([x.sum(dim=-1), x.abs().sum(dim=-1), x.square().sum(dim=-1)])


def _fingerprint_float64(tensors: Sequence[torch.Tensor]) -> list[float]:
    totals = [0.0, 0.0, 0.0]
    for tensor in tensors:
        t = tensor.detach()
        if t.numel():
            sums = (t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, 1, dtype=torch.float64),
                    torch.linalg.vector_norm(t, 2, dtype=torch.float64).square())
            totals = [a + float(b) for a, b in zip(totals, sums, strict=True)]
    return totals


def same_fingerprint(a: Sequence[float], b: Sequence[float], tolerance: float = FINGERPRINT_TOLERANCE) -> bool:
    if len(a) != 3 or len(b) != 3 or not all(math.isfinite(x) for x in (*a, *b)):
        return False
    scale = max(abs(a[1]), abs(b[1]), 1e-30)
    return (abs(a[0] - b[0]) <= tolerance * scale and abs(a[1] - b[1]) <= tolerance * scale
            and abs(a[2] - b[2]) <= tolerance * max(a[2], b[2], 1e-30))


def valid_fingerprint(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 3
            and all(isinstance(x, float) and math.isfinite(x) for x in value))


def canonical_peers(group: Mapping[Hashable, Any], epoch: int, key: str = "lineage") -> list[Hashable]:
    """The members of ``group`` (``{peer: {"epoch": int, key: fingerprint}}``) at ``epoch`` that hold the group's
    canonical lineage: the fingerprint most of them hold, ties going to the smallest fingerprint, so that every
    member that sees the same group picks the same one. Members at other epochs, and malformed metadata (a peer
    running plain hivemind gathers ``None``), take no part; the result keeps ``group``'s order."""
    entries = [(peer, list(m[key])) for peer, m in group.items()
               if isinstance(m, dict) and m.get("epoch") == epoch and isinstance(m.get("epoch"), int)
               and valid_fingerprint(m.get(key))]
    clusters: list[list[tuple[Hashable, list[float]]]] = []
    for peer, value in sorted(entries, key=lambda entry: entry[1]):
        for cluster in clusters:
            if same_fingerprint(cluster[0][1], value):
                cluster.append((peer, value))
                break
        else:
            clusters.append([(peer, value)])
    if not clusters:
        return []
    chosen = {peer for peer, _ in max(clusters, key=len)}  # max() keeps the first of equal sizes: the smallest
    return [peer for peer in group if peer in chosen]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A member's judgement of its round (:func:`judge`). ``reason``: ``"holds"`` (it holds the group's lineage;
    ``peers`` is empty), else why it downloads the state of one of ``peers``: ``"lineage"`` (most of its epoch's
    members hold another one), ``"apart"`` (its own last round was partial), ``"nonfinite"`` (its parameters are
    not) or ``"behind"`` (the group's newest epoch is ahead of its own)."""

    peers: list[Hashable]
    reason: str


def judge(group: Mapping[Hashable, Any], me: Hashable, key: str = "lineage") -> Verdict | None:
    """How ``me``, a member of ``group`` (``{peer: {"epoch": int, key: fingerprint, "serves": bool, "apart":
    bool}}``, what every member gathered), stands to the group's lineage; None if nothing can be judged (its
    metadata is missing) or nothing should be done. Every member that sees the same group judges the same way.

    A peer behind (at an older epoch than the group's newest, which has at least as many members as its own: one
    peer alone ahead of several does not pull them) looks at the newest epoch's members; any other peer at its own
    epoch's. Among those, the lineage is the fingerprint most of the members whose last round was whole hold (all of
    them if none was; :func:`canonical_peers`). ``me`` holds it if its fingerprint is that one; else it adopts it when

    - it is behind: it missed a round;
    - it is apart (its last round was partial) or its parameters are not finite: they are its own, whoever holds
      the lineage;
    - otherwise, when two or more members hold it: a lineage of one peer is no majority (with lossy gradient
      compression no two peers are bit-identical, each keeps its own part of a round uncompressed).

    Only members that serve their state (not client-mode) are sources; a lineage no one can serve is not adopted.

        >>> import torch
        >>> a, b = fingerprint([torch.ones(3)]), fingerprint([torch.zeros(3)])
        >>> group = {"p1": {"epoch": 4, "lineage": a, "serves": True},
        ...          "p2": {"epoch": 4, "lineage": b, "serves": True, "apart": True}}
        >>> judge(group, "p2")
        Verdict(peers=['p1'], reason='apart')
        >>> judge(group, "p1")
        Verdict(peers=[], reason='holds')
    """
    mine = group.get(me)
    if not isinstance(mine, dict) or type(mine.get("epoch")) is not int:
        return None
    valid = {peer: m for peer, m in group.items() if isinstance(m, dict) and type(m.get("epoch")) is int
             and valid_fingerprint(m.get(key))}
    newest = max([m["epoch"] for m in valid.values()], default=mine["epoch"])
    at_mine = sum(1 for m in group.values() if isinstance(m, dict) and m.get("epoch") == mine["epoch"])
    behind = mine["epoch"] < newest and sum(1 for m in valid.values() if m["epoch"] == newest) >= at_mine
    epoch = newest if behind else mine["epoch"]
    members = {peer: m for peer, m in valid.items() if m["epoch"] == epoch}
    whole = {peer: m for peer, m in members.items() if not m.get("apart")}
    canonical = canonical_peers(whole or members, epoch, key=key)
    if not canonical:
        return None
    finite = valid_fingerprint(mine.get(key))
    if finite and same_fingerprint(mine[key], valid[canonical[0]][key]):
        return Verdict(peers=[], reason="holds")  # (one epoch behind by its count only: rounds keep it in sync)
    if behind:
        reason: str | None = "behind"
    elif not finite:
        reason = "nonfinite"
    elif mine.get("apart"):
        reason = "apart"
    else:
        reason = "lineage" if len(canonical) >= 2 else None
    if reason is None or not any(valid[peer].get("serves") for peer in canonical):
        return None
    return Verdict(peers=canonical, reason=reason)


def verdict_text(verdict: Verdict, group: Mapping[Hashable, Any], epoch: int) -> str:
    """What the log (and the round outcome's detail) says of a ``verdict`` of a member at ``epoch``."""
    newest = group[verdict.peers[0]]["epoch"]
    if verdict.reason == "behind":
        return (f"this peer is at epoch {epoch}, {len(verdict.peers)} peer(s) of its gradient round at epoch "
                f"{newest} (it missed a round)")
    if verdict.reason == "apart":
        return (f"this peer's last gradient round was partial, so its parameters are its own; {len(verdict.peers)} "
                f"peer(s) of its gradient round at epoch {epoch} hold the group's")
    if verdict.reason == "nonfinite":
        return (f"this peer's parameters are not finite; {len(verdict.peers)} peer(s) of its gradient round at epoch "
                f"{epoch} hold the group's")
    peers_at_epoch = sum(1 for m in group.values() if isinstance(m, dict) and m.get("epoch") == epoch)
    return (f"this peer's parameters differ from those of {len(verdict.peers)} of the {peers_at_epoch} peers of its "
            f"gradient round at epoch {epoch} (they trained apart, e.g. across a network partition)")


__all__ = ["FINGERPRINT_TOLERANCE", "Verdict", "canonical_peers", "fingerprint", "judge", "same_fingerprint",
           "valid_fingerprint", "verdict_text"]
