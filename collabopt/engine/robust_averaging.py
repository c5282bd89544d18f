"""Robust aggregation at hivemind's averaging seams (issue 35; docs/design/trust.md, section 4).

* :class:`ClippingTensorPartReducer`: a part reducer that resolves each part of an all-reduce with CenteredClip
  over the senders' parts and capped weights (:mod:`collabopt.robust`) instead of their weighted mean.
* :func:`cap_bandwidths`: caps the bandwidths gathered in matchmaking before hivemind shares the vector out by them,
  so that one member's claim cannot make it the reducer of the whole vector; :func:`cap_gathered_bandwidths` does
  it on a group's gathered data.

* :func:`aggregation_options`: what every averager of a peer (gradients, DiLoCo's pseudo-gradients, parameters)
  gets for ``aggregation="centered_clip"``: that reducer and that cap (``ShieldedReducers`` installs them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from hivemind.averaging.allreduce import AveragingMode
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer

from collabopt.engine.averaging import ShieldedTensorPartReducer
from collabopt.engine.clipping import MIN_CLIPPED_GROUP, WEIGHT_CAP, ClippedPart

logger = get_logger(__name__)

AGGREGATIONS = ("mean", "centered_clip")  # the values of the aggregation option (the first one is the default)
# a member's bandwidth is capped at this many times the median positive bandwidth of its group (cap_bandwidths)
BANDWIDTH_CAP = 1.0


class ClippingTensorPartReducer(ShieldedTensorPartReducer):
    """A part reducer whose result for each part is CenteredClip of the senders' parts, each sender's weight capped
    at :attr:`weight_cap` times the median (see :class:`ClippedPart`), instead of their weighted mean.

    Why: with the mean, one member sending finite hostile values (its gradients times -20, noise) moves every part
    as far as it likes, and a claim of 1,000x its samples makes its part the result. The clip bounds a member's
    pull by its capped weight share times the radius (:func:`collabopt.robust.centered_clip`).

    The design: hivemind's ``reset_accumulators`` makes a zeroed tensor for each part, replaced here by a
    :class:`ClippedPart`; every other step is hivemind's (and :class:`ShieldedTensorPartReducer`'s), no method
    body is copied. Memory: the part's senders' parts (senders x part size, float32) instead of one part-sized sum.
    CPU: up to ``collabopt.robust.ITERATIONS`` passes over them, in the event loop, as the last sender's part
    arrives. ``weight_cap`` is a class attribute: hivemind's all-reduce builds reducers with shapes and senders
    only."""

    weight_cap: float = WEIGHT_CAP

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():  # (hivemind made a zeroed sum for the next part)
            self.accumulator = ClippedPart(self.part_shapes[self.current_part_index], self.weight_cap)


def cap_bandwidths(bandwidths: Sequence[float | None], factor: float = BANDWIDTH_CAP) -> list[float | None]:
    """The group's gathered bandwidths, each capped at ``factor`` times the median of the positive ones, for
    hivemind's ``load_balance_peers``: every member computes the same shares from the same gathered list.

    Why: hivemind gives each member a share of the vector to reduce by the bandwidth it claims, and a member
    reduces its share alone (CenteredClip cannot help there): ``load_balance_peers(10**6, [100, 100, 100, 1e9])``
    is ``(0, 0, 0, 1000000)``. The default factor is 1: hivemind's balancing amplifies any excess, in a group of
    4 a member at 2x the others' bandwidth reduces 70% of the vector, at 1.5x 50%. Capped at the median a claim
    gets at most the share of the members at the median or above, at most 2/n of the vector in a group of n with
    fewer than half of its members hostile; the price is that honest members faster than the median are used as
    if they were not.

    Bandwidth 0 (client-mode members, which hivemind sets to 0 itself: the caller zeroes them first) stays 0 and
    does not count toward the median; ``None`` (not specified: hivemind takes the mean of the others) stays
    ``None``. A negative, NaN or non-number claim becomes 0 (hivemind's balancing would fail on it, failing the
    round for every member); infinity is capped like any other claim."""
    if not factor >= 1.0:
        raise ValueError(f"factor must be >= 1 (below it the median member is capped too), got {factor}")
    values: list[float | None] = []
    for bandwidth in bandwidths:
        if bandwidth is None:
            values.append(None)
            continue
        value = float(bandwidth) if isinstance(bandwidth, (int, float)) and not isinstance(bandwidth, bool) else 0.0
        values.append(value if value > 0.0 else 0.0)  # (NaN > 0 is False)
    positive = [value for value in values if value is not None and value > 0.0]
    if not positive:
        return values
    cap = factor * statistics.median(positive)
    if not math.isfinite(cap):  # (most claims infinite: no finite cap; hivemind's balancing fails on infinity)
        cap = max([value for value in positive if math.isfinite(value)], default=1.0)
    return [None if value is None else min(value, cap) for value in values]


def cap_gathered_bandwidths(gathered: Sequence[bytes], serializer: Any = MSGPackSerializer,
                            factor: float = BANDWIDTH_CAP) -> tuple[bytes, ...]:
    """A group's gathered data (hivemind's ``GroupInfo.gathered``: each member's serialized ``[bandwidth, mode,
    metadata]``) with the bandwidths capped by :func:`cap_bandwidths`, for ``dataclasses.replace(group_info,
    gathered=...)`` before hivemind's ``_aggregate_with_group`` shares the vector out.

    Clients' bandwidths are set to 0 first (hivemind sets them to 0 only as it shares the vector out), so that a
    client's claim does not move the median. A member's entry is re-serialized only where its bandwidth changes, its
    mode and metadata as they were. Data that cannot be read is returned as it is: hivemind refuses it as before.
    Every member of the group must cap alike, or their shares differ and the round fails."""
    try:
        entries = [serializer.loads(data) for data in gathered]
        if not all(isinstance(entry, (list, tuple)) and len(entry) == 3 for entry in entries):
            return tuple(gathered)
        clients = [AveragingMode(entry[1]) == AveragingMode.CLIENT for entry in entries]
    except Exception:  # (malformed gathered data: hivemind's own reading of it fails the round, as without a cap)
        return tuple(gathered)
    claims = [0.0 if client else entry[0] for entry, client in zip(entries, clients, strict=True)]
    capped = cap_bandwidths(claims, factor)
    return tuple(data if bandwidth == entry[0] else serializer.dumps([bandwidth, entry[1], entry[2]])
                 for data, entry, bandwidth in zip(gathered, entries, capped, strict=True))


def aggregation_options(aggregation: str) -> dict[str, Any]:
    """The keyword arguments every collabopt averager (:class:`~collabopt.engine.averaging.ShieldedReducers`) of a
    peer gets for ``aggregation``: none for ``"mean"`` (hivemind's weighted mean, collabopt's shielded reducer, the
    bandwidths as claimed); for ``"centered_clip"`` the :class:`ClippingTensorPartReducer` and
    :func:`cap_gathered_bandwidths`, so that neither a member's values, nor its sample claim, nor its bandwidth
    claim moves a round further than the caps allow. The members of a swarm must all choose the same."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "mean":
        return {}
    return dict(part_reducer=ClippingTensorPartReducer, cap_gathered=cap_gathered_bandwidths,
                min_group_size=MIN_CLIPPED_GROUP)
