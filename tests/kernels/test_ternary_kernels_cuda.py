"""The CUDA kernels of the ternary kind (csrc/cuda/ternary.cu) against the specification, bit for bit.

The specification is :mod:`commpress.spec.ternary`, run on the CPU; the kernels run on a CUDA
copy of the same tensor, and the scales (as bytes), the packed levels with their padding and
the decode must be the specification's. Element i's uniform comes from its global index, so
every thread layout must draw the CPU's numbers: the lengths and blocks cover a few bytes,
ragged last bytes and blocks, blocks of one amax chunk (1024 elements) or several (1025, 3000:
combined by atomicMax), and a block longer than the tensor (padded to a whole block). The CPU
kernels are tested the same way in test_ternary_kernels.py.

Skipped without a CUDA device or without a CUDA build of the extension.
"""

from __future__ import annotations

import pytest
import torch

from commpress.errors import KernelArgumentError, NonFiniteError
from commpress.kernels import ops
from commpress.kernels import ternary as fast
from commpress.spec import ternary as spec

import kernel_backends

SKIP_REASON = kernel_backends.cuda_reason("ternary_encode_sr")
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

DEVICE = "cuda"
LENGTHS = [0, 1, 4, 5, 17, 1023, 1025, 4097, 300_001]
BLOCKS = [1, 5, 7, 64, 65, 1024, 1025, 3000, 5003]
# 0 and 2**64 - 1 (int64 -1 in the schema); 2**63 + 5 has only the sign bit set of the high ones
SEEDS = [0, 5, 2**63 + 5, 2**64 - 1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.numel() else t


def _input(n: int, seed: int) -> torch.Tensor:
    """Values over several magnitudes, with zeros, signed zeros, an all-zero block and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, n, dtype=torch.float64)).float()
    x[3::997] = 0.0  # not x[0]: the one element of n = 1 stays nonzero
    x[5::991] = -0.0
    x[20:27] = 0.0  # one whole block of 7 or of 1
    x[40:47] = torch.finfo(torch.float32).tiny / 4  # subnormal
    return x


def check_against_spec(x: torch.Tensor, block: int, seed: int) -> None:
    """The CUDA ops' scales, levels and decode are the specification's bytes."""
    case = f"n={x.numel()} block={block} seed={seed}"
    s_ref, p_ref = spec.encode_stochastic(x, block, seed)
    s, p = ops.ternary_encode_sr(x.to(DEVICE), block, seed)
    assert s.device.type == p.device.type == DEVICE, case
    assert s.dtype == torch.float32 and torch.equal(_bytes(s), _bytes(s_ref)), f"scales {case}"
    assert p.dtype == torch.uint8 and torch.equal(p.cpu(), p_ref), f"packed {case}"
    out = torch.full((x.numel(),), float("nan"), device=DEVICE)
    ops.ternary_decode(s, p, block, out)
    assert torch.equal(_bytes(out), _bytes(spec.decode(s_ref, p_ref, block, x.numel()))), f"decode {case}"


def test_the_native_cuda_kernels_run():
    """ops.ternary_* on CUDA tensors are the extension's kernels, not a fallback."""
    assert ops.backend_for("ternary_encode_sr", DEVICE) == "native"
    assert ops.backend_for("ternary_decode", DEVICE) == "native"


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_kernels_are_the_specification_bit_for_bit(n: int, block: int) -> None:
    x = _input(n, seed=n + block)
    for seed in SEEDS:
        check_against_spec(x, block, seed)


def test_decode_of_every_byte_value_is_the_specifications() -> None:
    packed = torch.arange(256, dtype=torch.uint8).repeat(3)
    scales = torch.tensor([0.5, -0.0, 3.0e38, 1e-45] * 15)
    out = torch.empty(packed.numel() * 5, device=DEVICE)
    ops.ternary_decode(scales.to(DEVICE), packed.to(DEVICE), 64, out)
    assert torch.equal(_bytes(out), _bytes(spec.decode(scales, packed, 64, out.numel())))


def test_the_fast_path_module_runs_on_cuda_tensors() -> None:
    x = _input(10_000, 1)
    s, p = fast.encode_stochastic(x.to(DEVICE), 64, 9)
    s_ref, p_ref = spec.encode_stochastic(x, 64, 9)
    assert torch.equal(_bytes(s), _bytes(s_ref)) and torch.equal(p.cpu(), p_ref)
    y = fast.decode(s, p, 64, x.numel())
    assert y.device.type == DEVICE and torch.equal(_bytes(y), _bytes(spec.decode(s_ref, p_ref, 64, x.numel())))


def test_bad_input_is_refused() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5000)
        x[4321] = bad
        with pytest.raises(NonFiniteError):
            ops.ternary_encode_sr(x.to(DEVICE), 1025, 0)
    with pytest.raises(KernelArgumentError, match="float32"):
        ops.ternary_encode_sr(torch.randn(10, device=DEVICE).half(), 64, 0)
    s, p = ops.ternary_encode_sr(torch.randn(100, device=DEVICE), 64, 0)
    with pytest.raises(KernelArgumentError, match="packed has"):
        ops.ternary_decode(s, p[:-1], 64, torch.empty(100, device=DEVICE))


def test_native_ops_trace_with_opcheck():
    op = torch.ops.commpress.ternary_encode_sr.default
    torch.library.opcheck(op, (torch.randn(1000, device=DEVICE), 64, 5))
    torch.library.opcheck(op, (torch.randn(0, device=DEVICE), 64, 0))
    s, p = op(torch.randn(1000, device=DEVICE), 64, 5)
    torch.library.opcheck(torch.ops.commpress.ternary_decode.default, (s, p, 64, torch.empty(1000, device=DEVICE)))
