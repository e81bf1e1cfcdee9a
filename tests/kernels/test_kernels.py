"""Codec kernels: every backend against the pure-torch reference, bit for bit.

Backends (tests/kernel_backends.py): ``cpu:<isa>`` (the native CPU kernels, once per
instruction-set variant this CPU runs: default, avx2, avx512), ``numba``, and ``cuda`` /
``cupy`` when a GPU is present. Each case runs the reference (commpress/spec/*.py) and the
backend on the same input and compares every output, residuals included, bit for bit (floats
compared as integers, so even the sign of a zero must match). Then ``torch.library.opcheck``
on every native op, and bad input: rejected once, by the kernel contract
(commpress/kernels/checks.py), before any backend runs; the native ops' own memory checks are
tested on their own (their wording is theirs).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commpress import CodecError, ErrorFeedback, codecs, rng, wire
from commpress.codecs.base import Codec, NonFiniteError
from commpress.errors import KernelArgumentError
from commpress.kernels import ops
from commpress.spec import qsgd as qsgd_mod
from commpress.spec import randomk as randomk_mod
from commpress.spec import sign as sign_mod
from commpress.spec import topk as topk_mod
from commpress.spec.numerics import tree_sum

import kernel_backends

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Lengths around every boundary of the kernels: bytes (8), sum chunks (32), pass-2 tiles (512),
# summation groups and parallel tasks (32768).
LENGTHS = [0, 1, 7, 9, 31, 33, 100, 513, 32768 + 33, 131075]

BACKENDS = kernel_backends.params(all_isas=True)
MAIN_BACKENDS = kernel_backends.params(all_isas=False)
TORCH_OP_BACKENDS = kernel_backends.params(all_isas=False, python=False)


def parametrize_backends(fn):
    return pytest.mark.parametrize("backend", MAIN_BACKENDS, indirect=True)(fn)


def parametrize_all_backends(fn):
    return pytest.mark.parametrize("backend", BACKENDS, indirect=True)(fn)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        return torch.equal(a.view(BITS_VIEW[a.dtype]), b.view(BITS_VIEW[b.dtype]))
    return torch.equal(a, b)


def assert_same(got, want, what: str) -> None:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert same_bits(g, w), f"{what}: output {i} differs ({g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)})"


def sample(n: int, dtype: torch.dtype, seed: int, kind: str = "normal") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "ties":  # few distinct magnitudes: many ties at any threshold
        x = torch.randint(-3, 4, (n,), generator=g).double()
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=g, dtype=torch.float64) < 0.05)
    if n > 3:
        x[0], x[1] = 0.0, -0.0  # signed zeros: sign bit 0, +scale, and the residual's zero sign
    return (x * 3).to(dtype)


def residual_for(x: torch.Tensor, seed: int) -> torch.Tensor:
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(seed + 99)
    return (torch.randn(x.numel(), generator=g, dtype=torch.float64) * 0.5).to(ct)


def on(device: str, *tensors: torch.Tensor | None):
    return [None if t is None else t.clone().to(device) for t in tensors]


# ---------------------------------------------------------------------------------------------
# The fixed summation order


def test_tree_sum_order_by_hand() -> None:
    v = torch.arange(1.0, 71.0, dtype=torch.float64).unsqueeze(0)  # 3 chunks: 32 + 32 + 6
    chunks = [v[0, 0:32], v[0, 32:64], torch.nn.functional.pad(v[0, 64:], (0, 26))]

    def halves(c: torch.Tensor) -> float:
        c = c.clone()
        h = 16
        while h >= 1:
            c = c[:h] + c[h : 2 * h]
            h //= 2
        return float(c[0])

    c0, c1, c2 = (halves(c) for c in chunks)
    assert float(tree_sum(v)[0]) == (c0 + c1) + c2
    assert float(tree_sum(v)[0]) == 70 * 71 / 2


def test_tree_sum_is_accurate() -> None:
    x = torch.randn(7, 100_003, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(tree_sum(x), x.sum(dim=1), rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Sign


@parametrize_all_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_encode_decode(backend: str, dtype: torch.dtype) -> None:
    for n in LENGTHS:
        for block in (0, 13, 16, 512, 40000):
            for with_e in (False, True):
                case = f"n={n} block={block} residual={with_e} {dtype}"
                x = sample(n, dtype, seed=n + block)
                e = residual_for(x, n) if with_e else None
                e_ref = None if e is None else e.clone()
                want = sign_mod.encode_reference(x, block, e_ref)
                xd, ed = on(backend, x, e)
                got = backend.ops.sign_encode(xd, ed, block)
                assert_same(got, want, f"sign_encode {case}")
                if with_e:
                    assert same_bits(ed, e_ref), f"sign_encode residual {case}"
                for acc in (True, False):
                    out = sample(n, dtype, seed=n + 7)
                    out_ref = out.clone()
                    sign_mod.decode_reference(*want, block, out_ref, acc)
                    (outd,) = on(backend, out)
                    backend.ops.sign_decode(*on(backend, *want), block, outd, acc)
                    assert same_bits(outd, out_ref), f"sign_decode accumulate={acc} {case}"


# Layouts of the one-pass encode (no residual: the block-sum pass writes the bits): one block,
# blocks that are multiples of 8 (fused) or not (two passes), lengths across summation groups.
@parametrize_all_backends
@given(n=st.one_of(st.integers(0, 2100), st.sampled_from([32768 - 8, 32768 + 5, 65536 + 17])),
       block=st.sampled_from([0, 1, 8, 13, 16, 24, 1000, 32768, 40000]), dtype=st.sampled_from(DTYPES),
       with_e=st.booleans(), seed=st.integers(0, 2**31), kind=st.sampled_from(["normal", "ties", "sparse"]))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sign_encode_any_layout_matches_reference(backend: str, n: int, block: int, dtype: torch.dtype,
                                                  with_e: bool, seed: int, kind: str) -> None:  # fmt: skip
    x = sample(n, dtype, seed=seed % 10_000, kind=kind)
    e = residual_for(x, seed % 10_000) if with_e else None
    e_ref = None if e is None else e.clone()
    want = sign_mod.encode_reference(x, block, e_ref)
    xd, ed = on(backend, x, e)
    got = backend.ops.sign_encode(xd, ed, block)
    assert_same(got, want, f"sign_encode n={n} block={block} residual={with_e} {dtype}")
    if with_e:
        assert same_bits(ed, e_ref)


# ---------------------------------------------------------------------------------------------
# QSGD

QSGD_PARAMS = [(2, 1, 64), (4, 7, 512), (4, 3, 100), (8, 127, 7), (8, 100, 40000)]


@parametrize_all_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_encode_decode(backend: str, dtype: torch.dtype) -> None:
    for n in LENGTHS:
        for bits, levels, bucket in QSGD_PARAMS:
            for with_e in (False, True):
                seed = ((n * 7919 + bits) * (1 << 40) + bucket) % (1 << 64)  # some >= 2**63
                case = f"n={n} bits={bits} s={levels} bucket={bucket} residual={with_e} {dtype}"
                x = sample(n, dtype, seed=n + bucket)
                e = residual_for(x, n) if with_e else None
                e_ref = None if e is None else e.clone()
                want = qsgd_mod.encode_reference(x, bits, levels, bucket, seed, e_ref)
                xd, ed = on(backend, x, e)
                signed = seed - (1 << 64) if seed >= 1 << 63 else seed
                got = backend.ops.qsgd_encode(xd, ed, bits, levels, bucket, signed)
                assert_same(got, want, f"qsgd_encode {case}")
                if with_e:
                    assert same_bits(ed, e_ref), f"qsgd_encode residual {case}"
                for acc in (True, False):
                    out = sample(n, dtype, seed=n + 3)
                    out_ref = out.clone()
                    qsgd_mod.decode_reference(*want, bits, levels, bucket, out_ref, acc)
                    (outd,) = on(backend, out)
                    backend.ops.qsgd_decode(*on(backend, *want), bits, levels, bucket, outd, acc)
                    assert same_bits(outd, out_ref), f"qsgd_decode accumulate={acc} {case}"


def test_paired_u24_are_the_halves_of_the_draws() -> None:
    """QSGD's uniforms: the low 24 bits of the low, then the high, 32-bit half of each draw."""
    draws = [int(r) for r in rng.random_u64(77, rng.STREAM_QSGD, 0, 3)]
    want = [(r >> shift) & 0xFFFFFF for r in draws for shift in (0, 32)]
    assert [int(v) for v in rng.paired_u24(77, rng.STREAM_QSGD, 5)] == want[:5]
    assert rng.paired_u24(77, rng.STREAM_QSGD, 0).size == 0


