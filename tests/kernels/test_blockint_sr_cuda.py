"""The CUDA kernel of ``blockint_encode_sr`` (csrc/cuda/blockint.cu) against the specification, bit for bit.

The specification is :func:`commpress.spec.blockint.encode_stochastic_reference`, run on the
CPU; the kernel runs on a CUDA copy of the same tensor and its scales (as bytes, so even the
sign of a zero must match) and packed fields must be the reference's. Element i's uniform comes
from its global index, so every thread layout must draw the CPU's numbers: the lengths and
blocks cover one warp word or less, ragged last words and blocks, blocks of one amax chunk
(1024 elements) or several (1025, 3000: combined by atomicMax), and one block for the whole
tensor (2**31 - 1). The CPU kernels are tested the same way in test_blockint_sr.py.

Skipped without a CUDA device or without a CUDA build of the extension.
"""

from __future__ import annotations

import pytest
import torch

from commpress import CodecError
from commpress.errors import NonFiniteError
from commpress.kernels import ops
from commpress.spec import blockint as spec

import kernel_backends

SKIP_REASON = kernel_backends.cuda_reason("blockint_encode_sr")
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

DEVICE = "cuda"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LENGTHS = [0, 1, 17, 1023, 1025, 4097, 300_001]
BLOCKS = [1, 7, 64, 1024, 1025, 3000, 2**31 - 1]
# 0 and 2**64 - 1 (int64 -1 in the schema); 2**63 + 5 has only the sign bit set of the high ones
SEEDS = [0, 5, 2**63 + 5, 2**64 - 1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.numel() else t


def _input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over several magnitudes, with zeros, signed zeros, an all-zero block and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, n, dtype=torch.float64)).to(dtype)
    x[3::997] = 0.0  # not x[0]: the one element of n = 1 stays nonzero
    x[5::991] = -0.0
    x[20:27] = 0.0  # one whole block of 7 or of 1
    x[40:47] = torch.finfo(dtype).tiny / 4  # subnormal in x's dtype (a subnormal scale for float32/float64)
    return x


def check_against_spec(x: torch.Tensor, bits: int, block: int, seed: int) -> None:
    """The CUDA op's scales and fields are the specification's bytes (or both refuse)."""
    case = f"n={x.numel()} {x.dtype} bits={bits} block={block} seed={seed}"
    spec_block = min(block, max(x.numel(), 1))  # the spec pads a block longer than x to its length
    try:
        s_ref, f_ref = spec.encode_stochastic_reference(x, bits, spec_block, seed)
    except CodecError as exc:  # the decode would overflow: the kernel refuses too
        assert "overflow" in str(exc), case
        with pytest.raises(CodecError, match="overflow"):
            ops.blockint_encode_sr(x.to(DEVICE), bits, block, seed)
        return
    s, f = ops.blockint_encode_sr(x.to(DEVICE), bits, block, seed)
    assert s.device.type == f.device.type == DEVICE, case
    assert s.dtype == s_ref.dtype and torch.equal(_bytes(s), _bytes(s_ref)), f"scales {case}"
    assert f.dtype == torch.uint8 and torch.equal(f.cpu(), f_ref), f"fields {case}"


def test_the_native_cuda_kernel_runs():
    """ops.blockint_encode_sr on a CUDA tensor is the extension's kernel, not a fallback."""
    assert ops.backend_for("blockint_encode_sr", DEVICE) == "native"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_kernel_is_the_specification_bit_for_bit(bits: int, dtype: torch.dtype, n: int, block: int) -> None:
    x = _input(n, dtype, seed=n + block)
    for seed in SEEDS:
        check_against_spec(x, bits, block, seed)


@pytest.mark.parametrize("bits", [8, 4])
def test_values_near_the_largest_are_refused_like_the_specification(bits: int) -> None:
    # at float32's largest value 127 * fl(max / 127) rounds to Inf (refused); 7 * fl(max / 7) does not
    x = torch.full((3000,), torch.finfo(torch.float32).max)
    x[::3] = -1.0
    check_against_spec(x, bits, 1025, 2**64 - 1)
    check_against_spec(torch.full((300,), 65504.0, dtype=torch.float16), bits, 256, 0)


@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_input_raises(bits: int) -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5000)
        x[4321] = bad
        for dtype in DTYPES:
            with pytest.raises(NonFiniteError):
                ops.blockint_encode_sr(x.to(dtype).to(DEVICE), bits, 1025, 0)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_seed_gives_the_same_draws_and_another_seed_others(bits: int) -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3), device="cpu").to(DEVICE)
    a = ops.blockint_encode_sr(x, bits, 64, 11)
    b = ops.blockint_encode_sr(x, bits, 64, 11)
    c = ops.blockint_encode_sr(x, bits, 64, 12)
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])
    assert torch.equal(a[0], c[0])  # the scales are the deterministic encode's
    assert torch.equal(a[0], ops.blockint_encode(x, bits, 64)[0])


def test_native_op_traces_with_opcheck():
    op = torch.ops.commpress.blockint_encode_sr.default
    torch.library.opcheck(op, (torch.randn(1000, device=DEVICE), 4, 64, 5))
    torch.library.opcheck(op, (torch.randn(4097, device=DEVICE, dtype=torch.float16), 8, 2**31 - 1, -1))
    torch.library.opcheck(op, (torch.randn(0, device=DEVICE), 8, 64, 0))
