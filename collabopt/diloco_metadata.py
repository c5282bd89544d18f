"""What a DiLoCo peer tells its group when matchmaking, and whose anchor is the group's.

Each member of a round sends its epoch and a fingerprint of its anchor (the parameters after its last round; see
:func:`collabopt.lineage.fingerprint`). A round is applied only by the peers that hold the group's canonical anchor:
the newest epoch, then the anchor most peers of that epoch hold; a peer with another one re-synchronizes instead
(:meth:`collabopt.diloco.DiLoCo.run_round`).

    >>> import torch
    >>> mine = anchor_metadata(3, [torch.ones(4)])
    >>> agrees_with_group(mine, [mine, anchor_metadata(2, [torch.zeros(4)])])
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from collabopt.lineage import canonical_peers, fingerprint, same_fingerprint


def anchor_metadata(epoch: int, anchors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """This peer's part of its group's metadata: its epoch and its anchor's fingerprint."""
    return {"epoch": int(epoch), "anchor": fingerprint(anchors)}


def agrees_with_group(mine: dict[str, Any], group: list[Any]) -> bool:
    """Whether this peer's anchor is the group's canonical one: the newest epoch, then the anchor most peers of
    that epoch hold (ties: the smallest fingerprint). Malformed metadata of other peers is ignored."""
    entries = [m for m in group if _valid_metadata(m)]
    if not entries:
        return True
    top = max(m["epoch"] for m in entries)
    canonical = canonical_peers(dict(enumerate(entries)), top, key="anchor")
    return (mine["epoch"] == top and bool(canonical)
            and same_fingerprint(mine["anchor"], min(list(entries[i]["anchor"]) for i in canonical)))


def _valid_metadata(metadata: Any) -> bool:
    return (isinstance(metadata, dict) and isinstance(metadata.get("epoch"), int)
            and isinstance(metadata.get("anchor"), (list, tuple)) and len(metadata["anchor"]) == 3
            and all(isinstance(x, float) for x in metadata["anchor"]))
