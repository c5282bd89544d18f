"""The compressed pseudo-gradient's wire format, the error-feedback buffer and the option that selects them
(collabopt/sparse_codec.py, collabopt/error_feedback.py, SparseLoCo in collabopt/diloco_options.py): no network."""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import pytest
import torch
from hivemind.compression import Float16Compression

from collabopt import CollabConfig, ConfigurationError
from collabopt.diloco_options import SparseLoCo, check_outer_optimizer
from collabopt.error_feedback import ErrorFeedback
from collabopt.errors import DROP, apply_fix
from collabopt.sparse_codec import HEADER_BYTES, SCALE_BYTES, PayloadError, SparseCodec, _pack, _step, _unpack

CODEC = SparseCodec()  # density 0.02, chunk 4096, bits 2
SHAPES = [(40, 300), (77,), (4096,)]  # 16,173 values: 3 full chunks and a short one of 3,885
HEADER = struct.Struct("<4sBBHIIQQ")


def tensors(seed: int = 0, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def flat(parts) -> torch.Tensor:
    return torch.cat([part.reshape(-1) for part in parts])


def unary_bits(payload: bytes) -> int:
    return HEADER.unpack_from(payload)[-1]


# ---------------------------------------------------------------------- round trip and size


def kept_values(codec: SparseCodec, x: torch.Tensor) -> torch.Tensor:
    """What a payload of ``x`` decodes to, by the rule and not the wire: of each chunk its top k in index order, at
    the levels fitted to them (what version 1 decoded too; the format carries the same values)."""
    out = torch.zeros_like(x)
    for start, k in zip(range(0, x.numel(), codec.chunk_size), codec.kept_per_chunk(x.numel()), strict=True):
        chunk = x[start:start + codec.chunk_size]
        index = torch.topk(chunk.abs(), k).indices.sort().values
        low, high, level = codec._quantize(chunk[index].abs()[None])
        magnitude = low + level[0].to(torch.float32) * _step(low, high, 1 << (codec.bits - 1))
        out[start + index] = torch.where(chunk[index] < 0, -magnitude, magnitude)
    return out


ROUND_TRIPS = [*((SparseCodec(bits=bits), SHAPES) for bits in range(1, 9)),  # shorter last chunk
               (SparseCodec(density=0.05, chunk_size=1000, bits=2), [(2500,)]),  # r = 4
               (SparseCodec(density=0.001, chunk_size=4096, bits=3), [(9000,)]),  # k = 4, r = 9
               (SparseCodec(density=0.1, chunk_size=64, bits=2), [(10,)]),  # a vector shorter than a chunk
               (SparseCodec(density=1.0, chunk_size=16, bits=3), [(5, 8)]),  # everything kept: r = 0
               (SparseCodec(density=1.0, chunk_size=2, bits=2), [(7,)]),  # chunk_size 2, a last chunk of 1
               (SparseCodec(density=0.5, chunk_size=2, bits=1), [(3, 3)])]


@pytest.mark.parametrize("codec, shapes", ROUND_TRIPS, ids=lambda v: repr(v) if isinstance(v, SparseCodec) else "")
def test_a_payload_decodes_to_the_top_k_of_each_chunk_at_their_levels(codec, shapes):
    original = flat(tensors(4, shapes))
    payload = codec.encode(tensors(4, shapes))
    assert len(payload) == codec.payload_bytes(original.numel(), unary_bits(payload)) <= \
        codec.payload_bytes(original.numel())
    decoded = flat(codec.decode(payload, shapes))
    assert decoded.shape == original.shape and decoded.dtype == torch.float32
    assert torch.equal(decoded, kept_values(codec, original))
    if codec.density < 1:  # (continuous values: no ties, and no kept value decodes to 0)
        assert int((decoded != 0).sum()) == sum(codec.kept_per_chunk(original.numel()))
        assert bool((decoded.sign()[decoded != 0] == original.sign()[decoded != 0]).all())


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_the_kept_values_are_close_to_the_originals(bits):
    codec, original = SparseCodec(bits=bits), flat(tensors())
    decoded = flat(codec.decode(codec.encode(tensors()), SHAPES))
    kept = decoded != 0
    error = float((decoded[kept] - original[kept]).norm() / original[kept].norm())
    assert error < {1: 0.2, 2: 0.1, 3: 0.06, 8: 0.005}[bits]


VERSION_1 = [  # SHA-256 (first 16 hex digits) of the float32 values version 1's codec decoded, for tensors(11, shapes)
    (dict(bits=1), SHAPES, "a22ab39291cb87a8"), (dict(bits=2), SHAPES, "d2dc01db962cc179"),
    (dict(bits=3), SHAPES, "94e4c92cd489116c"), (dict(bits=8), SHAPES, "3695967649811d56"),
    (dict(density=0.05, chunk_size=1000, bits=2), [(2500,)], "dd677708c8b3e4d2"),
    (dict(density=1.0, chunk_size=2, bits=3), [(7,)], "0ca0ef378a5fff75"),
    (dict(density=0.1, chunk_size=64, bits=2), [(10,)], "2e29b40fca70b6ef"),
]


@pytest.mark.parametrize("settings, shapes, digest", VERSION_1)
def test_a_payload_decodes_to_the_values_version_1_decoded(settings, shapes, digest):
    codec = SparseCodec(**settings)
    decoded = flat(codec.decode(codec.encode(tensors(11, shapes)), shapes))
    assert hashlib.sha256(decoded.numpy().tobytes()).hexdigest()[:16] == digest


def test_one_input_has_one_encoding():
    assert CODEC.encode(tensors(3)) == CODEC.encode([t.clone() for t in tensors(3)])


def test_the_longest_payload_follows_the_formula_and_beats_fp16_seventy_fold():
    assert CODEC.k == 82 and CODEC.rice_parameter == 5
    # one full chunk: header, two float32 scales, 82 remainders of 5 bits, at most 82 + (4096 - 82) >> 5 unary bits,
    # 82 codes of 2 bits
    assert CODEC.max_unary_bits(4096) == 82 + 125
    assert CODEC.payload_bytes(4096) == HEADER_BYTES + SCALE_BYTES + math.ceil(82 * 5 / 8) + math.ceil(207 / 8) \
        + math.ceil(82 * 2 / 8) == 139
    for chunks in (1, 7, 1000):
        kept = 82 * chunks
        assert CODEC.payload_bytes(4096 * chunks) == 32 + 8 * chunks + math.ceil(kept * 5 / 8) \
            + math.ceil(207 * chunks / 8) + math.ceil(kept / 4)
    assert CODEC.kept_per_chunk(16173) == [82, 82, 82, 78]  # the short chunk keeps its share, rounded up
    assert CODEC.max_unary_bits(16173) == 3 * 207 + 78 + (3885 - 78) // 32
    payload = CODEC.encode(tensors())
    assert len(payload) == CODEC.payload_bytes(16173, unary_bits(payload)) < CODEC.payload_bytes(16173)
    assert 2 / (CODEC.payload_bytes(5_000_000) / 5_000_000) >= 75  # fp16 sends 2 bytes a parameter (B6: 20x)
    assert SparseCodec(density=1.0, chunk_size=16, bits=8).payload_bytes(16) == 32 + 8 + 0 + 2 + 16


def test_a_random_chunk_takes_about_101_bytes():
    """Measured: 101.07 bytes a chunk of Gaussian values at density 0.02 (7.08 bits a gap; the header is 32 bytes
    a payload); version 1's 12-bit indices took 151.5, the longest payload takes 105.6."""
    payload = CODEC.encode([torch.randn(4096 * 1000, generator=torch.Generator().manual_seed(1))])
    assert 100.5 < (len(payload) - HEADER_BYTES) / 1000 < 101.5
    assert 7.0 < (82_000 * 5 + unary_bits(payload)) / 82_000 < 7.2


def test_the_longest_payload_is_reached_and_decodes():
    """Each chunk's kept values at its end: its first gap is the chunk's length less k, every other 0."""
    x = torch.zeros(16173)
    for start, k in zip(range(0, 16173, 4096), CODEC.kept_per_chunk(16173), strict=True):
        end = min(start + 4096, 16173)
        x[end - k:end] = torch.arange(1, k + 1, dtype=torch.float32)
    payload = CODEC.encode([x])
    assert unary_bits(payload) == CODEC.max_unary_bits(16173) and len(payload) == CODEC.payload_bytes(16173)
    assert torch.equal(CODEC.decode_flat(payload, 16173), kept_values(CODEC, x))


def test_a_vector_of_zeros_round_trips():
    assert torch.equal(CODEC.decode_flat(CODEC.encode([torch.zeros(200)]), 200), torch.zeros(200))


def test_settings_and_inputs_are_checked():
    for bad in (dict(density=0), dict(density=1.5), dict(chunk_size=1), dict(chunk_size=4096.0), dict(bits=0),
                dict(bits=9)):
        with pytest.raises(ValueError):
            SparseCodec(**bad)
    with pytest.raises(ValueError, match="NaN"):
        CODEC.encode([torch.tensor([1.0, float("nan")])])
    with pytest.raises(ValueError, match="no values"):
        CODEC.encode([])


# ---------------------------------------------------------------------- hostile payloads


def sections(payload: bytes, numel: int, codec: SparseCodec = CODEC):
    """The payload's header fields (less ``L``), scales, gaps, unary section (its ``L`` bits) and codes."""
    total, r = sum(codec.kept_per_chunk(numel)), codec.rice_parameter
    *fields, length = HEADER.unpack_from(payload)
    scales_end = HEADER_BYTES + SCALE_BYTES * len(codec.kept_per_chunk(numel))
    remainder_end = scales_end + math.ceil(total * r / 8)
    unary_end = remainder_end + math.ceil(length / 8)
    unary = np.unpackbits(np.frombuffer(payload[remainder_end:unary_end], np.uint8), bitorder="little")[:length]
    quotient = torch.from_numpy(np.diff(np.flatnonzero(unary == 0), prepend=-1) - 1)
    gap = (quotient << r) + _unpack(payload[scales_end:remainder_end], total, r)
    return fields, payload[HEADER_BYTES:scales_end], gap, unary, _unpack(payload[unary_end:], total, codec.bits)


def rebuilt(fields, scales, gap, unary, code, codec: SparseCodec = CODEC) -> bytes:
    """A payload of these sections (``L``: the unary section's length); ``unary`` None: the unary code of ``gap``."""
    r = codec.rice_parameter
    if unary is None:
        unary = np.concatenate([np.append(np.ones(int(q), np.uint8), 0) for q in gap >> r]).astype(np.uint8)
    return (HEADER.pack(*fields, unary.size) + scales + _pack(gap & ((1 << r) - 1), r)
            + np.packbits(unary, bitorder="little").tobytes() + _pack(code, codec.bits))


def with_last_index(gap: torch.Tensor, position: int, count: int, value: int) -> torch.Tensor:
    """The gaps with the index at ``position``, the last of a chunk of ``count`` kept values, moved to ``value``."""
    changed = gap.clone()
    changed[position] += value - (int((gap[position + 1 - count:position + 1] + 1).sum()) - 1)
    return changed


def hostile_payloads() -> dict[str, bytes | tuple[bytes, list]]:
    """Payloads for SHAPES (or, with a tuple, for its shapes) that break one rule each."""
    good = CODEC.encode(tensors())
    fields, scales, gap, unary, code = sections(good, 16173)
    length = unary.size
    assert length % 8 not in (0, 1) and 324 * 5 % 8  # (L +- 1 fit its bytes; remainder and unary padding bits)
    remainder_end = HEADER_BYTES + len(scales) + math.ceil(324 * 5 / 8)
    floats = list(struct.unpack(f"<{len(scales) // 4}f", scales))

    def with_scale(position: int, value: float) -> bytes:
        changed = list(floats)
        changed[position] = value
        return rebuilt(fields, struct.pack(f"<{len(changed)}f", *changed), gap, unary, code)

    def with_length(value: int) -> bytes:
        return good[:24] + struct.pack("<Q", value) + good[32:]

    def with_top_bit(section_end: int) -> bytes:  # the top (padding) bit of a section's last byte set
        return good[:section_end - 1] + bytes([good[section_end - 1] | 0x80]) + good[section_end:]

    def with_unary(bits) -> bytes:
        return rebuilt(fields, scales, gap, np.asarray(bits, dtype=np.uint8), code)

    padded = CODEC.encode(tensors(shapes=[(4196,)]))
    assert 85 * 2 % 8  # (85 codes of 2 bits leave the last byte's top bits unused)
    return {
        "empty": b"",
        "truncated": good[:-1],
        "one byte more": good + b"\0",
        "header only": good[:HEADER_BYTES],
        "other magic": b"XXXX" + good[4:],
        "version 1": good[:4] + bytes([1]) + good[5:],
        "version 3": good[:4] + bytes([3]) + good[5:],
        "reserved bytes set": good[:6] + b"\1\0" + good[8:],
        "other bits": CodecBits3.encode(tensors()),
        "other numel": CODEC.encode(tensors(shapes=[(16172,)])),
        "NaN scale": with_scale(1, float("nan")),
        "infinite scale": with_scale(1, float("inf")),
        "negative low": with_scale(0, -1.0),
        "low above high": with_scale(0, floats[1] * 2),
        "L one short of its section": with_length(length - 1),
        "L one past its section": with_length(length + 1),
        "L a byte longer than its section": with_length(length + 8),
        "L over its bound": with_unary(np.append(np.ones(818 - length), unary)),  # (first gap's q made longer)
        "L of 2**64 - 1": with_length(2**64 - 1),
        "a gap end too many": with_unary(np.append(0, unary)),
        "a gap end too few": with_unary(np.where(np.arange(length) == np.flatnonzero(unary == 0)[5], 1, unary)),
        "one-bits after the last gap": with_unary(np.append(unary, 1)),
        "index outside its chunk": rebuilt(fields, scales, with_last_index(gap, 323, 78, 3885), None, code),
        "index past the end of a full chunk": rebuilt(fields, scales, with_last_index(gap, 81, 82, 4096), None, code),
        "remainder padding bits set": with_top_bit(remainder_end),
        "unary padding bits set": with_top_bit(remainder_end + math.ceil(length / 8)),
        "code padding bits set": (padded[:-1] + bytes([padded[-1] | 0x80]), [(4196,)]),
        "random bytes of the right length": bytes(torch.randint(0, 256, (len(good),),
                                                                 generator=torch.Generator().manual_seed(1)).tolist()),
    }


CodecBits3 = SparseCodec(bits=3)


@pytest.mark.parametrize("case", sorted(hostile_payloads()))
def test_a_hostile_payload_is_refused_with_a_clear_error(case):
    payload, shapes = hostile_payloads()[case], SHAPES
    if isinstance(payload, tuple):
        payload, shapes = payload
    with pytest.raises(PayloadError, match=REFUSALS[case]):
        CODEC.decode(payload, shapes)


REFUSALS = {  # what each case's error says (the good payload: 432 bytes, a unary section of 667 bits)
    "empty": "shorter than the 32-byte header", "truncated": "431 bytes, expected 432",
    "one byte more": "433 bytes, expected 432", "header only": "32 bytes, expected 432", "other magic": "magic",
    "version 1": "format version 1, this peer reads version 2", "version 3": "format version 3",
    "reserved bytes set": "reserved", "other bits": "encoded with bits=3",
    "other numel": "encodes 16172 values, the model has 16173", "NaN scale": "scale", "infinite scale": "scale",
    "negative low": "scale", "low above high": "scale",
    "L one short of its section": "ends 323 gaps, expected 324", "L one past its section": "ends 325 gaps",
    "L a byte longer than its section": "432 bytes, expected 433",
    "L over its bound": "818 bits, over the 817 bits", "L of 2**64 - 1": "over the 817 bits",
    "a gap end too many": "ends 325 gaps, expected 324", "a gap end too few": "ends 323 gaps, expected 324",
    "one-bits after the last gap": "one-bits after its last gap", "index outside its chunk": "outside its chunk",
    "index past the end of a full chunk": "outside its chunk", "remainder padding bits set": "padding",
    "unary padding bits set": "padding bits after the unary section", "code padding bits set": "padding",
    "random bytes of the right length": "magic",
}


def test_the_mutated_payloads_differ_only_where_meant():
    """The helpers rebuild a valid payload unchanged, and each index case's payload decodes one index short of its
    chunk's end: each hostile case breaks only its own rule."""
    good = CODEC.encode(tensors())
    fields, scales, gap, unary, code = sections(good, 16173)
    assert len(good) == 432 and unary.size == 667
    assert rebuilt(fields, scales, gap, unary, code) == rebuilt(fields, scales, gap, None, code) == good
    for position, count, last in ((323, 78, 3884), (81, 82, 4095)):
        payload = rebuilt(fields, scales, with_last_index(gap, position, count, last), None, code)
        assert int(CODEC.decode_flat(payload, 16173)[position // 82 * 4096 + last]) != 0
    CODEC.decode(CODEC.encode(tensors(shapes=[(4196,)])), [(4196,)])  # (the padding case's payload, unchanged)
    with pytest.raises(PayloadError, match="bytes"):
        CODEC.decode("not bytes", SHAPES)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- error feedback


def test_with_decay_1_everything_sent_plus_the_buffer_is_every_pseudo_gradient():
    feedback = ErrorFeedback(CODEC, SHAPES, decay=1.0)
    total_in, total_sent = torch.zeros(16173, dtype=torch.float64), torch.zeros(16173, dtype=torch.float64)
    for round_ in range(30):
        delta = tensors(round_)
        payload = feedback.compress(delta)
        feedback.commit()
        total_in += flat(delta).double()
        total_sent += flat(CODEC.decode(payload, SHAPES)).double()
    residual = flat(feedback.buffers).double()
    assert torch.allclose(total_sent + residual, total_in, atol=1e-4)
    assert float(residual.norm()) > 1.0  # (something was held back: the check above is not trivial)


def test_what_one_round_drops_is_sent_in_later_rounds():
    x = flat(tensors(5))
    feedback = ErrorFeedback(CODEC, [(16173,)], decay=1.0)
    sent = torch.zeros(16173, dtype=torch.float64)
    for round_ in range(120):  # then nothing new: the buffer drains
        sent += CODEC.decode_flat(feedback.compress([x if round_ == 0 else torch.zeros(16173)]), 16173).double()
        feedback.commit()
    assert float((sent - x.double()).norm() / x.norm()) < 1e-3


def test_each_round_keeps_what_it_did_not_send_after_the_decay():
    feedback = ErrorFeedback(CODEC, SHAPES, decay=0.95)
    for round_ in range(3):
        before, delta = flat(feedback.buffers).clone(), tensors(round_)
        sent = flat(CODEC.decode(feedback.compress(delta), SHAPES))
        feedback.commit()
        assert torch.allclose(flat(feedback.buffers) + sent, 0.95 * before + flat(delta), atol=1e-6)


def test_a_round_not_applied_leaves_the_buffer_as_it_was():
    feedback = ErrorFeedback(CODEC, SHAPES, decay=0.95)
    feedback.compress(tensors(0))
    feedback.commit()
    before = [b.clone() for b in feedback.buffers]
    feedback.compress(tensors(1))
    feedback.discard()
    assert all(torch.equal(a, b) for a, b in zip(before, feedback.buffers, strict=True))
    feedback.compress(tensors(2))
    feedback.compress(tensors(3))  # (a second compress replaces the staged update)
    feedback.commit()
    expected = ErrorFeedback(CODEC, SHAPES, decay=0.95)
    expected.load_state_dict({**feedback.state_dict(), "buffers": before})
    expected.compress(tensors(3))
    expected.commit()
    assert all(torch.equal(a, b) for a, b in zip(expected.buffers, feedback.buffers, strict=True))
    with pytest.raises(RuntimeError, match="compress"):
        feedback.commit()


def test_the_buffer_survives_a_checkpoint():
    feedback = ErrorFeedback(CODEC, SHAPES, decay=0.95)
    feedback.compress(tensors(0))
    feedback.commit()
    state = feedback.state_dict()
    restored = ErrorFeedback(CODEC, SHAPES, decay=0.95)
    restored.load_state_dict(state)
    assert restored.compress(tensors(1)) == feedback.compress(tensors(1))
    assert float(flat(state["buffers"]).norm()) > 0
    for bad, match in ((dict(version=0), "version"), (dict(shapes=[[1]]), "shapes"),
                       (dict(buffers=[torch.full(s, float("nan")) for s in SHAPES]), "NaN")):
        with pytest.raises(ValueError, match=match):
            restored.load_state_dict({**state, **bad})
    restored.reset()
    assert float(flat(restored.buffers).abs().sum()) == 0


# ---------------------------------------------------------------------- the option


@pytest.mark.parametrize("name, value", [("density", 0), ("density", 1.5), ("density", float("nan")),
                                         ("density", True), ("chunk_size", 1), ("chunk_size", 4096.0),
                                         ("chunk_size", 1 << 21), ("bits", 0), ("bits", 9), ("bits", 2.0),
                                         ("error_decay", -0.1), ("error_decay", 1.01), ("error_decay", "0.9")])
def test_a_bad_setting_names_itself_and_the_fix(name, value):
    with pytest.raises(ConfigurationError) as info:
        SparseLoCo(**{name: value})
    assert info.value.parameter == f"SparseLoCo.{name}" and f"SparseLoCo({name}=" in info.value.fix
    SparseLoCo(**{name: eval(info.value.fix.split(f"{name}=")[1].rstrip(")"))})  # the fix's value is accepted


def test_the_option_builds_the_codec_the_buffer_and_sparselocos_outer_step():
    option = SparseLoCo(density=0.01, chunk_size=1024, bits=3, error_decay=0.9)
    assert option.codec == SparseCodec(density=0.01, chunk_size=1024, bits=3)
    feedback = option.error_feedback([(3, 4)])
    assert feedback.decay == 0.9 and feedback.codec == option.codec and feedback.shapes == [(3, 4)]
    outer = SparseLoCo.outer_optimizer()
    check_outer_optimizer(outer)
    built = outer([torch.nn.Parameter(torch.zeros(1))])
    assert type(built) is torch.optim.SGD and built.defaults["lr"] == 1.0 and built.defaults["momentum"] == 0


BASE = dict(run_id="sparse", target_batch_size=64)


def refused_then_fixed(options):
    with pytest.raises(ConfigurationError) as info:
        CollabConfig.from_options(**options)
    assert info.value.fixes
    for fix in info.value.fixes:
        CollabConfig.from_options(**apply_fix(options, fix))
    return info.value


def test_diloco_mode_accepts_the_option_and_its_rules_hold():
    outer = SparseLoCo.outer_optimizer()
    config = CollabConfig.from_options(**BASE, outer_optimizer=outer, pseudo_gradient_compression=SparseLoCo())
    assert config.pseudo_gradient_compression == SparseLoCo()
    assert "pseudo_gradient_compression" in refused_then_fixed(
        dict(BASE, pseudo_gradient_compression=SparseLoCo())).parameter  # DiLoCo mode only
    assert "expected collabopt.diloco_options.SparseLoCo" in refused_then_fixed(
        dict(BASE, outer_optimizer=outer, pseudo_gradient_compression="sparseloco")).problem
    assert refused_then_fixed(dict(BASE, outer_optimizer=outer, pseudo_gradient_compression=SparseLoCo(),
                                   grad_compression=Float16Compression())).parameter == "grad_compression"
    error = refused_then_fixed(dict(BASE, outer_optimizer=outer, pseudo_gradient_compression=SparseLoCo(),
                                    client_mode=True))  # (the exchange sends every member the others' payloads)
    assert error.parameter == "client_mode" and "reachable" in error.problem
    assert error.fixes == [{"client_mode": DROP}, {"pseudo_gradient_compression": DROP}]
    for overlap in (True, False):
        CollabConfig.from_options(**BASE, outer_optimizer=outer, pseudo_gradient_compression=SparseLoCo(),
                                  overlap_rounds=overlap, aggregation="centered_clip")


def test_the_option_builds_the_compressed_rounds():
    from collabopt.engine.diloco_averaging import (
        PseudoGradientRounds,
        SparsePseudoGradientRounds,
        pseudo_gradient_averager_factory,
    )
    from collabopt.hivemind_arguments import _diloco_arguments

    outer = SparseLoCo.outer_optimizer()
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    sparse = SparseLoCo(density=0.05)
    config = CollabConfig.from_options(**BASE, outer_optimizer=outer, pseudo_gradient_compression=sparse)
    factory = _diloco_arguments(config, inner, None)["grad_averager_factory"]
    assert factory.func is SparsePseudoGradientRounds and factory.keywords["sparse"] == sparse
    assert pseudo_gradient_averager_factory(None).func is PseudoGradientRounds


def test_every_adapter_takes_the_option_beside_outer_optimizer():
    from collabopt.integrations._lightning_options import accepted_option_names

    from collabopt.config import option_names

    assert {"outer_optimizer", "pseudo_gradient_compression"} <= set(option_names())  # core, accelerate, transformers
    assert {"outer_optimizer", "pseudo_gradient_compression"} <= accepted_option_names()  # Lightning's strategy