def test_qsgd_fixed_point_rounding_is_exact() -> None:
    """E[q] = T / 2**24 exactly: floor((T + v) / 2**24) rounds up for T mod 2**24 of the 2**24 v."""
    s = 7
    v = torch.arange(0, 1 << 24, 4096, dtype=torch.int64)  # a uniform grid over [0, 2**24)
    for fixed in (0, 1, -1, (3 << 24) + 12345, -(3 << 24) - 12345, (s << 24) - 1, -(s << 24) + 1):
        fields = ((fixed + v) >> qsgd_mod.FRACTION_BITS) + s
        assert 0 <= int(fields.min()) and int(fields.max()) <= 2 * s
        grid_mean = float((fields - s).double().mean())
        assert abs(grid_mean - fixed / 2**24) <= 4096 / 2**24, fixed


# Bucket scales that exercise every branch of the fixed-point encode: an all-zero bucket (r = 0),
# norms below 2**-64 (the exact 2**64 pre-scale) and subnormal input, norms just around 2**-64,
# ordinary and huge buckets, and a bucket with one non-zero element (|x| = n: t = s, the clamp).
QSGD_SCALES = [0.0, 1e-42, 1e-30, 2.0**-64, 2.0**-63, 1.0, 1e30]


@parametrize_all_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_encode_extreme_buckets(backend: str, dtype: torch.dtype) -> None:
    for bucket in (64, 48, 7):  # 48: a 16-lane step after the 32-lane loop
        parts = [sample(bucket, torch.float64, seed=k) / 3 * sc for k, sc in enumerate(QSGD_SCALES)]
        single = torch.zeros(bucket, dtype=torch.float64)
        single[bucket // 2] = -2.5
        x = torch.cat([*parts, single, sample(bucket + 5, torch.float64, seed=99)])
        x = x.clamp(-1e3, 1e3).to(dtype) if dtype in (torch.float16, torch.bfloat16) else x.to(dtype)
        for bits, levels in ((2, 1), (4, 7), (8, 127)):
            for with_e in (False, True):
                case = f"bucket={bucket} bits={bits} residual={with_e} {dtype}"
                e = residual_for(x, bucket) * 1e-30 if with_e else None
                e_ref = None if e is None else e.clone()
                want = qsgd_mod.encode_reference(x, bits, levels, bucket, 12345, e_ref)
                xd, ed = on(backend, x, e)
                got = backend.ops.qsgd_encode(xd, ed, bits, levels, bucket, 12345)
                assert_same(got, want, f"qsgd_encode {case}")
                if with_e:
                    assert same_bits(ed, e_ref), f"qsgd_encode residual {case}"


@parametrize_backends
def test_qsgd_decode_accepts_any_field_like_the_reference(backend: str) -> None:
    # fields above 2s never come from the encoder (the wire rejects them) but must not read
    # outside a table: they decode as (f - s) / s, like the reference
    packed = torch.arange(256, dtype=torch.uint8)
    norms = torch.tensor([2.0])
    out_ref = torch.zeros(256)
    qsgd_mod.decode_reference(norms, packed, 8, 3, 256, out_ref)
    (outd,) = on(backend, torch.zeros(256))
    backend.ops.qsgd_decode(*on(backend, norms, packed), 8, 3, 256, outd)
    assert same_bits(outd, out_ref)


# ---------------------------------------------------------------------------------------------
# Top-k


@parametrize_all_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_select(backend: str, dtype: torch.dtype) -> None:
    # 300_007 > 4 * 32768 elements: the sampled-threshold path; smaller: exact on everything
    for n in [1, 7, 33, 1000, 300_007]:
        for kind in ("normal", "ties", "sparse"):
            for k in sorted({1, max(1, n // 100), max(1, n // 10), n // 2 if n < 5000 else 1, n if n < 5000 else 1}):
                if k == 0:
                    continue
                case = f"n={n} k={k} kind={kind} {dtype}"
                x = sample(n, dtype, seed=n + k, kind=kind)
                want = topk_mod.select_reference(x, k)
                got = backend.ops.topk_select(*on(backend, x), k)
                assert_same(got, want, f"topk_select {case}")


@parametrize_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_scatter_add(backend: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for n in [1, 100, 70_001]:
        for payloads in (1, 3, 8):
            idx, val = [], []
            for p in range(payloads):
                k = int(torch.randint(0, n + 1, (1,), generator=g))
                chosen = torch.randperm(n, generator=g)[:k].sort().values
                idx.append(chosen.to(torch.int32 if p % 2 else torch.int64))
                val.append(sample(k, dtype, seed=p + n))
            out = sample(n, dtype, seed=n)
            out_ref = out.clone()
            topk_mod.scatter_add_reference(idx, val, out_ref)
            (outd,) = on(backend, out)
            backend.ops.sparse_scatter_add(on(backend, *idx), on(backend, *val), outd)
            assert same_bits(outd, out_ref), f"sparse_scatter_add n={n} payloads={payloads} {dtype}"


# ---------------------------------------------------------------------------------------------
# Random-k


@parametrize_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_randomk_gather_scatter(backend: str, dtype: torch.dtype) -> None:
    for n in [1, 7, 100, 4097, 131075]:
        for k in sorted({1, max(1, n // 100), max(1, n // 3), n}):
            for scaled in (False, True):
                seed = n * 1_000_003 + k + (1 << 63)
                signed = seed - (1 << 64)
                case = f"n={n} k={k} scaled={scaled} {dtype}"
                if scaled and dtype == torch.float16 and n // k > 60000:
                    continue  # the stratum length itself overflows float16 (tested below)
                x = sample(n, dtype, seed=n + k) * (0.01 if dtype == torch.float16 else 1)
                want = randomk_mod.gather_reference(x, k, seed, scaled)
                got = backend.ops.randomk_gather(*on(backend, x), k, signed, scaled)
                assert_same(got, want, f"randomk_gather {case}")
                out = sample(n, dtype, seed=k)
                out_ref = out.clone()
                randomk_mod.scatter_add_reference(want, seed, out_ref)
                (outd,) = on(backend, out)
                backend.ops.randomk_scatter_add(*on(backend, want), signed, outd)
                assert same_bits(outd, out_ref), f"randomk_scatter_add {case}"


# ---------------------------------------------------------------------------------------------
# Fused error feedback == the default encode / decode / subtract, step after step

EF_CODECS = {
    "sign": dict(name="sign"),
    "sign-block": dict(name="sign", block_size=24),
    "qsgd4": dict(name="qsgd", bits=4),
    "qsgd2": dict(name="qsgd", bits=2, bucket_size=64),
}


@parametrize_backends
@pytest.mark.parametrize("cid", list(EF_CODECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_feedback_matches_default(backend: str, cid: str, dtype: torch.dtype) -> None:
    codec = codecs.from_config(dict(EF_CODECS[cid]))
    shape = (37, 29)
    fused_e = plain_e = None
    for step in range(4):
        grad = sample(37 * 29, dtype, seed=step).view(shape).to(backend)
        fused = codec.encode_with_feedback(grad, fused_e, seed=step)
        plain = Codec.encode_with_feedback(codec, grad, plain_e, seed=step)
        assert fused is not None and plain is not None
        assert torch.equal(wire.to_bytes(fused[0]).cpu(), wire.to_bytes(plain[0]).cpu()), f"step {step}"
        fused_e, plain_e = fused[1], plain[1]
        assert fused_e.shape == shape and torch.equal(fused_e, plain_e), f"step {step}"


@parametrize_backends
@pytest.mark.parametrize("cid", list(EF_CODECS))
def test_fused_feedback_non_finite_leaves_residual(backend: str, cid: str) -> None:
    codec = codecs.from_config(dict(EF_CODECS[cid]))
    grad = torch.randn(1000, device=backend)
    _, residual = codec.encode_with_feedback(grad, None)
    before = residual.clone()
    bad = grad.clone()
    bad[777] = float("nan")
    assert codec.encode_with_feedback(bad, residual) is None
    assert same_bits(residual, before)
    # fp16 overflow of grad + residual is non-finite too
    half = torch.full((64,), 60000.0, dtype=torch.float16, device=backend)
    e = torch.full((64,), 10000.0, device=backend)
    e_before = e.clone()
    assert codec.encode_with_feedback(half, e) is None
    assert same_bits(e, e_before)


def test_error_feedback_with_fused_codecs_loses_nothing() -> None:
    # ErrorFeedback on top of the fused codecs: sum of decoded + residual == sum of gradients
    for cid in EF_CODECS:
        ef = ErrorFeedback(codecs.from_config(dict(EF_CODECS[cid])))
        sent = torch.zeros(500, dtype=torch.float64)
        total = torch.zeros(500, dtype=torch.float64)
        for t in range(5):
            grad = torch.randn(500, generator=torch.Generator().manual_seed(t))
            total += grad.double()
            result = ef.codec.encode_with_feedback(grad, ef.residual("w"), seed=t)
            assert result is not None
            packet, residual = result
            ef._residuals["w"] = residual
            sent += ef.codec.decode(packet).double()
        assert float((sent + ef.residual("w").double() - total).abs().max()) < 1e-4


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck on every op (schema, fake kernel, mutation annotations, AOT dispatch)


def _opcheck_samples(device: str):
    x = sample(100, torch.float32, seed=1).to(device)
    xh = sample(67, torch.float16, seed=2).to(device)
    e = residual_for(x, 1).to(device)
    scales, bits = torch.ops.commpress.sign_encode(x, None, 16)
    norms, packed = torch.ops.commpress.qsgd_encode(x, None, 4, 7, 32, 5)
    idx, val = torch.ops.commpress.topk_select(x, 10)
    rv = torch.ops.commpress.randomk_gather(x, 10, 3, True)
    z = torch.zeros(100, device=device)
    ops_ = torch.ops.commpress
    return [
        (ops_.sign_encode.default, (x, None, 16)),
        (ops_.sign_encode.default, (x, e.clone(), 0)),
        (ops_.sign_encode.default, (xh, None, 8)),
        (ops_.sign_decode.default, (scales, bits, 16, z.clone())),
        (ops_.sign_decode.default, (scales, bits, 16, z.clone(), False)),
        (ops_.qsgd_encode.default, (x, None, 4, 7, 32, 5)),
        (ops_.qsgd_encode.default, (x, e.clone(), 8, 127, 512, -3)),
        (ops_.qsgd_decode.default, (norms, packed, 4, 7, 32, z.clone())),
        (ops_.qsgd_decode.default, (norms, packed, 4, 7, 32, z.clone(), False)),
        (ops_.topk_select.default, (x, 10)),
        (ops_.topk_select.default, (xh, 67)),
        (ops_.sparse_scatter_add.default, ([idx, idx.long()], [val, val], z.clone())),
        (ops_.randomk_gather.default, (x, 10, 3, True)),
        (ops_.randomk_scatter_add.default, (rv, 3, z.clone())),
    ]


@pytest.mark.parametrize("backend", TORCH_OP_BACKENDS, indirect=True)
def test_opcheck(backend: str) -> None:
    for op, args in _opcheck_samples(backend):
        torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------------
# Bad input: a TORCH_CHECK naming the argument, never a crash; nothing written on failure


@parametrize_backends
def test_bad_input(backend: str) -> None:
    dev = backend
    c = backend.ops
    x = torch.randn(64, device=dev)
    z = torch.zeros(64, device=dev)
    cases = [
        (lambda: c.sign_encode(x.long(), None, 0), r"sign_encode: x must have dtype float32, float16, bfloat16 or float64, got torch.int64"),
        (lambda: c.sign_encode(x.view(8, 8), None, 0), r"sign_encode: x must be 1-D"),
        (lambda: c.sign_encode(x[::2], None, 0), r"sign_encode: x must be contiguous"),
        (lambda: c.sign_encode(x, None, -1), r"sign_encode: block_size must be >= 0"),
        (lambda: c.sign_encode(x, z.double(), 0), r"sign_encode: residual must have dtype float32, got torch.float64"),
        (lambda: c.sign_encode(x, z[:10], 0), r"sign_encode: residual has 10 elements, x has 64"),
        (lambda: c.sign_decode(torch.zeros(3, device=dev), torch.zeros(8, dtype=torch.uint8, device=dev), 16, z), r"sign_decode: scales has 3 elements"),
        (lambda: c.sign_decode(torch.zeros(4, device=dev), torch.zeros(7, dtype=torch.uint8, device=dev), 16, z), r"sign_decode: bits has 7 bytes"),
        (lambda: c.sign_decode(torch.zeros(4, device=dev).double(), torch.zeros(8, dtype=torch.uint8, device=dev), 16, z), r"sign_decode: scales must have dtype float32"),
        (lambda: c.qsgd_encode(x, None, 3, 1, 16, 0), r"qsgd_encode: bits must be one of 2, 4, 8, got 3"),
        (lambda: c.qsgd_encode(x, None, 1, 1, 16, 0), r"qsgd_encode: bits must be one of 2, 4, 8, got 1"),
        (lambda: c.qsgd_encode(x, None, 4, 8, 16, 0), r"qsgd_encode: levels must be in \[1, 7\] for bits=4, got 8"),
        (lambda: c.qsgd_encode(x, None, 4, 7, 0, 0), r"qsgd_encode: bucket_size must be >= 1"),
        (lambda: c.qsgd_decode(torch.zeros(4, device=dev), torch.zeros(31, dtype=torch.uint8, device=dev), 4, 7, 16, z), r"qsgd_decode: packed has 31 bytes"),
        (lambda: c.topk_select(x, 65), r"topk_select: k must be in \[0, numel=64\], got 65"),
        (lambda: c.topk_select(x, -1), r"topk_select: k must be in \[0, numel=64\], got -1"),
        (lambda: c.randomk_gather(x, 65, 0, False), r"randomk_gather: k must be in \[0, numel=64\], got 65"),
        (lambda: c.randomk_scatter_add(torch.zeros(65, device=dev), 0, z), r"randomk_scatter_add: k must be in \[0, numel=64\]"),
        (lambda: c.randomk_scatter_add(torch.zeros(6, device=dev).double(), 0, z), r"randomk_scatter_add: values has dtype torch.float64, out has torch.float32"),
    ]
    if dev != "cpu":
        cases.append((lambda: c.sign_encode(x, z.cpu(), 0), r"sign_encode: residual is on cpu but x is on cuda"))
    for fn, pattern in cases:
        with pytest.raises(KernelArgumentError, match=pattern):
            fn()


@parametrize_backends
def test_scatter_rejects_bad_indices_before_writing(backend: str) -> None:
    dev = backend
    c = backend.ops
    out = torch.zeros(10, device=dev)
    good = torch.tensor([1, 4], device=dev)
    ones = torch.ones(2, device=dev)
    cases = [
        (torch.tensor([3, 10], device=dev), r"sparse_scatter_add: indices\[1\]\[1\] = 10 is out of range \[0, 10\)"),
        (torch.tensor([-1, 2], device=dev), r"sparse_scatter_add: indices\[1\]\[0\] = -1 is out of range"),
        (torch.tensor([2, 2], device=dev), r"sparse_scatter_add: indices\[1\] must be strictly increasing \(no duplicates\): indices\[1\]\[1\] = 2 follows 2"),
        (torch.tensor([5, 3], dtype=torch.int32, device=dev), r"sparse_scatter_add: indices\[1\] must be strictly increasing"),
    ]
    for bad, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            c.sparse_scatter_add([good, bad], [ones, ones], out)
        assert not bool(out.any()), "nothing may be written when a payload is invalid"
    with pytest.raises(RuntimeError, match=r"sparse_scatter_add: indices\[0\] has 2 elements, values\[0\] has 3"):
        c.sparse_scatter_add([good], [torch.ones(3, device=dev)], out)
    with pytest.raises(RuntimeError, match=r"sparse_scatter_add: indices\[0\] must have dtype int32 or int64"):
        c.sparse_scatter_add([good.float()], [ones], out)
    with pytest.raises(RuntimeError, match=r"sparse_scatter_add: values\[0\] has dtype torch.float64, out has torch.float32"):
        c.sparse_scatter_add([good], [ones.double()], out)


@parametrize_backends
def test_non_finite_and_overflow_raise_before_writing(backend: str) -> None:
    dev = backend
    c = backend.ops
    x = torch.randn(5000, device=dev)
    x[4321] = float("inf")
    e = torch.randn(5000, device=dev)
    before = e.clone()
    # NaN/Inf is its own kind (NonFiniteError), on every backend; the native ops signal it by
    # type (csrc/checks.h check_finite), not by message
    with pytest.raises(NonFiniteError, match=r"sign_encode: x \+ residual contains NaN or Inf"):
        c.sign_encode(x, e, 0)
    with pytest.raises(NonFiniteError, match=r"qsgd_encode: x \+ residual contains NaN or Inf"):
        c.qsgd_encode(x, e, 4, 7, 512, 1)
    assert same_bits(e, before)
    with pytest.raises(NonFiniteError, match=r"topk_select: x contains NaN or Inf"):
        c.topk_select(x, 10)
    with pytest.raises(NonFiniteError, match=r"randomk_gather: x contains NaN or Inf"):
        c.randomk_gather(x, 10, 0, False)
    # data errors found by the kernels: each backend words the dtype its own way
    big = torch.full((64,), 3e4, dtype=torch.float16, device=dev)
    with pytest.raises(KernelArgumentError, match=r"qsgd_encode: a bucket norm .* exceeds \S*(Half|float16)'s range"):
        c.qsgd_encode(big, None, 4, 7, 64, 0)
    huge = torch.full((10,), 1.7e308, dtype=torch.float64, device=dev)
    with pytest.raises(KernelArgumentError, match=r"sign_encode: a block's mean magnitude overflows \S*(Double|float64)"):
        c.sign_encode(huge, None, 0)
    with pytest.raises(KernelArgumentError, match=r"randomk_gather: x scaled by its block length overflows \S*(Half|float16)"):
        c.randomk_gather(torch.full((1000,), 1e3, dtype=torch.float16, device=dev), 10, 0, True)


@parametrize_backends
def test_wrappers_map_errors(backend) -> None:
    # the codecs' wrappers run on the backend under test, and map its errors the same way
    assert ops.backend_for("sign_encode", backend) == ("native" if backend.native else backend.name)
    x = torch.randn(100, device=backend)
    x[3] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        ops.sign_encode(x, 0)
    with pytest.raises(CodecError, match="k must be in"):
        ops.topk_select(torch.randn(5, device=backend), 6)
    with pytest.raises(CodecError, match="residual"):
        ops.sign_encode(torch.randn(5, device=backend), 0, residual=torch.zeros(5, dtype=torch.float64, device=backend))
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        ops.qsgd_encode(x, 4, 7, 64, 0)


# ---------------------------------------------------------------------------------------------
# The native ops called directly: only the checks that protect memory, in their own words


@pytest.mark.parametrize("backend", TORCH_OP_BACKENDS, indirect=True)
def test_native_ops_guard_memory_without_the_python_checks(backend: str) -> None:
    dev = backend
    c = torch.ops.commpress
    x = torch.randn(64, device=dev)
    z = torch.zeros(64, device=dev)
    u8 = torch.zeros(8, dtype=torch.uint8, device=dev)
    cases = [
        (lambda: c.sign_encode(x, z[:10], 0), r"sign_encode: residual"),
        (lambda: c.sign_encode(x, z.double(), 0), r"sign_encode: residual"),
        (lambda: c.sign_encode(x[::2], None, 0), r"sign_encode: x"),
        (lambda: c.sign_encode(x, None, -1), r"sign_encode: block_size"),
        (lambda: c.sign_decode(torch.zeros(3, device=dev), u8, 16, z), r"sign_decode: scales"),
        (lambda: c.sign_decode(torch.zeros(4, device=dev), u8[:7], 16, z), r"sign_decode: bits"),
        (lambda: c.qsgd_encode(x, None, 3, 1, 16, 0), r"qsgd_encode: bits"),
        (lambda: c.qsgd_encode(x, None, 8, 200, 16, 0), r"qsgd_encode: levels"),
        (lambda: c.qsgd_decode(torch.zeros(4, device=dev), u8, 4, 7, 16, z), r"qsgd_decode: packed"),
        (lambda: c.topk_select(x, 65), r"topk_select: k"),
        (lambda: c.randomk_gather(x, 65, 0, False), r"randomk_gather: k"),
        (lambda: c.randomk_scatter_add(torch.zeros(6, device=dev).double(), 0, z), r"randomk_scatter_add: values"),
        (lambda: c.sparse_scatter_add([torch.tensor([64], device=dev)], [torch.ones(1, device=dev)], z), r"sparse_scatter_add: indices\[0\]\[0\]"),
        (lambda: c.unpack_bits(u8, 2, 13), r"unpack_bits: packed"),
        (lambda: c.pack_bits(u8, 3), r"pack_bits: bits"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
    assert not bool(z.any())
    bad = x.clone()
    bad[5] = float("nan")
    e = torch.randn(64, device=dev)
    before = e.clone()
    for fn in (lambda: c.sign_encode(bad, e, 0), lambda: c.qsgd_encode(bad, e, 4, 7, 16, 0),
               lambda: c.topk_select(bad, 3), lambda: c.randomk_gather(bad, 3, 0, False)):
        with pytest.raises(ValueError, match="NaN or Inf") as info:  # the non-finite kind
            fn()
        assert not isinstance(info.value, RuntimeError)
    assert same_bits(e, before)


@parametrize_backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_longer_than_the_tensor(backend: str, dtype: torch.dtype) -> None:
    """Issue #12: a block or bucket near 2**63 is one block, never an overflow (or a crash)."""
    x = sample(1000, dtype, seed=5)
    for block in (2**63 - 1, 2**62 + 3, 1001):
        e = residual_for(x, 5)
        e_ref = e.clone()
        want = sign_mod.encode_reference(x, 0, e_ref)
        (xd, ed) = on(backend, x, e)
        got = backend.ops.sign_encode(xd, ed, block)
        assert_same(got, want, f"sign_encode block={block}")
        assert same_bits(ed, e_ref)
        out_ref = torch.zeros(1000, dtype=dtype)
        sign_mod.decode_reference(*want, 0, out_ref)
        (outd,) = on(backend, torch.zeros(1000, dtype=dtype))
        backend.ops.sign_decode(*on(backend, *want), block, outd, True)
        assert same_bits(outd, out_ref)
        want_q = qsgd_mod.encode_reference(x, 4, 7, 1000, 9, None)
        got_q = backend.ops.qsgd_encode(*on(backend, x), None, 4, 7, block, 9)
        assert_same(got_q, want_q, f"qsgd_encode bucket={block}")
    with pytest.raises(KernelArgumentError, match=r"sign_encode: block_size must be < 2\*\*63"):
        backend.ops.sign_encode(*on(backend, x), None, 2**63)


def test_sign_block_size_near_2_63_codec_and_wire() -> None:
    """Issue #12 item 1: the codec API and the wire reject impossible block sizes clearly."""
    import struct

    from commpress.errors import WireError

    x = torch.randn(100)
    codec = codecs.from_config({"name": "sign", "block_size": 2**63 - 1})
    packet = codec.encode(x)
    assert packet.sections["scales"].numel() == 1  # one block, never an overflowed count
    assert same_bits(codec.decode(packet), codecs.from_config({"name": "sign"}).decode(codec.encode(x)))
    with pytest.raises(CodecError, match=r"block_size must be an int in \[0, 2\*\*63\)"):
        codecs.from_config({"name": "sign", "block_size": 2**63})
    raw = bytearray(wire.to_bytes(codecs.from_config({"name": "sign", "block_size": 16}).encode(x)).numpy().tobytes())
    for p0 in (2**63, 2**64 - 1):
        struct.pack_into("<Q", raw, 24, p0)  # param0 of the header
        with pytest.raises(WireError, match=r"params\[0\]: sign block_size must be < 2\*\*63"):
            wire.from_bytes(bytes(raw))
