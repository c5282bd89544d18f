"""The key under which collabopt's averaging service assembles groups: what every member of a round must share.

Rules, and why:

* The key hashes the tensors' shapes and dtypes (hivemind's ``compute_schema_hash``) together with the compression
  (its class and settings, nested compressions included), the part size, the aggregation and the way a round cuts
  its tensors into slices (:data:`collabopt.engine.slices.LAYOUT`), and the tensors' compression keys and roles where
  a round gives them (an adaptive compression chooses by them). Members that differ in any of these would cut,
  serialize or reduce the same part differently and silently end apart; under different keys they never form a
  group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.averager import compute_schema_hash
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.dht.routing import DHTID

from collabopt.engine.slices import LAYOUT


def describe(value: Any) -> Any:
    """A msgpack-able description of ``value`` (a compression: its class and its settings, recursively)."""
    if isinstance(value, CompressionBase):
        return [f"{type(value).__module__}.{type(value).__qualname__}",
                {str(name): describe(setting) for name, setting in sorted(vars(value).items())}]
    if isinstance(value, dict):
        return sorted(([describe(k), describe(v)] for k, v in value.items()), key=repr)
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return repr(value)


def round_schema(shapes: Sequence[tuple[torch.Size, torch.dtype]], compression: CompressionBase,
                 part_size_bytes: int, aggregation: str, infos: Sequence[CompressionInfo] | None = None) -> bytes:
    """The matchmaking key of a round of tensors of ``shapes`` (shape, dtype) with these settings (``infos``: the
    tensors' compression infos, where the round gives them)."""
    if infos is not None and len(infos) != len(shapes):
        raise ValueError(f"{len(infos)} compression infos for {len(shapes)} tensors: give one per tensor")
    tensors = compute_schema_hash([torch.empty(shape, dtype=dtype) for shape, dtype in shapes])
    source = [tensors, describe(compression), int(part_size_bytes), aggregation, LAYOUT]
    if infos is not None:
        source.append([[describe(info.key), int(info.role.value)] for info in infos])
    return DHTID.generate(source=source).to_bytes()
