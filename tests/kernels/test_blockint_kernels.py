"""The int8 / int4 kernels on every native backend against the specification, bit for bit.

Backends: ``cpu:<isa>`` (the variant this CPU picks) and ``cuda`` (the CUDA
kernels of csrc/cuda/blockint.cu, skipped without a GPU or without a CUDA build of the
extension). Outputs are compared as bytes, so even the sign of a zero must match. The CUDA
cases exercise its layouts on purpose: blocks of one warp chunk (1024 elements) or less, blocks
split over several chunks (combined by atomicMax), and a single block for the whole tensor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commpress import CodecError
from commpress.errors import NonFiniteError
from commpress.kernels import blockint as fast
from commpress.kernels import ops
from commpress.spec import blockint as spec
from commpress.spec.bitpack import pack_bits_reference

import kernel_backends
from strategies import DTYPES, tensors

# the CPU variant this CPU picks (tests/codecs/test_blockint.py runs every ISA variant)
BACKENDS = kernel_backends.params(all_isas=False, op="blockint_encode", python=False)
# 1024 is the CUDA amax chunk: 1025 and 3000 take the multi-chunk path, 2**31 - 1 one block.
BLOCKS = st.sampled_from([1, 7, 16, 256, 1000, 1024, 1025, 3000, 2**31 - 1])


def parametrize_backends(fn):
    return pytest.mark.parametrize("backend", BACKENDS, indirect=True)(fn)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.numel() else t


@st.composite
def hard_tensors(draw):
    """Edge-case tensors with subnormals, signed zeros and values near the refusing limit mixed in."""
    x = draw(tensors(lengths=st.one_of(st.integers(0, 1500), st.sampled_from([2047, 4100, 9001])))).clone()
    n = x.numel()
    if n and draw(st.booleans()):
        fi = torch.finfo(x.dtype)
        specials = torch.tensor([fi.tiny / 4, -fi.tiny / 3, fi.tiny, 0.0, -0.0, 1.0, -127.5, 0.5, 3.5,
                                 fi.max / 256, -fi.max / 300], dtype=torch.float64).to(x.dtype)  # fmt: skip
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        idx = torch.randint(0, n, (draw(st.integers(1, 40)),), generator=g)
        x[idx] = specials[torch.randint(0, len(specials), (idx.numel(),), generator=g)]
    return x


def check_encode_decode(backend, x: torch.Tensor, bits: int, block: int, seed: int = 0) -> None:
    """Encode and decode (fresh and accumulate) on ``backend`` equal the specification's bytes."""
    case = f"n={x.numel()} {x.dtype} bits={bits} block={block}"
    spec_block = min(block, max(x.numel(), 1))  # the spec pads a block longer than x to its length
    try:
        s_ref, f_ref = spec.encode_reference(x, bits, spec_block)
    except CodecError as exc:  # the decode would overflow: the kernel refuses too
        assert "overflow" in str(exc)
        with pytest.raises(CodecError, match="overflow"):
            backend.ops.blockint_encode(x.to(backend), bits, block)
        return
    s, f = backend.ops.blockint_encode(x.to(backend), bits, block)
    assert s.device.type == f.device.type == backend.split(":")[0], case
    assert s.dtype == s_ref.dtype and torch.equal(_bytes(s), _bytes(s_ref)), f"scales {case}"
    assert torch.equal(f.cpu(), f_ref), f"fields {case}"
    g = torch.Generator().manual_seed(seed)
    for accumulate in (False, True):
        base = torch.randn(x.numel(), generator=g).to(x.dtype)
        want = base.clone()
        spec.decode_reference(s_ref, f_ref, bits, spec_block, want, accumulate)
        got = base.to(backend)
        backend.ops.blockint_decode(s, f, bits, block, got, accumulate)
        assert torch.equal(_bytes(got), _bytes(want)), f"decode accumulate={accumulate} {case}"


@parametrize_backends
@pytest.mark.parametrize("bits", [8, 4])
@given(x=hard_tensors(), block=BLOCKS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_encode_decode_are_the_specification(backend, bits: int, x: torch.Tensor, block: int) -> None:
    check_encode_decode(backend, x, bits, block)


@parametrize_backends
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_tensors_over_every_layout(backend, bits: int, dtype: torch.dtype) -> None:
    """Many blocks and tasks, long blocks split over chunks, one block; an odd length."""
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(20_001, generator=g, dtype=torch.float64) * 3).to(dtype)
    x[5], x[6] = 0.0, -0.0
    for block in (256, 5000, 2**31 - 1):
        check_encode_decode(backend, x, bits, block, seed=block)


@parametrize_backends
@pytest.mark.parametrize("bits", [8, 4])
@given(n=st.integers(0, 3000), block=BLOCKS, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31),
       accumulate=st.booleans())  # fmt: skip
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_decode_of_any_fields_and_scales(backend, bits: int, n: int, block: int, dtype: torch.dtype, seed: int,
                                         accumulate: bool) -> None:  # fmt: skip
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
    want = base.clone()
    spec.decode_reference(scales, packed, bits, eff, want, accumulate)
    got = base.to(backend)
    backend.ops.blockint_decode(scales.to(backend), packed.to(backend), bits, block, got, accumulate)
    assert torch.equal(_bytes(got), _bytes(want))


@parametrize_backends
@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_and_overflowing_input_raise(backend, bits: int) -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5000)
        x[4321] = bad
        with pytest.raises(NonFiniteError):
            backend.ops.blockint_encode(x.to(backend), bits, 1025)
    # at float32's largest value 127 * fl(max / 127) rounds to Inf (refused); 7 * fl(max / 7) does not
    x = torch.full((3000,), torch.finfo(torch.float32).max)
    x[::3] = -1.0
    if bits == 8:
        with pytest.raises(CodecError, match="overflow"):
            backend.ops.blockint_encode(x.to(backend), bits, 1025)
    check_encode_decode(backend, x, bits, 1025)
    x16 = torch.full((300,), 65504.0, dtype=torch.float16)  # decodes finite in fp16: accepted
    check_encode_decode(backend, x16, bits, 256)


@parametrize_backends
@pytest.mark.parametrize("bits", [8, 4])
def test_the_fast_path_routes_to_the_native_kernel(backend, bits: int) -> None:
    """commpress.kernels.blockint runs the native op for the tensor's device, same bits as the spec."""
    device = backend.split(":")[0]
    assert ops.backend_for("blockint_encode", device) == "native"
    assert ops.backend_for("blockint_decode", device) == "native"
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(1)) * 2
    s, f = fast.encode(x.to(device), bits, 256)
    s_ref, f_ref = spec.encode_reference(x, bits, 256)
    assert torch.equal(_bytes(s), _bytes(s_ref)) and torch.equal(f.cpu(), f_ref)
    out = torch.empty(x.numel(), device=device)
    fast.decode(s, f, bits, 256, out)
    want = torch.zeros(x.numel())
    spec.decode_reference(s_ref, f_ref, bits, 256, want)
    assert torch.equal(_bytes(out), _bytes(want))
