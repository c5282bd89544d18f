"""The compressed pseudo-gradient's wire format, the error-feedback buffer and the option that selects them
(collabopt/sparse_codec.py, collabopt/error_feedback.py, SparseLoCo in collabopt/diloco_options.py): no network."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hivemind.compression import Float16Compression

from collabopt import CollabConfig, ConfigurationError
from collabopt.diloco_options import SparseLoCo, check_outer_optimizer
from collabopt.error_feedback import ErrorFeedback
from collabopt.errors import DROP, apply_fix
from collabopt.sparse_codec import HEADER_BYTES, SCALE_BYTES, PayloadError, SparseCodec, _pack, _unpack

CODEC = SparseCodec()  # density 0.02, chunk 4096, bits 2
SHAPES = [(40, 300), (77,), (4096,)]  # 16,173 values: 3 full chunks and a short one of 3,885


def tensors(seed: int = 0, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def flat(parts) -> torch.Tensor:
    return torch.cat([part.reshape(-1) for part in parts])


# ---------------------------------------------------------------------- round trip and size


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_a_payload_decodes_to_the_top_k_of_each_chunk_with_their_signs(bits):
    codec = SparseCodec(bits=bits)
    original = flat(tensors())
    decoded = flat(codec.decode(codec.encode(tensors()), SHAPES))
    assert decoded.shape == original.shape and decoded.dtype == torch.float32
    for start, kept in zip(range(0, original.numel(), 4096), codec.kept_per_chunk(original.numel()), strict=True):
        chunk, got = original[start:start + 4096], decoded[start:start + 4096]
        top = set(torch.topk(chunk.abs(), kept).indices.tolist())
        assert set(got.nonzero().flatten().tolist()) == top  # (continuous values: no ties, no zero kept)
        assert bool((got[list(top)].sign() == chunk[list(top)].sign()).all())
    kept = decoded != 0
    error = float((decoded[kept] - original[kept]).norm() / original[kept].norm())
    assert error < {1: 0.2, 2: 0.1, 3: 0.06, 8: 0.005}[bits]


def test_one_input_has_one_encoding():
    assert CODEC.encode(tensors(3)) == CODEC.encode([t.clone() for t in tensors(3)])


def test_bytes_per_chunk_follow_the_formula_and_beat_fp16_twenty_fold():
    assert CODEC.k == 82 and CODEC.index_bits == 12
    # one full chunk: header, two float32 scales, 82 indices of 12 bits, 82 codes of 2 bits
    assert CODEC.payload_bytes(4096) == HEADER_BYTES + SCALE_BYTES + 82 * 12 // 8 + math.ceil(82 * 2 / 8) == 176
    for chunks in (1, 7, 1000):
        kept = 82 * chunks
        assert CODEC.payload_bytes(4096 * chunks) == 24 + 8 * chunks + math.ceil(kept * 12 / 8) + math.ceil(kept / 4)
    assert len(CODEC.encode(tensors())) == CODEC.payload_bytes(16173)
    assert CODEC.kept_per_chunk(16173) == [82, 82, 82, 78]  # the short chunk keeps its share, rounded up
    per_parameter = CODEC.payload_bytes(5_000_000) / 5_000_000
    assert 2 / per_parameter >= 50  # fp16 sends 2 bytes a parameter (the issue asks for 20x)
    assert SparseCodec(density=1.0, chunk_size=16, bits=8).payload_bytes(16) == 24 + 8 + 8 + 16


def test_a_vector_shorter_than_a_chunk_and_all_zeros_round_trip():
    codec = SparseCodec(density=0.1, chunk_size=64, bits=2)
    assert codec.kept_per_chunk(10) == [1]
    x = torch.zeros(10)
    x[7] = -3.0
    assert torch.equal(codec.decode(codec.encode([x]), [(10,)])[0], x)
    assert torch.equal(codec.decode_flat(codec.encode([torch.zeros(200)]), 200), torch.zeros(200))


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
    """The payload's header, scales, indices and codes (indices and codes unpacked)."""
    kept = sum(codec.kept_per_chunk(numel))
    chunks = len(codec.kept_per_chunk(numel))
    scales_end = HEADER_BYTES + SCALE_BYTES * chunks
    index_end = scales_end + math.ceil(kept * codec.index_bits / 8)
    return (payload[:HEADER_BYTES], payload[HEADER_BYTES:scales_end],
            _unpack(payload[scales_end:index_end], kept, codec.index_bits),
            _unpack(payload[index_end:], kept, codec.bits))


def rebuilt(header, scales, index, code, codec: SparseCodec = CODEC) -> bytes:
    return header + scales + _pack(index, codec.index_bits) + _pack(code, codec.bits)


def hostile_payloads() -> dict[str, bytes | tuple[bytes, list]]:
    """Payloads for SHAPES (or, with a tuple, for its shapes) that break one rule each."""
    numel = 16173
    good = CODEC.encode(tensors())
    header, scales, index, code = sections(good, numel)
    floats = list(struct.unpack(f"<{len(scales) // 4}f", scales))

    def with_scale(position: int, value: float) -> bytes:
        changed = list(floats)
        changed[position] = value
        return rebuilt(header, struct.pack(f"<{len(changed)}f", *changed), index, code)

    out_of_chunk, repeated = index.clone(), index.clone()
    out_of_chunk[-1] = 3885  # the short last chunk holds 3,885 values
    repeated[1] = repeated[0]
    padded = bytearray(CODEC.encode(tensors(shapes=[(4196,)])))
    padded[-1] |= 0x80  # 82 + 3 codes of 2 bits leave the last byte's top bits unused
    return {
        "empty": b"",
        "truncated": good[:-1],
        "one byte more": good + b"\0",
        "header only": good[:HEADER_BYTES],
        "other magic": b"XXXX" + good[4:],
        "other version": good[:4] + bytes([2]) + good[5:],
        "reserved bytes set": good[:6] + b"\1\0" + good[8:],
        "other bits": CodecBits3.encode(tensors()),
        "other numel": CODEC.encode(tensors(shapes=[(16172,)])),
        "NaN scale": with_scale(1, float("nan")),
        "infinite scale": with_scale(1, float("inf")),
        "negative low": with_scale(0, -1.0),
        "low above high": with_scale(0, floats[1] * 2),
        "index outside its chunk": rebuilt(header, scales, out_of_chunk, code),
        "repeated index": rebuilt(header, scales, repeated, code),
        "padding bits set": (bytes(padded), [(4196,)]),
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


REFUSALS = {  # what each case's error says
    "empty": "shorter than the 24-byte header", "truncated": "622 bytes, expected 623",
    "one byte more": "624 bytes, expected 623", "header only": "24 bytes, expected 623", "other magic": "magic",
    "other version": "format version 2", "reserved bytes set": "reserved", "other bits": "encoded with bits=3",
    "other numel": "encodes 16172 values, the model has 16173", "NaN scale": "scale", "infinite scale": "scale",
    "negative low": "scale", "low above high": "scale", "index outside its chunk": "outside its chunk",
    "repeated index": "strictly ascending", "padding bits set": "padding", "random bytes of the right length": "magic",
}


def test_the_mutated_payloads_differ_only_where_meant():
    """The helpers rebuild a valid payload unchanged: each hostile case breaks only its own rule."""
    good = CODEC.encode(tensors())
    assert rebuilt(*sections(good, 16173)) == good
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
