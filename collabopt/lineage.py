"""Which peers of an averaging group hold the same parameters: fingerprints and the group's canonical lineage.

Peers whose parameters came out of the same rounds hold the same values (an all-reduce gives every member the same
result, and the same update of the same state gives the same state). Peers that trained apart for a while (the two
sides of a healed partition) or averaged in different groups hold different ones, a *lineage* each; averaging
gradients together does not bring them back together. Each member of a round tells its group its epoch and a
fingerprint of its parameters (hivemind's ``gather``); every member then judges the same way which lineage is the
group's (:func:`canonical_peers`), and a peer that holds another one re-synchronizes from a peer that holds it.

    >>> import torch
    >>> a, b = [torch.ones(3)], [torch.full((3,), 2.0)]
    >>> group = {"p1": {"epoch": 4, "lineage": fingerprint(a)}, "p2": {"epoch": 4, "lineage": fingerprint(a)},
    ...          "p3": {"epoch": 4, "lineage": fingerprint(b)}}
    >>> canonical_peers(group, epoch=4)
    ['p1', 'p2']
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

FINGERPRINT_TOLERANCE = 1e-6  # relative: fingerprints that agree to this belong to the same parameters


@torch.no_grad()
def fingerprint(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Sum, sum of magnitudes and sum of squares of ``tensors`` (in float64, without float64 copies): equal
    tensors give equal fingerprints (to rounding), different ones practically never do."""
    sums = [torch.stack([t.detach().sum(dtype=torch.float64),
                         torch.linalg.vector_norm(t.detach(), 1, dtype=torch.float64),
                         torch.linalg.vector_norm(t.detach(), 2, dtype=torch.float64).square()]).cpu()
            for t in tensors]
    if not sums:
        return [0.0, 0.0, 0.0]
    return [float(x) for x in torch.stack(sums).sum(dim=0).tolist()]


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


__all__ = ["FINGERPRINT_TOLERANCE", "canonical_peers", "fingerprint", "same_fingerprint", "valid_fingerprint"]
