"""int8 / int4 with stochastic rounding (``blockint_encode_sr``): kernels against the specification, and its properties.

The specification is :func:`commpress.spec.blockint.encode_stochastic_reference`; the native CPU
kernels (every instruction-set variant this CPU runs, several threads) and the vectorised torch
fallback (:func:`commpress.kernels.blockint.encode_stochastic_torch`) must give its bytes. The
properties are the ones the FSDP error-feedback store relies on (commpress/fsdp/residuals.py):
each level is within one step of ``x / s`` (so the decode is within one scale of ``x``), the
mean over seeds is ``x`` (unbiased: small values are not dropped for good, as nearest rounding
drops every ``|x| < s / 2``), values on the grid are exact, and the draws are a function of
the seed alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError
from commpress.errors import NonFiniteError
from commpress.kernels import blockint as fast
from commpress.kernels import ops
from commpress.spec import blockint as spec

import kernel_backends
from strategies import tensors

needs_native = pytest.mark.skipif(not ops.has_native("blockint_encode_sr"), reason=f"no native op: {ops.load_native()}")
ISAS = ops.cpu_isas() or ["default"]
BLOCKS = st.sampled_from([1, 7, 16, 64, 256, 1000, 2**31 - 1])
SEEDS = st.integers(0, 2**64 - 1)


_isa = kernel_backends.cpu_isa


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t


def _reference(x: torch.Tensor, bits: int, block: int, seed: int):
    return spec.encode_stochastic_reference(x, bits, min(block, max(x.numel(), 1)), seed)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
@given(x=tensors(lengths=st.one_of(st.integers(0, 300), st.sampled_from([1023, 4097]))), block=BLOCKS, seed=SEEDS)
@settings(max_examples=25, deadline=None)
def test_native_kernels_are_the_specification_bit_for_bit(isa, bits, x, block, seed):
    try:
        s_ref, f_ref = _reference(x, bits, block, seed)
    except CodecError as exc:  # the decode would overflow: the kernel refuses too
        assert "overflow" in str(exc)
        with _isa(isa), pytest.raises(CodecError, match="overflow"):
            ops.blockint_encode_sr(x, bits, block, seed)
        return
    with _isa(isa):
        s, f = ops.blockint_encode_sr(x, bits, block, seed)
    assert s.dtype == s_ref.dtype and torch.equal(_bytes(s), _bytes(s_ref))
    assert torch.equal(f, f_ref), f"{isa} n={x.numel()} {x.dtype} bits={bits} block={block}"


@pytest.mark.parametrize("bits", [8, 4])
@given(x=tensors(lengths=st.integers(0, 600)), block=BLOCKS, seed=SEEDS)
@settings(max_examples=25, deadline=None)
def test_the_torch_fallback_is_the_specification_bit_for_bit(bits, x, block, seed):
    try:
        s_ref, f_ref = _reference(x, bits, block, seed)
    except CodecError:
        return  # overflow refusals: test_blockint's torch path states them
    s, f = fast.encode_stochastic_torch(x, bits, min(block, max(x.numel(), 1)), seed)
    assert torch.equal(_bytes(s), _bytes(s_ref)) and torch.equal(f, f_ref)


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 255, 40_000])
def test_native_kernels_split_across_threads_give_the_specification(bits, block):
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(block)) * 10
    x[::997] = 0
    s_ref, f_ref = spec.encode_stochastic_reference(x, bits, block, 2**63 + block)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        for isa in ISAS:
            with _isa(isa):
                s, f = ops.blockint_encode_sr(x, bits, block, 2**63 + block)
            assert torch.equal(s, s_ref) and torch.equal(f, f_ref), isa
    finally:
        torch.set_num_threads(threads)


def _levels(x: torch.Tensor, bits: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded float64, per-element scale float64) of one stochastic encode."""
    s, f = fast.encode_stochastic(x, bits, block, seed)
    out = torch.empty(x.numel(), dtype=x.dtype)
    fast.decode(s, f, bits, block, out)
    return out.double(), s.double().repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("bits", [8, 4])
