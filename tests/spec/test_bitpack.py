"""Reference bit packing: the specification itself (native kernels: test_native.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from commpress import CodecError
from commpress.kernels import ops
from commpress.spec.bitpack import (
    pack_bits_reference,
    packed_nbytes,
    padding_is_zero,
    unpack_bits_reference,
)

EDGE_LENGTHS = [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 255, 257, 1023, 1025]


@st.composite
def fields_and_bits(draw):
    bits = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, 3000)))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int32).to(torch.uint8), bits


@given(fields_and_bits())
def test_reference_round_trip_and_size(fb):
    fields, bits = fb
    packed = pack_bits_reference(fields, bits)
    assert packed.numel() == packed_nbytes(fields.numel(), bits)
    assert padding_is_zero(packed, bits, fields.numel())
    assert torch.equal(unpack_bits_reference(packed, bits, fields.numel()), fields)


@given(fields_and_bits())
def test_ops_wrapper_matches_reference(fb):
    fields, bits = fb
    packed = ops.pack_bits(fields, bits)
    assert torch.equal(packed, pack_bits_reference(fields, bits))
    assert torch.equal(ops.unpack_bits(packed, bits, fields.numel()), fields)


def test_layout_is_lsb_first():
    # field i sits at bit offset (i * bits) % 8 of byte (i * bits) // 8
    assert pack_bits_reference(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x81, 0x01]
    assert pack_bits_reference(torch.tensor([3, 0, 2], dtype=torch.uint8), 2).tolist() == [0x23]
    assert pack_bits_reference(torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8), 4).tolist() == [0x5A, 0x0F]


@pytest.mark.parametrize("pack", [pack_bits_reference, ops.pack_bits])
def test_pack_rejects_bad_input(pack):
    with pytest.raises(CodecError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(CodecError, match="uint8"):
        pack(torch.zeros(4), 1)
    with pytest.raises(CodecError, match="1-D"):
        pack(torch.zeros(2, 2, dtype=torch.uint8), 1)
    with pytest.raises(CodecError):
        pack(torch.tensor([4], dtype=torch.uint8), 2)


@pytest.mark.parametrize("unpack", [unpack_bits_reference, ops.unpack_bits])
def test_unpack_rejects_wrong_length(unpack):
    with pytest.raises(CodecError, match="bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 7)
