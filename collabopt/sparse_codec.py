"""The wire format of a compressed DiLoCo pseudo-gradient: the top-k of each chunk, its values at a few bits.

:class:`SparseCodec` flattens a list of tensors into one float32 vector, splits it into chunks of ``chunk_size``
(the last one may be shorter) and keeps, of each chunk, the ``k`` entries of largest magnitude (``k`` = ``density``
times the chunk's length, at least 1; SparseLoCo, arXiv 2508.15706, keeps 1-3%). A kept value travels as its sign and
a ``bits - 1``-bit magnitude level, one of ``2**(bits - 1)`` evenly spaced levels fitted to the chunk (two float32
per chunk, the lowest and the highest level: the per-chunk scale). Its position travels as a gap: the indices of a
chunk ascend, and gap ``g_0 = i_0``, ``g_j = i_j - i_(j-1) - 1``, in a Rice code of parameter ``r`` (``q = g >> r``
in unary, then the ``r`` low bits). ``r`` follows from the settings (:attr:`SparseCodec.rice_parameter`): 5 for the
defaults, about 7.1 bits a gap on Gaussian chunks and on an AdamW pseudo-gradient, where a packed index takes 12.
One input has one encoding (``r`` fixed, unary canonical), and a gap cannot repeat an index.

Layout (little-endian), every length fixed by the header and the receiver's shapes::

    header     magic "CLSP", version u8, bits u8, 2 zero bytes, chunk_size u32, k u32, numel u64,
               unary_bits u64 (L)                                                              (32 bytes)
    scales     per chunk: lowest and highest magnitude level, float32                          (8 bytes a chunk)
    remainders every gap's r low bits, packed LSB first, zero-padded to a byte
    unary      every gap's q one-bits then a zero-bit, in order: L bits, zero-padded to a byte
    codes      every kept value's (level << 1 | sign), bits each, packed LSB first, zero-padded to a byte

The remainders and the unary section are apart so that both decode without a loop: the gaps' ends are the unary
section's zero-bits. ``L`` varies with the indices; at most :meth:`SparseCodec.max_unary_bits`, which makes
:meth:`SparseCodec.payload_bytes` the longest payload.

Rule: :meth:`SparseCodec.decode` refuses anything but that exact layout for the receiver's own settings and shapes
(wrong length, magic, version or settings, ``L`` over its bound, a unary section whose zero-bits are not one a kept
value or are followed by ones, an index outside its chunk, a scale that is not a finite ``0 <= low <= high``,
non-zero padding) with a :class:`PayloadError`. Why: every member decodes every other member's payload (the sparse
exchange), so a payload is untrusted input; nothing is read outside the buffer, a hostile ``L`` allocates no more
than the longest payload, and one payload decodes to one tensor on every member.

    >>> codec = SparseCodec(density=0.02, chunk_size=4096, bits=2)
    >>> codec.rice_parameter, codec.max_unary_bits(4096)   # 82 gaps: 82 zero-bits, at most (4096 - 82) >> 5 ones
    (5, 207)
    >>> codec.payload_bytes(4096)   # 32-byte header + 8 bytes of scales + 82 x 5 bits + 207 bits + 82 x 2 bits
    139
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"CLSP"
VERSION = 2
_HEADER = struct.Struct("<4sBBHIIQQ")  # magic, version, bits, reserved, chunk_size, k, numel, unary_bits
HEADER_BYTES = _HEADER.size
SCALE_BYTES = 8  # two float32 a chunk
MAX_CHUNK_SIZE = 1 << 20
MAX_BITS = 8
FIT_ROUNDS = 4  # rounds fitting the magnitude levels to a chunk (SparseCodec._quantize)
_BLOCK = 1 << 16  # values packed per block (a multiple of 8: each block ends on a byte boundary)


class PayloadError(ValueError):
    """A payload that is not a valid encoding for the receiver's settings and shapes (said in the message)."""


