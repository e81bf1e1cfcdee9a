"""The ternary kind's kernels (``ternary_encode_sr`` / ``ternary_decode``) against the specification, bit for bit.

The specification is :mod:`commpress.spec.ternary` (the FSDP store's smallest kind); the native
CPU kernels (every instruction-set variant this CPU runs, several threads) must give its bytes:
the scales (as bytes, so even the sign of a zero must match), the packed levels with their
padding (the last block padded with level 0, even a block longer than the tensor, and the last
byte padded with field 1), and the decode. The fast-path module
:mod:`commpress.kernels.ternary` must give them too, native or not. The CUDA kernels are tested
the same way in test_ternary_kernels_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError
from commpress.errors import KernelArgumentError, NonFiniteError
from commpress.kernels import ops
from commpress.kernels import ternary as fast
from commpress.spec import ternary as spec

import kernel_backends

needs_native = pytest.mark.skipif(not ops.has_native("ternary_encode_sr"), reason=f"no native op: {ops.load_native()}")
ISAS = ops.cpu_isas() or ["default"]
LENGTHS = st.one_of(st.integers(0, 300), st.sampled_from([1023, 4097]))
BLOCKS = st.sampled_from([1, 5, 7, 16, 64, 65, 1000, 5003])
SEEDS = st.integers(0, 2**64 - 1)

_isa = kernel_backends.cpu_isa


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t


@st.composite
def _inputs(draw: st.DrawFn) -> torch.Tensor:
    """float32 vectors over many magnitudes, with zeros, -0, ties, subnormals and whole zero blocks."""
    n = draw(LENGTHS)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n).to(torch.float32)[torch.randperm(n, generator=g)]
    kind = draw(st.integers(0, 3))
    if kind == 1 and n:  # grid values and exact block maxima
        x = torch.randint(-3, 4, (n,), generator=g).float() * 0.5
    elif kind == 2 and n:
        x[::3] = 0.0
        x[1::7] = -0.0
        x[2::11] = torch.finfo(torch.float32).tiny / 8  # subnormal
    elif kind == 3 and n:
        x[: n // 2] = 0.0
    return x


def _check(x: torch.Tensor, block: int, seed: int, label: str) -> None:
    s_ref, p_ref = spec.encode_stochastic(x, block, seed)
    s, p = ops.ternary_encode_sr(x, block, seed)
    case = f"{label} n={x.numel()} block={block} seed={seed}"
    assert s.dtype == torch.float32 and torch.equal(_bytes(s), _bytes(s_ref)), f"scales {case}"
    assert p.dtype == torch.uint8 and torch.equal(p, p_ref), f"packed {case}"
    out = torch.full((x.numel(),), float("nan"))
    ops.ternary_decode(s, p, block, out)
    assert torch.equal(_bytes(out), _bytes(spec.decode(s_ref, p_ref, block, x.numel()))), f"decode {case}"


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@given(x=_inputs(), block=BLOCKS, seed=SEEDS)
@settings(max_examples=30, deadline=None)
def test_native_kernels_are_the_specification_bit_for_bit(isa, x, block, seed):
    with _isa(isa):
        _check(x, block, seed, isa)


@needs_native
@pytest.mark.parametrize("block", [1, 7, 64, 65, 40_001])
def test_native_kernels_split_across_threads_give_the_specification(block):
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(block)) * 10
    x[::997] = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(max(3, threads))
    try:
        for isa in ISAS:
            with _isa(isa):
                _check(x, block, 2**63 + block, f"{isa} threads")
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_native_decode_of_every_byte_value_is_the_specifications(isa):
    """Bytes above 242 (refused by the store's check_codes) are read in bounds, as the spec's table does."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(3)
    scales = torch.tensor([0.5, -0.0, 3.0e38, 1e-45] * 15)[: -(-packed.numel() * 5 // 64)]
    out = torch.empty(packed.numel() * 5)
    with _isa(isa):
        ops.ternary_decode(scales, packed, 64, out)
    assert torch.equal(_bytes(out), _bytes(spec.decode(scales, packed, 64, out.numel())))


@given(x=_inputs(), block=BLOCKS, seed=SEEDS)
@settings(max_examples=25, deadline=None)
def test_the_fast_path_module_is_the_specification_with_and_without_native(x, block, seed):
    s_ref, p_ref = spec.encode_stochastic(x, block, seed)
    y_ref = spec.decode(s_ref, p_ref, block, x.numel())
    for backend in ("native", "reference"):
        if ops.backend_unavailable(backend) is not None:
            continue
        with ops.use_backend(backend):
            s, p = fast.encode_stochastic(x, block, seed)
            y = fast.decode(s, p, block, x.numel())
        assert torch.equal(_bytes(s), _bytes(s_ref)) and torch.equal(p, p_ref), backend
        assert torch.equal(_bytes(y), _bytes(y_ref)), backend


def test_the_fast_path_module_takes_what_the_specification_takes():
    x = torch.randn(6, 50, dtype=torch.float64)[:, ::2]  # 2-D, strided, float64
    s, p = fast.encode_stochastic(x, 16, 3)
    s_ref, p_ref = spec.encode_stochastic(x, 16, 3)
    assert torch.equal(s, s_ref) and torch.equal(p, p_ref)
    assert torch.equal(fast.decode(s, p, 16, x.numel()), spec.decode(s, p, 16, x.numel()))


def test_bad_input_is_refused_with_a_clear_error():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(1000)
        x[777] = bad
        with pytest.raises(NonFiniteError):
            fast.encode_stochastic(x, 64, 0)
        with ops.use_backend("reference"), pytest.raises(NonFiniteError):
            fast.encode_stochastic(x, 64, 0)
        if ops.has_native("ternary_encode_sr"):
            with pytest.raises(NonFiniteError):
                ops.ternary_encode_sr(x, 64, 0)
    x = torch.randn(100)
    with pytest.raises(KernelArgumentError, match="x must have dtype float32"):
        ops.ternary_encode_sr(x.double(), 64, 0)
    with pytest.raises(KernelArgumentError, match="block_size"):
        ops.ternary_encode_sr(x, 0, 0)
    with pytest.raises(KernelArgumentError, match="2\\*\\*63"):
        ops.ternary_encode_sr(x, 2**63 - 2, 0)
    with pytest.raises(CodecError, match="seed"):
        ops.ternary_encode_sr(x, 64, -1)
    s, p = ops.ternary_encode_sr(x, 64, 0)
    assert p.numel() == spec.packed_nbytes(128)
    out = torch.empty(100)
    with pytest.raises(KernelArgumentError, match="packed has 25 bytes"):
        ops.ternary_decode(s, p[:-1], 64, out)
    with pytest.raises(KernelArgumentError, match="scales has 1 elements"):
        ops.ternary_decode(s[:1], p, 64, out)
    with pytest.raises(KernelArgumentError, match="out must have dtype float32"):
        ops.ternary_decode(s, p, 64, out.double())
    with pytest.raises(KernelArgumentError, match="block_size"):
        ops.ternary_decode(s, p, 0, out)


@needs_native
def test_native_ops_refuse_bad_arguments_when_called_directly():
    """The C++ checks (csrc/checks.h) keep a direct torch.ops call in bounds."""
    op_e, op_d = torch.ops.commpress.ternary_encode_sr.default, torch.ops.commpress.ternary_decode.default
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="float32"):
        op_e(x.half(), 64, 0)
    with pytest.raises(RuntimeError, match="block_size"):
        op_e(x, 0, 0)
    with pytest.raises(RuntimeError, match="2\\*\\*63"):
        op_e(x, 2**63 - 2, 0)
    s, p = op_e(x, 64, 0)
    with pytest.raises(RuntimeError, match="packed has"):
        op_d(s, p[:-1], 64, torch.empty(100))
    with pytest.raises(RuntimeError, match="scales has"):
        op_d(s[:1], p, 64, torch.empty(100))


@needs_native
def test_native_ops_trace_with_opcheck():
    torch.library.opcheck(torch.ops.commpress.ternary_encode_sr.default, (torch.randn(1000), 64, 5))
    torch.library.opcheck(torch.ops.commpress.ternary_encode_sr.default, (torch.randn(0), 64, -1))
    s, p = torch.ops.commpress.ternary_encode_sr(torch.randn(1000), 64, 5)
    torch.library.opcheck(torch.ops.commpress.ternary_decode.default, (s, p, 64, torch.empty(1000)))
