"""How a round cuts its tensors: into slices, one a member (by the group's fractions), and the slices into parts.

Rules, and why:

* hivemind's ``TensorPartContainer`` does the cutting (and serializes the parts in the round's compression). It gives
  a slice whole parts, which misses the slice's fraction by up to a part, and a member's traffic grows with its slice:
  so a tensor that a slice ends inside is cut there first (:func:`cut_at_slice_ends`), and each slice holds its
  fraction of the elements, to one element (docs/decisions.md, "Slices of exactly their fraction").
* A tensor with no element is in no slice: the container would give its empty part to whichever member it had
  reached, a client (fraction 0) too, and every sender would then try to reach that member.
* Each piece keeps its tensor's compression info (its key, its role and its whole shape), so an adaptive compression
  chooses for a piece's parts as it does for its tensor's. A round's infos default to hivemind's averager's (the
  tensor's index as key, no role); a parameter round passes hivemind's state averager's (roles: parameter,
  optimizer statistic), so that a ``RoleAdaptiveCompression`` compresses each as hivemind would.
* Every member cuts alike (the same arithmetic on the same fractions and shapes); the round's matchmaking key names
  this layout (:mod:`collabopt.engine.round_schema`), so members that cut otherwise never meet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression.adaptive import AdaptiveCompressionBase

# in the matchmaking key: the layout every member of a round shares
LAYOUT = "slices end inside tensors; a tensor with no element is in no slice"


def cut_at_slice_ends(tensors: Sequence[torch.Tensor], fractions: Sequence[float]
                      ) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors, each one that a slice ends inside cut there into flat views (the others as they are, and those
    with no element left out: the container would give their empty part to a member, a client's too); and, per piece,
    the index of its tensor. The slices' ends are the container's own: the same arithmetic on the fractions."""
    total = sum(tensor.numel() for tensor in tensors)
    ends = (np.cumsum(fractions) / np.sum(fractions) * total).astype(np.int64)
    ends[-1] = total
    pieces: list[torch.Tensor] = []
    owners: list[int] = []
    start = 0
    for index, tensor in enumerate(tensors):
        size = tensor.numel()
        if size == 0:
            continue
        cuts = sorted({int(end) - start for end in ends if start < end < start + size})
        if cuts:
            flat = tensor.detach().view(-1)
            pieces += [flat[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
        else:
            pieces.append(tensor)
        owners += [index] * (len(cuts) + 1)
        start += size
    return pieces, owners


class Slices:
    """A round's tensors in slices and parts: ``container`` (hivemind's) holds the pieces of
    :func:`cut_at_slice_ends`; :meth:`whole` puts the container's outputs back into the tensors' shapes."""

    def __init__(self, tensors: Sequence[torch.Tensor], fractions: Sequence[float], compression: CompressionBase,
                 part_size_bytes: int, prefetch: int, infos: Sequence[CompressionInfo] | None = None):
        if infos is None:
            infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
        if len(infos) != len(tensors):
            raise ValueError(f"{len(infos)} compression infos for {len(tensors)} tensors: give one per tensor")
        pieces, self.owners = cut_at_slice_ends(tensors, fractions)
        self.shapes = [tensor.shape for tensor in tensors]
        self.dtypes = [tensor.dtype for tensor in tensors]
        self.container = TensorPartContainer(pieces, fractions, compression=compression,
                                             tensor_infos=[infos[owner] for owner in self.owners],
                                             part_size_bytes=part_size_bytes, return_deltas=False, prefetch=prefetch)

    def whole(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors from the container's outputs (one per piece, in order; an empty tensor for one with no
        element)."""
        by_tensor: list[list[torch.Tensor]] = [[] for _ in self.shapes]
        for owner, piece in zip(self.owners, pieces, strict=True):
            by_tensor[owner].append(piece)
        return [torch.empty(shape, dtype=dtype) if not parts else parts[0] if len(parts) == 1 else
                torch.cat(parts).view(shape) for parts, shape, dtype in zip(by_tensor, self.shapes, self.dtypes,
                                                                             strict=True)]

    def layout(self) -> list[tuple[int, int]]:
        """Every part, in order, as the container cuts and compresses it: its compression type (an adaptive
        compression chooses by the part's info only) and its number of elements."""
        container, compression, layout = self.container, self.container.compression, []
        for tensor, info, count in zip(container.local_tensors, container.tensor_infos, container.num_parts_by_tensor,
                                       strict=True):
            ratio = compression.estimate_compression_ratio(info)
            size = int(container.part_size_bytes / (tensor.element_size() * ratio))
            for i in range(count):
                chosen = compression
                while isinstance(chosen, AdaptiveCompressionBase):
                    chosen = chosen.choose_compression(info.get_part(i, size))
                layout.append((int(chosen.compression_type), min(size, tensor.numel() - i * size)))
        return layout
