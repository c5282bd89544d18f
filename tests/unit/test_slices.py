"""How a round cuts its tensors (collabopt.engine.slices): every slice holds its fraction of the elements, the pieces
put back give the tensors, and an adaptive compression chooses for a cut tensor's parts as for the whole tensor's."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import (
    CompressionInfo,
    Float16Compression,
    NoCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
    TensorRole,
)

import collabopt.engine.round_schema as round_schema_module
from collabopt.engine.parameter_rounds import round_infos
from collabopt.engine.round_schema import round_schema
from collabopt.engine.slices import Slices, cut_at_slice_ends

B3_MLP = [262144, 1024, 1048576, 1024, 1048576, 1024, 1048576, 1024, 1048576, 1024, 16384, 16]  # (4.48M elements)


def slice_sizes(slices: Slices, members: int) -> list[int]:
    return [sum(part.numel() for part in slices.container.get_raw_input_parts(k)) for k in range(members)]


def test_each_slice_holds_its_fraction_of_the_elements_where_whole_parts_did_not():
    tensors = [torch.zeros(size) for size in B3_MLP]
    total = sum(B3_MLP)
    whole_parts = TensorPartContainer(tensors, [1.0] * 4, part_size_bytes=2**19)  # (hivemind's container alone)
    sizes = [sum(part.numel() for part in whole_parts.get_raw_input_parts(k)) for k in range(4)]
    assert [round(size * 4 / 1e6, 2) for size in sizes] == [4.72, 4.2, 4.72, 4.27]  # MB, where 4.48 is the fraction
    for fractions in ([1.0] * 4, [1.0, 0.0, 1.0, 1.0], [0.3, 0.7], [1.0] * 16):
        sizes = slice_sizes(Slices(tensors, fractions, NoCompression(), 2**19, prefetch=1), len(fractions))
        assert sum(sizes) == total
        for size, fraction in zip(sizes, fractions, strict=True):
            assert abs(size - fraction / sum(fractions) * total) <= 1, (fractions, sizes)
    one_member = Slices(tensors, [1.0], NoCompression(), 2**19, prefetch=1)
    assert len(one_member.container.local_tensors) == len(B3_MLP)  # (one member: nothing cut)


def test_the_pieces_keep_the_elements_order_and_go_back_into_the_tensors():
    torch.manual_seed(0)
    tensors = [torch.randn(1000), torch.randn(10, 30), torch.randn(7)]
    pieces, owners = cut_at_slice_ends(tensors, [1.0, 1.0, 1.0, 1.0])
    assert owners == [0, 0, 0, 0, 1, 2] and len(pieces) == 6  # (slices end at elements 326, 653 and 980 of 1307)
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), torch.cat([t.reshape(-1) for t in tensors]))
    slices = Slices(tensors, [1.0] * 4, NoCompression(), 256, prefetch=1)
    back = slices.whole([piece.clone() for piece in slices.container.local_tensors])
    assert [b.shape for b in back] == [t.shape for t in tensors]
    assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=True))


def test_an_adaptive_compression_chooses_for_a_cut_tensors_parts_as_for_the_whole_tensor():
    # above 500 elements float16, else none: the 1000-element tensor is cut into pieces of fewer than 500 elements
    compression = SizeAdaptiveCompression(500, NoCompression(), Float16Compression())
    tensors = [torch.zeros(1000), torch.zeros(300)]
    slices = Slices(tensors, [1.0] * 4, compression, 400, prefetch=1)
    layout = slices.layout()
    assert sum(size for _, size in layout) == 1300 and len(slices.container.local_tensors) > 2
    kinds = [kind for kind, _ in layout]
    first = sum(slices.container.num_parts_by_tensor[:len([o for o in slices.owners if o == 0])])
    assert set(kinds[:first]) == {Float16Compression.compression_type}
    assert set(kinds[first:]) == {NoCompression.compression_type}


def test_a_role_adaptive_compression_chooses_by_the_roles_a_round_gives():
    """hivemind's state averager gives its tensors roles; a round without them would compress every part alike."""
    compression = RoleAdaptiveCompression(parameter=Float16Compression(), default=NoCompression())
    tensors = [torch.zeros(1000), torch.zeros(300)]
    infos = round_infos(tensors, 1, ["exp_avg"], 0)  # (a parameter and its statistic, as a parameter round's)
    slices = Slices(tensors, [1.0] * 4, compression, 400, prefetch=1, infos=infos)
    kinds = [kind for kind, _ in slices.layout()]
    first = sum(slices.container.num_parts_by_tensor[:len([o for o in slices.owners if o == 0])])
    assert set(kinds[:first]) == {Float16Compression.compression_type}
    assert set(kinds[first:]) == {NoCompression.compression_type}
    without = Slices(tensors, [1.0] * 4, compression, 400, prefetch=1)
    assert {kind for kind, _ in without.layout()} == {NoCompression.compression_type}
    with pytest.raises(ValueError, match="2 compression infos for 3 tensors"):
        Slices([*tensors, torch.zeros(3)], [1.0] * 4, compression, 400, prefetch=1, infos=infos)


def test_members_that_cut_otherwise_never_share_a_matchmaking_key(monkeypatch):
    shapes = [(torch.Size([10]), torch.float32)]
    key = round_schema(shapes, NoCompression(), 2**19, "mean")
    assert key == round_schema(shapes, NoCompression(), 2**19, "mean")
    roles = [CompressionInfo.from_tensor(torch.zeros(10), key=0, role=TensorRole.PARAMETER)]
    assert round_schema(shapes, NoCompression(), 2**19, "mean", roles) != key  # (an adaptive one chooses by them)
    others = [CompressionInfo.from_tensor(torch.zeros(10), key=0, role=TensorRole.OPTIMIZER)]
    assert round_schema(shapes, NoCompression(), 2**19, "mean", others) != round_schema(
        shapes, NoCompression(), 2**19, "mean", roles)
    with pytest.raises(ValueError, match="1 compression infos for 2 tensors"):
        round_schema(shapes * 2, NoCompression(), 2**19, "mean", roles)
    monkeypatch.setattr(round_schema_module, "LAYOUT", "whole parts")
    assert round_schema(shapes, NoCompression(), 2**19, "mean") != key


def test_a_tensor_with_no_element_is_no_part_of_any_slice():
    # hivemind's container gives an empty tensor's part to the member it has reached: before the first non-empty
    # tensor, the first member, a client (fraction 0) too, which takes no streams
    tensors = [torch.zeros(0), torch.ones(10), torch.zeros(2, 0, dtype=torch.float16)]
    assert TensorPartContainer(tensors, [0.0, 1.0]).num_parts_by_peer == (1, 2)
    slices = Slices(tensors, [0.0, 1.0], NoCompression(), 2**19, prefetch=1)
    assert slices.container.num_parts_by_peer == (0, 1)
    back = slices.whole([piece.clone() for piece in slices.container.local_tensors])
    assert [(b.shape, b.dtype) for b in back] == [(t.shape, t.dtype) for t in tensors]
    assert torch.equal(back[1], tensors[1])
    nothing = Slices([torch.zeros(0)], [1.0, 1.0], NoCompression(), 2**19, prefetch=1)
    assert nothing.container.num_parts_by_peer == (0, 0) and nothing.whole([])[0].shape == (0,)