@dataclass(frozen=True)
class SparseCodec:
    """Top-k per chunk, ``bits`` per kept value, Rice-coded index gaps. Every member of a swarm must use the same."""

    density: float = 0.02
    chunk_size: int = 4096
    bits: int = 2

    def __post_init__(self) -> None:
        if not (isinstance(self.density, (int, float)) and not isinstance(self.density, bool)
                and 0.0 < self.density <= 1.0):
            raise ValueError(f"density must be a number in (0, 1], got {self.density!r}")
        if not (type(self.chunk_size) is int and 2 <= self.chunk_size <= MAX_CHUNK_SIZE):
            raise ValueError(f"chunk_size must be an integer in [2, {MAX_CHUNK_SIZE}], got {self.chunk_size!r}")
        if not (type(self.bits) is int and 1 <= self.bits <= MAX_BITS):
            raise ValueError(f"bits must be an integer in [1, {MAX_BITS}], got {self.bits!r}")

    # ------------------------------------------------------------------ sizes

    @property
    def k(self) -> int:
        """Values kept of a full chunk."""
        return min(self.chunk_size, max(1, round(self.density * self.chunk_size)))

    @property
    def rice_parameter(self) -> int:
        """The Rice parameter ``r`` of every gap: the one of fewest expected bits a gap, ``r + 1 + E[g >> r]``, for
        gaps geometric of mean ``(chunk_size - k) / k`` (what ``k`` random positions of a chunk give).

        Why not the textbook ``floor(log2(mean * ln 2))``: at density 0.05 it picks 3, 5.96 bits a gap measured on
        Gaussian chunks, where 4 takes 5.78. ``theta**(2**r)`` is squared from ``theta`` (no ``pow``): the same bits
        on every machine."""
        mean = (self.chunk_size - self.k) / self.k
        power = mean / (mean + 1)  # theta = P(g >= 1); then P(g >= 2**r) = theta**(2**r)
        best, best_bits = 0, math.inf
        for r in range(self.chunk_size.bit_length()):
            expected = r + 1 + power / (1 - power)  # E[g >> r] = sum over j >= 1 of P(g >= j * 2**r)
            if expected < best_bits:
                best, best_bits = r, expected
            power *= power
        return best

    def kept_per_chunk(self, numel: int) -> list[int]:
        """Values kept of each chunk of a vector of ``numel``: ``k`` of a full chunk, of the shorter last one its
        share (rounded up, at least 1)."""
        full, rest = divmod(numel, self.chunk_size)
        kept = [self.k] * full
        if rest:
            kept.append(min(rest, max(1, -(-self.k * rest // self.chunk_size))))
        return kept

    def max_unary_bits(self, numel: int) -> int:
        """The longest unary section of ``numel`` values: a chunk's gaps sum to at most its length less its ``k``, so
        their quotients to at most that ``>> r``, and each gap ends in one zero-bit."""
        kept, r = self.kept_per_chunk(numel), self.rice_parameter
        lengths = [min(self.chunk_size, numel - i * self.chunk_size) for i in range(len(kept))]
        return sum(((length - k) >> r) + k for length, k in zip(lengths, kept, strict=True))

    def payload_bytes(self, numel: int, unary_bits: int | None = None) -> int:
        """The length of the payload of ``numel`` values whose unary section is ``unary_bits`` long; by default the
        longest (:meth:`max_unary_bits`): the most a peer sends or accepts."""
        kept, chunks = sum(self.kept_per_chunk(numel)), -(-numel // self.chunk_size)
        unary_bits = self.max_unary_bits(numel) if unary_bits is None else unary_bits
        return (HEADER_BYTES + SCALE_BYTES * chunks + -(-kept * self.rice_parameter // 8) + -(-unary_bits // 8)
                + -(-kept * self.bits // 8))

    # ------------------------------------------------------------------ encode

    def encode(self, tensors: Sequence[torch.Tensor]) -> bytes:
        """The payload of ``tensors`` (any float dtype and device; taken as float32 in host memory).

        Raises ValueError for no values or a non-finite one (the non-finite guard refuses those before)."""
        flat = _flatten(tensors)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("the pseudo-gradient holds NaN/inf: it cannot be encoded")
        numel, size = flat.numel(), self.chunk_size
        full = numel // size
        rows = [(flat[:full * size].view(full, size), self.k)] if full else []
        if numel % size:
            rows.append((flat[full * size:].view(1, -1), self.kept_per_chunk(numel)[-1]))
        gaps, codes, scales = [], [], []
        for values, k in rows:
            index = torch.topk(values.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
            kept = values.gather(1, index)
            low, high, level = self._quantize(kept.abs())
            before = torch.cat([torch.full_like(index[:, :1], -1), index[:, :-1]], dim=1)
            gaps.append((index - before - 1).reshape(-1))
            codes.append(((level << 1) | (kept < 0).to(torch.int64)).reshape(-1))
            scales.append(torch.stack([low, high], dim=1).reshape(-1))
        gap, r = torch.cat(gaps), self.rice_parameter
        ends = torch.cumsum((gap >> r) + 1, 0).numpy() - 1  # each gap's zero-bit: after its q one-bits
        unary = np.ones(int(ends[-1]) + 1, dtype=np.uint8)
        unary[ends] = 0
        header = _HEADER.pack(MAGIC, VERSION, self.bits, 0, size, self.k, numel, unary.size)
        return b"".join([header, torch.cat(scales).numpy().astype("<f4").tobytes(), _pack(gap & ((1 << r) - 1), r),
                         np.packbits(unary, bitorder="little").tobytes(), _pack(torch.cat(codes), self.bits)])

    def _quantize(self, magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the lowest and highest of ``2**(bits - 1)`` evenly spaced magnitude levels and each value's level.

        The levels are fitted to the row (:data:`FIT_ROUNDS` rounds of: each value to its nearest level, then the
        lowest level and the spacing by least squares; for two levels, the mean of each group), starting from the
        row's smallest and largest magnitude. Why: the kept magnitudes crowd above the chunk's threshold, so levels
        at the extremes put most values far from theirs (measured on Gaussian chunks at density 0.02, bits 2: 12.7% of
        the kept values' norm as error, 6.6% fitted). With one level it is the mean magnitude."""
        levels = 1 << (self.bits - 1)
        low, high = magnitude.min(dim=1).values, magnitude.max(dim=1).values
        count = float(magnitude.shape[1])
        for _ in range(FIT_ROUNDS):
            level = _levels(magnitude, low, high, levels).to(torch.float32)
            s_j, s_jj = level.sum(dim=1), (level * level).sum(dim=1)
            s_m, s_jm = magnitude.sum(dim=1), (level * magnitude).sum(dim=1)
            det = count * s_jj - s_j * s_j
            slope = torch.where(det > 0, (count * s_jm - s_j * s_m) / det.clamp_min(1e-30), 0.0).clamp_min(0.0)
            low = ((s_m - slope * s_j) / count).clamp_min(0.0)
            high = low + slope * (levels - 1)
        return low, high, _levels(magnitude, low, high, levels)

    # ------------------------------------------------------------------ decode

    def decode(self, payload: bytes, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The float32 tensors of ``shapes`` that ``payload`` encodes (zeros where nothing was kept).

        Raises :class:`PayloadError` for anything but a valid payload of these settings and shapes."""
        numels = [math.prod(shape) for shape in shapes]
        flat = self.decode_flat(payload, sum(numels))
        return [part.view(tuple(shape)) for part, shape in zip(flat.split(numels), shapes, strict=True)]

    def decode_flat(self, payload: bytes, numel: int) -> torch.Tensor:
        """The payload as one float32 vector of ``numel`` values (see :meth:`decode`)."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise PayloadError(f"a payload is bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        if len(payload) < HEADER_BYTES:
            raise PayloadError(f"{len(payload)} bytes: shorter than the {HEADER_BYTES}-byte header")
        magic, version, bits, reserved, chunk_size, k, count, unary_bits = _HEADER.unpack_from(payload)
        if magic != MAGIC or reserved:
            raise PayloadError("not a sparse pseudo-gradient payload (magic or reserved bytes differ)")
        if version != VERSION:
            raise PayloadError(f"format version {version}, this peer reads version {VERSION}")
        if (bits, chunk_size, k) != (self.bits, self.chunk_size, self.k):
            raise PayloadError(f"encoded with bits={bits}, chunk_size={chunk_size}, k={k}; this peer uses "
                               f"bits={self.bits}, chunk_size={self.chunk_size}, k={self.k}")
        if count != numel:
            raise PayloadError(f"encodes {count} values, the model has {numel}")
        longest = self.max_unary_bits(numel)
        if unary_bits > longest:
            raise PayloadError(f"a unary section of {unary_bits} bits, over the {longest} bits of the longest for "
                               f"{numel} values")
        if len(payload) != self.payload_bytes(numel, unary_bits):
            raise PayloadError(f"{len(payload)} bytes, expected {self.payload_bytes(numel, unary_bits)}")
        kept = self.kept_per_chunk(numel)
        chunks, total, r = len(kept), sum(kept), self.rice_parameter
        offset = HEADER_BYTES
        scales = torch.from_numpy(np.frombuffer(payload, "<f4", 2 * chunks, offset).astype(np.float32)).view(-1, 2)
        offset += SCALE_BYTES * chunks
        low, high = scales[:, 0], scales[:, 1]
        if not (bool(torch.isfinite(scales).all()) and bool((low >= 0).all()) and bool((high >= low).all())):
            raise PayloadError("a chunk's scale is not a finite 0 <= low <= high")
        remainder_end = offset + -(-total * r // 8)
        unary_end = remainder_end + -(-unary_bits // 8)
        remainder = _unpack(payload[offset:remainder_end], total, r)
        quotient = _read_unary(payload[remainder_end:unary_end], unary_bits, total)
        code = _unpack(payload[unary_end:], total, bits)
        # index = the running sum of (gap + 1) within its chunk, less 1: ascending by construction
        step = torch.cumsum((quotient << r) + remainder + 1, 0)
        kept_counts = torch.tensor(kept, dtype=torch.int64)
        before = torch.cat([torch.zeros(1, dtype=torch.int64), step[torch.cumsum(kept_counts, 0)[:-1] - 1]])
        chunk = torch.repeat_interleave(torch.arange(chunks), kept_counts)
        index = step - before[chunk] - 1
        lengths = torch.tensor([min(self.chunk_size, numel - i * self.chunk_size) for i in range(chunks)])
        if bool((index >= lengths[chunk]).any()):
            raise PayloadError("an index lies outside its chunk")
        magnitude = low[chunk] + (code >> 1).to(torch.float32) * _step(low, high, 1 << (bits - 1))[chunk]
        values = torch.where((code & 1).bool(), -magnitude, magnitude)
        if not bool(torch.isfinite(values).all()):
            raise PayloadError("a value decodes to infinity")
        flat = torch.zeros(numel, dtype=torch.float32)
        flat[chunk * self.chunk_size + index] = values
        return flat


# ---------------------------------------------------------------------- helpers


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    parts = [tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for tensor in tensors]
    if not parts or sum(part.numel() for part in parts) == 0:
        raise ValueError("no values to encode")
    return torch.cat(parts)


def _step(low: torch.Tensor, high: torch.Tensor, levels: int) -> torch.Tensor:
    """The distance between two magnitude levels (0 for a single level): the same float32 arithmetic at the encoder
    (to pick levels) and at every decoder."""
    return (high - low) / (levels - 1) if levels > 1 else torch.zeros_like(low)


def _levels(magnitude: torch.Tensor, low: torch.Tensor, high: torch.Tensor, levels: int) -> torch.Tensor:
    """Each magnitude's nearest level of its row (``low + j * step``, j in [0, levels))."""
    step = _step(low, high, levels)
    ratio = (magnitude - low[:, None]) / step.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    level = torch.where(step[:, None] > 0, ratio.round(), torch.zeros_like(ratio))
    return level.clamp(0, levels - 1).to(torch.int64)


def _pack(values: torch.Tensor, width: int) -> bytes:
    """Non-negative integers below ``2**width``, ``width`` bits each, LSB first, zero-padded to a byte (none for
    ``width`` 0)."""
    values, shifts = values.numpy(), np.arange(width, dtype=np.int64)
    out = []
    for start in range(0, values.size, _BLOCK):  # (a block ends on a byte boundary: _BLOCK is a multiple of 8)
        bits = ((values[start:start + _BLOCK, None] >> shifts) & 1).astype(np.uint8)
        out.append(np.packbits(bits.reshape(-1), bitorder="little").tobytes())
    return b"".join(out)


def _unpack(data: bytes, count: int, width: int) -> torch.Tensor:
    """The ``count`` integers :func:`_pack` wrote into ``data`` (its exact length; padding bits must be zero)."""
    if len(data) != -(-count * width // 8):
        raise PayloadError(f"a packed section is {len(data)} bytes, expected {-(-count * width // 8)}")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[count * width:].any():
        raise PayloadError("non-zero padding bits")
    bits, shifts = bits[:count * width].reshape(count, width), np.arange(width, dtype=np.int64)
    out = [(bits[start:start + _BLOCK].astype(np.int64) << shifts).sum(axis=1) for start in range(0, count, _BLOCK)]
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, dtype=np.int64))


def _read_unary(data: bytes, length: int, count: int) -> torch.Tensor:
    """The ``count`` quotients of a unary section of ``length`` bits (``data``: its exact bytes): the runs of ones
    before each zero-bit. Refused unless it holds exactly ``count`` zero-bits, the last one its last bit, and zero
    padding: one section, one reading."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[length:].any():
        raise PayloadError("non-zero padding bits after the unary section")
    ends = np.flatnonzero(bits[:length] == 0)
    if ends.size != count:
        raise PayloadError(f"the unary section ends {ends.size} gaps, expected {count}")
    if count and ends[-1] != length - 1:
        raise PayloadError("the unary section has one-bits after its last gap")
    return torch.from_numpy(np.diff(ends, prepend=-1) - 1)


__all__ = ["HEADER_BYTES", "MAGIC", "SCALE_BYTES", "VERSION", "PayloadError", "SparseCodec"]