@given(x=tensors(lengths=st.integers(1, 500), dtypes=[torch.float32, torch.float64]), seed=SEEDS)
@settings(max_examples=40, deadline=None)
def test_each_level_is_within_one_step(bits, x, seed):
    """``|decode - x| < s_b`` up to the decode's own rounding: the rounding picks the level below or above."""
    try:
        y, s = _levels(x, bits, 64, seed)
    except CodecError:
        return
    u = torch.finfo(x.dtype).eps
    slack = s * (2 * spec.QMAX[bits] * u) + y.abs() * u + spec.QMAX[bits] * 2.0**-149
    assert bool(((y - x.double()).abs() <= s + slack).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_unbiased_over_seeds(bits):
    """The mean of many encodes is ``x``; nearest rounding's mean keeps its bias (small values lost)."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(512, generator=g) * torch.logspace(-4, 0, 512)  # most far below half a step
    draws = 2000
    total = torch.zeros(512, dtype=torch.float64)
    for seed in range(draws):
        y, s = _levels(x, bits, 64, seed)
        total += y
    mean = total / draws
    # per element the level is Bernoulli on one step: sd of the mean <= s / (2 sqrt(draws))
    tol = 5 * s / (2 * draws**0.5) + 1e-9
    assert bool(((mean - x.double()).abs() <= tol).all())
    s_n, f_n = fast.encode(x, bits, 64)
    nearest = torch.empty(512)
    fast.decode(s_n, f_n, bits, 64, nearest)
    assert float((nearest.double() - x.double()).abs().max()) > float(tol.max())  # the test can tell


def test_values_on_the_grid_and_zero_blocks_are_exact_for_every_seed():
    s = 0.25
    k = torch.arange(-127, 128, dtype=torch.float32)
    x = torch.cat((k * s, torch.zeros(64)))
    for seed in (0, 1, 2**64 - 1):
        y, _ = _levels(x, 8, 255, seed)
        assert torch.equal(y, x.double())
    x4 = torch.tensor([-7.0, -3.0, 0.0, 1.0, 7.0, 2.0, -1.0, 5.0]) * 3
    for seed in range(5):
        assert torch.equal(_levels(x4, 4, 8, seed)[0], x4.double())


def test_a_seed_gives_the_same_draws_and_another_seed_others():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    a = fast.encode_stochastic(x, 4, 64, 11)
    b = fast.encode_stochastic(x, 4, 64, 11)
    c = fast.encode_stochastic(x, 4, 64, 12)
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])
    assert torch.equal(a[0], c[0])  # the scales are the deterministic encode's
    assert torch.equal(a[0], fast.encode(x, 4, 64)[0])


def test_bad_input_is_refused_with_a_clear_error():
    x = torch.randn(100)
    x[7] = float("nan")
    with pytest.raises(NonFiniteError):
        fast.encode_stochastic(x, 8, 64, 0)
    with pytest.raises(NonFiniteError):
        fast.encode_stochastic_torch(x, 8, 64, 0)
    with pytest.raises(CodecError, match="seed"):
        ops.blockint_encode_sr(torch.randn(10), 8, 64, -1)
    with pytest.raises(CodecError, match="bits"):
        ops.blockint_encode_sr(torch.randn(10), 5, 64, 0)
    with pytest.raises(CodecError, match="block_size"):
        ops.blockint_encode_sr(torch.randn(10), 8, 0, 0)
    with pytest.raises(CodecError):
        ops.blockint_encode_sr(torch.arange(10), 8, 64, 0)  # integer input


@needs_native
def test_native_op_traces_with_opcheck():
    torch.library.opcheck(torch.ops.commpress.blockint_encode_sr.default, (torch.randn(1000), 4, 64, 5))
