"""Property tests of the block-scaled integer codecs ``int8`` / ``int4`` (commpress.spec.blockint).

The stated error bound, zero blocks, exact grid values, idempotence of re-encoding a decode,
the wire size formula, bad input, and the fast path bit for bit against the specification.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError, WireError, codecs, wire
from commpress.errors import NonFiniteError
from commpress.kernels import blockint as fast
from commpress.spec import blockint as spec

from strategies import DTYPES, tensors

BITS = {"int8": 8, "int4": 4}
BLOCKS = st.sampled_from([1, 7, 16, 256, 1000])


def _codec(name, block):
    return codecs.get(name, block_size=block)


@pytest.mark.parametrize("name", BITS)
@given(x=tensors(), block=BLOCKS)
@settings(max_examples=60)
def test_error_within_half_a_step(name, x, block):
    codec = _codec(name, block)
    packet = codec.encode(x)
    y = codec.decode(packet)
    bound = spec.error_bound(packet.sections["scales"], block, x.numel(), BITS[name], x.dtype, y)
    err = (y.double() - x.double()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    if x.dtype == torch.float64:  # no subnormal scales at these magnitudes: the plain scale/2 (+ 2 q_max u)
        s = packet.sections["scales"].repeat_interleave(block)[: x.numel()]
        assert bool((err <= s * (0.5 + 1e-12)).all())


@pytest.mark.parametrize("name", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_decode_to_zeros_and_keep_scale_zero(name, dtype):
    x = torch.randn(1000).to(dtype)
    x[256:512] = 0
    x[512:600] = -0.0
    codec = _codec(name, 256)
    packet = codec.encode(x)
    assert float(packet.sections["scales"][1]) == 0.0
    y = codec.decode(packet)
    assert bool((y[256:512] == 0).all()) and not bool(torch.signbit(y[256:512]).any())
    assert torch.equal(codec.decode(codec.encode(torch.zeros(777, dtype=dtype))), torch.zeros(777, dtype=dtype))


@pytest.mark.parametrize("name", BITS)
@given(seed=st.integers(0, 2**31), e=st.integers(-30, 30), m=st.integers(1, 1023), block=BLOCKS,
       n=st.integers(1, 700), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_grid_values_are_exact(name, seed, e, m, block, n, dtype):
    """``k * s`` with integer ``|k| <= q_max``, a ``|k| = q_max`` per block and ``q_max * s`` exact."""
    qmax = spec.QMAX[BITS[name]]
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-qmax, qmax + 1, (n,), generator=g)
    k[::block] = qmax  # every block reaches q_max
    s = m * 2.0**e  # <= 10 significant bits: q_max * s is exact in float32
    x = (k.double() * s).to(dtype)
    codec = _codec(name, block)
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("name", BITS)
@given(x=tensors(dtypes=[torch.float32, torch.float64]), block=BLOCKS)
@settings(max_examples=60)
def test_reencoding_a_decode_is_idempotent(name, x, block):
    codec = _codec(name, block)
    p1 = codec.encode(x)
    y = codec.decode(p1)
    p2 = codec.encode(y)
    assert torch.equal(wire.to_bytes(p1)[40:], wire.to_bytes(p2)[40:]) or (
        torch.equal(p1.sections["scales"], p2.sections["scales"])
        and torch.equal(p1.sections["fields"], p2.sections["fields"])
    )
    assert torch.equal(codec.decode(p2), y)


@pytest.mark.parametrize("name", BITS)
@given(x=tensors(), block=BLOCKS)
@settings(max_examples=40)
def test_wire_size_formula(name, x, block):
    codec = _codec(name, block)
    d, bits = x.numel(), BITS[name]
    scale_bytes = 8 if x.dtype == torch.float64 else 4
    payload = -(-d // block) * scale_bytes + -(-d * bits // 8)
    assert spec.wire_nbytes(d, bits, block, x.dtype) == payload
    pad8 = lambda b: -(-b // 8) * 8  # noqa: E731
    expected = 40 + 2 * 8 + pad8(-(-d // block) * scale_bytes) + pad8(-(-d * bits // 8))
    buf = wire.to_bytes(codec.encode(x))
    assert buf.numel() == codec.wire_size(d, x.dtype) == expected


@pytest.mark.parametrize("name", BITS)
@given(x=tensors(), block=BLOCKS)
@settings(max_examples=60)
def test_fast_path_is_the_specification_bit_for_bit(name, x, block):
    bits = BITS[name]
    s_ref, f_ref = spec.encode_reference(x, bits, block)
    s_fast, f_fast = fast.encode(x, bits, block)
    assert s_ref.dtype == s_fast.dtype and torch.equal(s_ref, s_fast) and torch.equal(f_ref, f_fast)
    for accumulate in (False, True):
        base = torch.randn(x.numel()).to(x.dtype)
        a, b = base.clone(), base.clone()
        spec.decode_reference(s_ref, f_ref, bits, block, a, accumulate)
        fast.decode(s_ref, f_ref, bits, block, b, accumulate)
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)


def test_round_half_to_even():
    # block max 127 (int8): scale exactly 1, so x / s is the value itself
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    y = codecs.get("int8").decode(codecs.get("int8").encode(x))
    assert y.tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0]
    x4 = torch.tensor([7.0, 0.5, 1.5, 2.5, -3.5])  # int4: scale 1
    assert codecs.get("int4").decode(codecs.get("int4").encode(x4)).tolist() == [7.0, 0.0, 2.0, 2.0, -4.0]


def test_int4_packs_two_values_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 1.0])  # fields q + 7: 14, 0, 8
    p = codecs.get("int4").encode(x)
    assert p.sections["fields"].tolist() == [14 | 0 << 4, 8]


@pytest.mark.parametrize("name", BITS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_a_codec_error(name, bad):
    x = torch.randn(300)
    x[123] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        codecs.get(name).encode(x)
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        spec.encode_reference(x, BITS[name], 256)
    assert issubclass(NonFiniteError, CodecError)


@pytest.mark.parametrize("name", BITS)
def test_bad_configuration_and_input_rejected(name):
    for block in (0, -1, 2**31, 1.5, True, "256"):
        with pytest.raises(CodecError, match="block_size"):
            codecs.get(name, block_size=block)
    with pytest.raises(CodecError, match="unexpected keyword"):
        codecs.get(name, bits=8)
    with pytest.raises(CodecError, match="dtype"):
        codecs.get(name).encode(torch.arange(10))
    near_max = torch.full((4,), torch.finfo(torch.float16).max, dtype=torch.float16)
    codecs.get(name).encode(near_max)  # 65504 decodes finite
    # at float32's largest value q_max * fl(max / q_max) may round past it: refused, or decodes finite
    top = torch.full((4,), torch.finfo(torch.float32).max)
    s = top[:1] / spec.QMAX[BITS[name]]
    if bool(torch.isfinite(s * spec.QMAX[BITS[name]])):
        assert bool(torch.isfinite(codecs.get(name).decode(codecs.get(name).encode(top))).all())
    else:
        with pytest.raises(CodecError, match="overflow"):
            codecs.get(name).encode(top)
    assert name != "int8" or not bool(torch.isfinite(s * 127))  # int8 is the refusing case here


@pytest.mark.parametrize("name", BITS)
def test_hostile_packets_rejected(name):
    codec = codecs.get(name, block_size=16)
    buf = wire.to_bytes(codec.encode(torch.randn(40)))
    layout = codec.layout(40, torch.float32, codec.wire_params(40))
    scales_off, fields_off = 40 + 16, 40 + 16 + 16  # 3 scales (12 bytes, padded to 16)
    assert layout[0].numel == 3
    bad = buf.clone()
    bad[scales_off : scales_off + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(WireError, match="scales"):
        wire.from_bytes(bad)
    bad = buf.clone()
    bad[scales_off : scales_off + 4] = torch.tensor([3e38]).view(torch.uint8)
    with pytest.raises(WireError, match="overflow"):
        wire.from_bytes(bad)
    bad = buf.clone()
    bad[fields_off] = 255
    with pytest.raises(WireError, match="fields"):
        wire.from_bytes(bad)
