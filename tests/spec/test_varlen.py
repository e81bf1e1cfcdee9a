"""Elias-gamma coding of QSGD levels (commpress/spec/varlen.py) against an independent bit-string spec."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from commpress import CodecError, WireError, codecs, wire
from commpress.spec import varlen

LEVELS = [1, 3, 7, 100, 127]


def spec_bits(fields, s):
    """The stream as a '0'/'1' string, written straight from the module docstring."""
    out = []
    for f in fields:
        q = int(f) - s
        v = abs(q) + 1
        binary = bin(v)[2:]  # most significant bit first
        out.append("0" * (len(binary) - 1) + binary)
        if q:
            out.append("1" if q < 0 else "0")
    return "".join(out)


def spec_bytes(fields, s):
    bits = spec_bits(fields, s)
    bits += "0" * (-len(bits) % 8)
    # LSB-first: stream bit j is bit j % 8 of byte j // 8
    return bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))


def fields_of(levels, s):
    return torch.tensor([q + s for q in levels], dtype=torch.uint8)


@st.composite
def level_lists(draw):
    s = draw(st.sampled_from(LEVELS))
    qs = draw(st.lists(st.integers(-s, s), max_size=300))
    return s, qs


@given(level_lists())
def test_stream_matches_the_spec_and_round_trips(case):
    s, qs = case
    fields = fields_of(qs, s)
    stream = varlen.encode(fields, s)
    assert bytes(stream.numpy().tobytes()) == spec_bytes(fields.tolist(), s)
    assert stream.numel() <= varlen.max_nbytes(len(qs), s)
    assert torch.equal(varlen.decode(stream, len(qs), s), fields)


def test_code_lengths_by_hand():
    # 0 -> "1"; +1 -> "010" + "0"; -2 -> "011" + "1"; +3 -> "00100" + "0"
    assert spec_bits(fields_of([0, 1, -2, 3], 7).tolist(), 7) == "1" + "0100" + "0111" + "001000"
    stream = varlen.encode(fields_of([0, 1, -2, 3], 7), 7)
    assert stream.tolist() == [int("10100011"[::-1], 2), int("1001000"[::-1], 2)]  # LSB-first


@pytest.mark.parametrize("s", LEVELS)
def test_worst_case_reaches_max_nbytes(s):
    fields = fields_of([s, -s] * 50, s)
    assert varlen.encode(fields, s).numel() == varlen.max_nbytes(100, s)


def test_pure_python_loops_match_numba():
    if not varlen.HAVE_NUMBA:
        pytest.skip("numba not installed: the module already runs the pure-Python loops")
    import numpy as np

    fields = fields_of(list(range(-7, 8)) * 9, 7).numpy()
    a = np.zeros(varlen.max_nbytes(fields.size, 7), dtype=np.uint8)
    b = a.copy()
    assert varlen._encode(fields, np.int64(7), a) == varlen._encode.py_func(fields, np.int64(7), b)
    assert np.array_equal(a, b)


def test_malformed_streams_name_the_problem():
    s = 7
    good = varlen.encode(fields_of([3, -1, 0, 0, 2, 0], s), s)  # 6 + 4 + 1 + 1 + 4 + 1 = 17 bits
    assert good.numel() == 3 and torch.equal(varlen.decode(good, 6, s), fields_of([3, -1, 0, 0, 2, 0], s))
    with pytest.raises(WireError, match="ends inside element 5 of 6"):
        varlen.decode(good[:-1], 6, s)
    with pytest.raises(WireError, match="trailing bytes"):
        varlen.decode(torch.cat([good, torch.zeros(1, dtype=torch.uint8)]), 6, s)
    with pytest.raises(WireError, match="trailing bytes"):
        varlen.decode(good, 4, s)
    padded = good.clone()
    padded[-1] |= 0x80  # bit 23 is padding
    with pytest.raises(WireError, match="padding bits"):
        varlen.decode(padded, 6, s)
    # v = 16 ("0000" + "10000") codes level 15 > 7: rejected once the zero run is too long
    with pytest.raises(WireError, match="element 0 codes a level above levels = 7"):
        varlen.decode(torch.tensor([0b00000000, 0b1], dtype=torch.uint8), 1, s)
    # v = 9 (level 8) has a legal run length (3) but is above s
    with pytest.raises(WireError, match="element 0 codes a level above"):
        varlen.decode(torch.tensor([int("0001001"[::-1], 2)], dtype=torch.uint8), 1, s)
    with pytest.raises(CodecError, match="<= 2 \\* levels"):
        varlen.encode(torch.tensor([15], dtype=torch.uint8), s)


@given(st.binary(max_size=64), st.integers(0, 200), st.sampled_from(LEVELS))
def test_arbitrary_bytes_decode_or_raise(raw, n, s):
    stream = torch.tensor(list(raw), dtype=torch.uint8)
    try:
        fields = varlen.decode(stream, n, s)
    except WireError:
        return
    assert fields.numel() == n and (n == 0 or int(fields.max()) <= 2 * s)
    assert torch.equal(varlen.encode(fields, s), stream)  # only the canonical stream decodes


def test_gamma_qsgd_decodes_exactly_like_fixed_and_is_smaller():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    for bits in (2, 4, 8):
        fixed = codecs.get("qsgd", bits=bits)
        gamma = codecs.get("qsgd", bits=bits, coding="gamma")
        assert not gamma.fixed_size and fixed.fixed_size
        a, b = fixed.encode(x, seed=9), gamma.encode(x, seed=9)
        assert torch.equal(fixed.decode(a), gamma.decode(wire.from_bytes(wire.to_bytes(b))))
        assert wire.to_bytes(b).numel() < wire.to_bytes(a).numel()
    assert codecs.to_spec(gamma) == "qsgd:bits=8,levels=127,bucket_size=512,coding=gamma"
    assert codecs.from_spec(codecs.to_spec(gamma)) == gamma
    with pytest.raises(CodecError, match="coding must be one of fixed, gamma"):
        codecs.get("qsgd", coding="rice")


def test_wire_rejects_a_declared_length_beyond_the_maximum():
    codec = codecs.get("qsgd", bits=4, coding="gamma")
    buf = wire.to_bytes(codec.encode(torch.randn(100), seed=1)).clone()
    bad = buf.clone()
    bad[48:56] = torch.tensor(list((varlen.max_nbytes(100, 7) + 1).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(WireError, match=r"length\[1\] \(levels\).*needs at most"):
        wire.from_bytes(bad)
    bad = buf.clone()
    bad[24:32] = torch.tensor(list((4 | 7 << 8 | 5 << 16).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(WireError, match="params.coding"):
        wire.from_bytes(bad)


def test_ddp_refuses_variable_size_codecs():
    from commpress.ddp.state import CompressionState

    with pytest.raises(CodecError, match="data-dependent size"):
        CompressionState(torch.nn.Linear(2, 2), "qsgd", coding="gamma")
