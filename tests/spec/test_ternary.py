"""Ternary storage (commpress/spec/ternary.py): the properties the FSDP compression state relies on."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import rng
from commpress.spec import ternary

EDGE_LENGTHS = [0, 1, 4, 5, 6, 63, 64, 65, 127, 129, 1000]


@st.composite
def fields(draw):
    n = draw(st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, 2000)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return torch.randint(0, 3, (n,), generator=g, dtype=torch.uint8)


@st.composite
def tensors(draw):
    n = draw(st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(1, 1500)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    spread = draw(st.sampled_from([0.0, 1.0, 4.0, 12.0]))  # magnitudes over up to 12 decades
    x = torch.randn(n, generator=g) * torch.pow(10.0, -spread * torch.rand(n, generator=g))
    if draw(st.booleans()):
        x[torch.rand(n, generator=g) < 0.3] = 0.0
    return x, draw(st.sampled_from([1, 2, 64, 100])), draw(st.integers(0, 2**64 - 1))


@given(fields())
def test_pack_round_trip_size_and_byte_range(f):
    packed = ternary.pack(f)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-f.numel() // 5)
    assert int(packed.max()) <= ternary.MAX_BYTE if packed.numel() else True
    assert torch.equal(ternary.unpack(packed, f.numel()), f)
    tail = ternary.unpack(packed, packed.numel() * 5)[f.numel():]
    assert bool((tail == 1).all())  # padded with level 0


def test_layout_is_base_3_first_field_least_significant():
    assert ternary.pack(torch.tensor([2, 0, 1, 0, 0, 1], dtype=torch.uint8)).tolist() == [2 + 9, 1 + 3 + 9 + 27 + 81]
    assert ternary.pack(torch.tensor([2, 2, 2, 2, 2], dtype=torch.uint8)).tolist() == [242]


@settings(deadline=None, max_examples=60)
@given(tensors())
def test_levels_scales_and_error_bound(case):
    x, block, seed = case
    scales, packed = ternary.encode_stochastic(x, block, seed)
    blocks = -(-x.numel() // block)
    assert scales.dtype == torch.float32 and scales.shape == (blocks,)
    assert packed.numel() == -(-(blocks * block) // 5)
    rows = torch.nn.functional.pad(x, (0, blocks * block - x.numel())).view(blocks, block)
    assert torch.equal(scales, rows.abs().amax(1))  # the block's absolute maximum, exactly
    levels = ternary.unpack(packed, blocks * block).to(torch.int8) - 1
    assert bool((levels[x.numel():] == 0).all())  # the padding: level 0
    out = ternary.decode(scales, packed, block, x.numel())
    s = scales.repeat_interleave(block)[: x.numel()]
    assert torch.equal(out, levels[: x.numel()].float() * s)  # q * s, exactly
    assert bool(((out - x).abs() <= s).all())  # the level below or above
    assert bool((torch.sign(out) * torch.sign(x) >= 0).all())  # never the other sign
    assert bool((out[x == 0] == 0).all())
    assert bool((out[x.abs() == s] == x[x.abs() == s]).all())  # the maximum is exact
    assert torch.equal(packed, ternary.encode_stochastic(x, block, seed)[1])  # seeded: resumes bit for bit


def test_unbiased():
    x = torch.randn(640) * torch.logspace(-3, 0, 640)
    draws = torch.stack([ternary.decode(*ternary.encode_stochastic(x, 64, s), 64, 640) for s in range(2000)])
    s = ternary.encode_stochastic(x, 64, 0)[0].repeat_interleave(64)
    # each draw is x + noise of at most s, variance <= s^2 / 4: the mean of 2000 is within 5 sigma of x
    assert float(((draws.mean(0) - x).abs() / s).max()) < 5 * 0.5 / 2000**0.5
    assert float(((draws.mean(0) - x).abs() / s).max()) > 0  # not deterministic


def test_device_uniforms_are_the_cpu_ones(monkeypatch: pytest.MonkeyPatch):
    """The uniforms of another device (paired_u24_torch) are numpy's: the same codes on any device."""
    x = torch.randn(333)
    want = ternary.encode_stochastic(x, 64, 12345)
    assert np.array_equal(rng.paired_u24_torch(12345, rng.STREAM_BLOCKINT_SR, 384).numpy(),
                          rng.paired_u24(12345, rng.STREAM_BLOCKINT_SR, 384).astype(np.int64))
    calls = []

    def numpy_free(seed: int, stream: int, count: int) -> np.ndarray:
        calls.append(count)
        return rng.paired_u24_torch(seed, stream, count).numpy().astype(np.uint32)

    monkeypatch.setattr(rng, "paired_u24", numpy_free)
    got = ternary.encode_stochastic(x, 64, 12345)
    assert calls == [384] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
