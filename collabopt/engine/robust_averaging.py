"""The ``aggregation`` option (issue 35; docs/design/trust.md, section 4): what every averaging round of a peer
(gradients, DiLoCo's pseudo-gradients, parameters) gets for it. ``"centered_clip"``: collabopt's part reducers
resolve each part with CenteredClip over the senders' parts and capped weights (:mod:`collabopt.robust`,
:class:`collabopt.engine.part_reducer.ClipPart`), in groups of at least :data:`~collabopt.engine.clipping.
MIN_CLIPPED_GROUP`; every member reduces an equal share of the vector, so no bandwidth claim buys a larger one.
"""

from __future__ import annotations

from typing import Any

from collabopt.engine.clipping import MIN_CLIPPED_GROUP

AGGREGATIONS = ("mean", "centered_clip")  # the values of the aggregation option (the first one is the default)


def aggregation_options(aggregation: str) -> dict[str, Any]:
    """The keyword arguments every collabopt averaging round of a peer gets for ``aggregation``: none for
    ``"mean"``; for ``"centered_clip"`` that aggregation and its smallest group, so that neither a member's values
    nor its sample claim moves a round further than the caps allow. The members of a swarm must all choose the
    same (the matchmaking key holds it: peers that differ never form a group)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "mean":
        return {}
    return dict(aggregation="centered_clip", min_group_size=MIN_CLIPPED_GROUP)


__all__ = ["AGGREGATIONS", "aggregation_options"]
