"""Property tests of the block-scaled integer codecs ``int8`` / ``int4`` (commpress.spec.blockint).

The stated error bound, zero blocks, exact grid values, idempotence of re-encoding a decode,
the wire size formula, bad input, and the fast paths bit for bit against the specification:
the native CPU kernels (every instruction-set variant) and the torch path.
"""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError, WireError, codecs, wire
from commpress.errors import KernelArgumentError, NonFiniteError
from commpress.kernels import blockint as fast
from commpress.kernels import ops
from commpress.spec import blockint as spec
from commpress.spec.bitpack import pack_bits_reference

import kernel_backends
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
    """:func:`fast.encode` / :func:`fast.decode` (native where built) and the torch path they fall back to."""
    bits = BITS[name]
    s_ref, f_ref = spec.encode_reference(x, bits, block)
    for encode, decode in ((fast.encode, fast.decode), (fast.encode_torch, fast.decode_torch)):
        s_fast, f_fast = encode(x, bits, block)
        assert s_ref.dtype == s_fast.dtype and torch.equal(s_ref, s_fast) and torch.equal(f_ref, f_fast)
        for accumulate in (False, True):
            base = torch.randn(x.numel()).to(x.dtype)
            a, b = base.clone(), base.clone()
            spec.decode_reference(s_ref, f_ref, bits, block, a, accumulate)
            decode(s_ref, f_ref, bits, block, b, accumulate)
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


# ----- the native kernels (csrc/cpu/blockint.cpp) against the specification ----------------------
NATIVE_REASON = None if ops.has_native("blockint_encode", "cpu") else f"no native CPU blockint ops ({ops.load_native()})"
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=str(NATIVE_REASON))
ISAS = ops.cpu_isas() or ["default"]
NATIVE_BLOCKS = st.one_of(BLOCKS, st.integers(1, 1100), st.sampled_from([2**20, 2**31 - 1]))


_isa = kernel_backends.cpu_isa


@st.composite
def hard_tensors(draw):
    """Edge-case tensors, some with subnormals, zeros, -0 and values near the refusing limit mixed in."""
    x = draw(tensors()).clone()
    n = x.numel()
    if n and draw(st.booleans()):
        fi = torch.finfo(x.dtype)
        specials = torch.tensor(
            [fi.tiny / 4, -fi.tiny / 3, fi.tiny, fi.smallest_normal * 0.999, 0.0, -0.0, 1.0, -127.5, 0.5,
             fi.max / 256, -fi.max / 300],
            dtype=torch.float64).to(x.dtype)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        idx = torch.randint(0, n, (draw(st.integers(1, 40)),), generator=g)
        x[idx] = specials[torch.randint(0, len(specials), (idx.numel(),), generator=g)]
    if n and draw(st.integers(0, 5)) == 0:  # all subnormal: subnormal (or underflowing) scales
        x = (x.double().sign() * torch.finfo(x.dtype).tiny * 2.0 ** -draw(st.integers(1, 9))).to(x.dtype)
    return x


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.numel() else t


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
@given(x=hard_tensors(), block=NATIVE_BLOCKS)
@settings(max_examples=70, deadline=None)
def test_native_kernels_are_the_specification_bit_for_bit(isa, bits, x, block):
    spec_block = min(block, max(x.numel(), 1))  # the spec pads a block longer than x to its length
    try:
        s_ref, f_ref = spec.encode_reference(x, bits, spec_block)
    except CodecError as exc:  # overflow refusal: the native op refuses too
        with _isa(isa), pytest.raises(CodecError, match="overflow"):
            ops.blockint_encode(x, bits, block)
        assert "overflow" in str(exc)
        return
    with _isa(isa):
        s, f = ops.blockint_encode(x, bits, block)
    assert s.dtype == s_ref.dtype and torch.equal(_bytes(s), _bytes(s_ref)) and torch.equal(f, f_ref)
    for accumulate in (False, True):
        base = torch.randn(x.numel()).to(x.dtype)
        a, b = base.clone(), base.clone()
        spec.decode_reference(s_ref, f_ref, bits, spec_block, a, accumulate)
        with _isa(isa):
            ops.blockint_decode(s_ref, f_ref, bits, block, b, accumulate)
        assert torch.equal(_bytes(a), _bytes(b))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
@given(n=st.integers(0, 1500), block=NATIVE_BLOCKS, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31),
       accumulate=st.booleans())
@settings(max_examples=60, deadline=None)
def test_native_decode_of_any_fields_and_scales_is_the_specification(isa, bits, n, block, dtype, seed, accumulate):
    """Every field value (255 / 15 included, which the wire refuses) and scales of every size."""
    g = torch.Generator().manual_seed(seed)
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    eff = min(block, max(n, 1))
    nb = spec.n_blocks(n, eff)
    mags = torch.tensor([0.0, torch.finfo(ct).tiny / 8, 1e-3, 1.0, 3.0, 100.0], dtype=ct)
    scales = mags[torch.randint(0, len(mags), (nb,), generator=g)] * torch.rand(nb, generator=g, dtype=ct)
    fields = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
    packed = fields if bits == 8 else pack_bits_reference(fields, bits)
    base = torch.randn(n, generator=g).to(dtype)
    a, b = base.clone(), base.clone()
    spec.decode_reference(scales, packed, bits, eff, a, accumulate)
    with _isa(isa):
        ops.blockint_decode(scales, packed, bits, block, b, accumulate)
    assert torch.equal(_bytes(a), _bytes(b))


