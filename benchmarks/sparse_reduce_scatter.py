"""What a round of compressed DiLoCo sends with ``SparseLoCo()``'s defaults: the all-gather of its contributors'
payloads, and the reduce-scatter of their sparse parts it is compared with (:mod:`benchmarks.sparse_scale`'s
estimates). Byte counts from the codec's payload lengths; no swarm."""

from __future__ import annotations


def contributors(n: int) -> int:
    """How many members of a group of ``n`` contribute a payload each round at ``SparseLoCo()``'s defaults."""
    from collabopt.diloco_options import SparseLoCo

    limit = SparseLoCo().max_contributors
    return n if limit is None else min(n, limit)


def independent_union(n: int, density: float) -> float:
    """The share of entries some member keeps when each keeps ``density`` of them independently of the others."""
    return 1.0 - (1.0 - density) ** n


def reduce_scatter_bytes(n: int, numel: int, union: float, bits: int, k: int | None = None) -> dict[str, float]:
    """What a peer sends a round, on average over the ``n`` members of which ``k`` contribute (default: all), in an
    all-gather of ``SparseLoCo()`` payloads (``k (n - 1) / n P``) and in a reduce-scatter of their parts (each of
    the ``n`` reducers gets every contributor's ``1/n`` slice, then sends its reduced slice to the ``n - 1`` others:
    ``(n - 1) / n (k / n P + R)``), where ``R``, the reduced whole, keeps the ``union`` of the contributors' entries
    at ``bits`` bits in the same format (longest payloads both)."""
    from collabopt.diloco_options import SparseLoCo
    from collabopt.sparse_codec import SparseCodec

    codec = SparseLoCo().codec
    p = codec.payload_bytes(numel)
    r = SparseCodec(density=min(1.0, union), chunk_size=codec.chunk_size, bits=bits).payload_bytes(numel)
    k = n if k is None else k
    return dict(all_gather=k * (n - 1) / n * p, reduce_scatter=(n - 1) / n * (k / n * p + r),
                reduced_over_payload=r / p)


def break_even(numel: int, bits: int, density: float, largest: int = 64) -> int | None:
    """The smallest group size from which the reduce-scatter sends less than the all-gather, for independent
    unions (:func:`independent_union`, what the benchmark's simulated pseudo-gradients give), both with
    ``SparseLoCo()``'s contributors a round (:func:`contributors`)."""
    for n in range(2, largest + 1):
        k = contributors(n)
        b = reduce_scatter_bytes(n, numel, independent_union(k, density), bits, k)
        if b["reduce_scatter"] < b["all_gather"]:
            return n
    return None