@needs_native
@pytest.mark.parametrize("name", BITS)
def test_the_codec_runs_the_native_ops_and_the_torch_path_gives_the_same_bits(name):
    x = torch.randn(100_003) * 3
    codec = codecs.get(name)
    assert ops.backend_for("blockint_encode", "cpu") == "native"
    native = wire.to_bytes(codec.encode(x))
    y_native = codec.decode(codec.encode(x))
    with ops.use_backend("reference"):  # kernels.blockint then runs its torch path
        assert ops.backend_for("blockint_encode", "cpu") == "reference"
        torch_path = wire.to_bytes(codec.encode(x))
        y_torch = codec.decode(codec.encode(x))
    assert torch.equal(native, torch_path) and torch.equal(y_native, y_torch)
    s, f = fast.encode_torch(x, BITS[name], 256)
    assert torch.equal(s, codec.encode(x).sections["scales"]) and torch.equal(f, codec.encode(x).sections["fields"])


@needs_native
@pytest.mark.parametrize("name", BITS)
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_bad_input_gives_the_same_errors_on_the_native_and_the_torch_path(name, backend):
    codec = codecs.get(name)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in DTYPES:
            x = torch.randn(1000).to(dtype)
            x[777] = bad
            with ops.use_backend(backend), pytest.raises(NonFiniteError, match="NaN or Inf"):
                codec.encode(x)
    refused = 0
    for dtype in DTYPES:
        for top in (torch.finfo(dtype).max, torch.finfo(dtype).max * 0.999):
            x = torch.zeros(300, dtype=dtype)
            x[5], x[299] = top, -top
            try:
                spec.encode_reference(x, BITS[name], 256)
            except CodecError:
                refused += 1
                with ops.use_backend(backend), pytest.raises(CodecError, match="overflow"):
                    codec.encode(x)
            else:
                with ops.use_backend(backend):
                    assert bool(torch.isfinite(codec.decode(codec.encode(x))).all())
    assert refused >= 1


@needs_native
def test_native_op_argument_errors_are_clear():
    x = torch.randn(100)
    with pytest.raises(KernelArgumentError, match="blockint_encode: bits must be one of 8, 4"):
        ops.blockint_encode(x, 2, 16)
    with pytest.raises(KernelArgumentError, match="blockint_encode: block_size must be >= 1"):
        ops.blockint_encode(x, 8, 0)
    with pytest.raises(KernelArgumentError, match="blockint_encode: x must have dtype"):
        ops.blockint_encode(torch.arange(10), 8, 16)
    with pytest.raises(KernelArgumentError, match="blockint_encode: x must be 1-D"):
        ops.blockint_encode(x.view(10, 10), 8, 16)
    s, f = ops.blockint_encode(x, 4, 16)
    out = torch.empty(100)
    with pytest.raises(KernelArgumentError, match="blockint_decode: scales has 6 elements"):
        ops.blockint_decode(s[:6], f, 4, 16, out)
    with pytest.raises(KernelArgumentError, match="blockint_decode: packed has 49 bytes"):
        ops.blockint_decode(s, f[:49], 4, 16, out)
    with pytest.raises(KernelArgumentError, match="blockint_decode: scales must have dtype float64"):
        ops.blockint_decode(s, f, 4, 16, out.double())
    # the native op's own checks when called directly (torch.ops.commpress.*)
    with pytest.raises(RuntimeError, match="blockint_encode: bits must be one of 4, 8"):
        torch.ops.commpress.blockint_encode(x, 3, 16)
    with pytest.raises(RuntimeError, match="blockint_decode: packed has 49 bytes"):
        torch.ops.commpress.blockint_decode(s, f[:49], 4, 16, out)
    with pytest.raises(ValueError, match="blockint_encode: x contains NaN or Inf"):
        torch.ops.commpress.blockint_encode(torch.tensor([1.0, float("nan")]), 8, 16)


@needs_native
def test_native_ops_trace_with_opcheck():
    x = torch.randn(1000)
    s, f = torch.ops.commpress.blockint_encode(x, 4, 256)
    torch.library.opcheck(torch.ops.commpress.blockint_encode.default, (x, 4, 256))
    torch.library.opcheck(torch.ops.commpress.blockint_decode.default, (s, f, 4, 256, torch.zeros(1000), True))


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 255, 256, 40_000])
def test_native_kernels_split_across_threads_give_the_specification(bits, block):
    """Several parallel chunks (odd blocks: chunk boundaries on whole 4-bit bytes), every ISA."""
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(block)) * 10
    x[::997] = 0
    s_ref, f_ref = spec.encode_reference(x, bits, block)
    y_ref = torch.empty_like(x)
    spec.decode_reference(s_ref, f_ref, bits, block, y_ref)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        for isa in ISAS:
            with _isa(isa):
                s, f = ops.blockint_encode(x, bits, block)
                y = torch.empty_like(x)
                ops.blockint_decode(s, f, bits, block, y, False)
            assert torch.equal(s, s_ref) and torch.equal(f, f_ref) and torch.equal(y, y_ref), isa
    finally:
        torch.set_num_threads(threads)
