"""Property tests: what every codec guarantees (see the table in commpress/codecs/__init__.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError, codecs, wire

from strategies import CODEC_CONFIGS, DTYPES, make_codec, tensors

ALL = list(CODEC_CONFIGS)
STOCHASTIC = [c for c in ALL if make_codec(c).stochastic]


def sq(t):
    return float(t.double().square().sum())


def fit(cid, x):
    """Casts refuse values past their wire dtype's range by design (tested below)."""
    limit = {"fp16": 3e4, "bf16": 1e38}.get(cid)
    return x if limit is None else x.double().clamp(-limit, limit).to(x.dtype)


# ----- round trip, sizes, determinism -------------------------------------------------------
@pytest.mark.parametrize("cid", ALL)
@given(x=tensors(), seed=st.integers(0, 2**64 - 1))
def test_wire_size_exact_and_bytes_round_trip(cid, x, seed):
    codec = make_codec(cid)
    x = fit(cid, x)
    packet = codec.encode(x, seed=seed)
    buf = wire.to_bytes(packet)
    if codec.fixed_size:
        assert buf.numel() == codec.wire_size(x.numel(), x.dtype)
    else:  # variable-length coding: bounded by wire_size, and the header tells the size
        assert buf.numel() <= codec.wire_size(x.numel(), x.dtype)
        assert wire.packet_extent(torch.cat([buf, buf])) == buf.numel()
    decoded = codec.decode(packet)
    assert decoded.dtype == x.dtype and decoded.shape == (x.numel(),)
    assert bool(torch.isfinite(decoded).all())
    again = codec.decode(wire.from_bytes(buf))
    assert torch.equal(again, decoded)
    assert torch.equal(wire.to_bytes(wire.from_bytes(buf)), buf)  # canonical form


@pytest.mark.parametrize("cid", ALL)
@given(x=tensors(), seed=st.integers(0, 2**64 - 1))
def test_same_seed_same_bytes(cid, x, seed):
    codec = make_codec(cid)
    x = fit(cid, x)
    assert torch.equal(wire.to_bytes(codec.encode(x, seed=seed)), wire.to_bytes(codec.encode(x.clone(), seed=seed)))


@pytest.mark.parametrize("cid", STOCHASTIC)
@given(seed=st.integers(0, 2**63))
def test_different_seeds_draw_differently(cid, seed):
    codec = make_codec(cid)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    a = codec.decode(codec.encode(x, seed=seed))
    b = codec.decode(codec.encode(x, seed=seed + 1))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("cid", ALL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_input_decodes_to_zero(cid, dtype):
    codec = make_codec(cid)
    for n in (0, 1, 33, 1000):
        x = torch.zeros(n, dtype=dtype)
        assert torch.equal(codec.decode(codec.encode(x, seed=5)), x)


@pytest.mark.parametrize("cid", ALL)
def test_non_contiguous_input_equals_contiguous(cid):
    codec = make_codec(cid)
    x = torch.randn(40, 30, dtype=torch.float32).t()
    assert not x.is_contiguous()
    got = codec.decode(codec.encode(x, seed=9))
    want = codec.decode(codec.encode(x.contiguous(), seed=9))
    assert torch.equal(got, want)


@pytest.mark.parametrize("cid", ALL)
def test_decode_into_out_and_accumulate(cid):
    codec = make_codec(cid)
    x = torch.randn(6, 50, dtype=torch.float64)
    packet = codec.encode(x, seed=2)
    plain = codec.decode(packet)
    out = torch.full((6, 50), 7.0, dtype=torch.float64)
    assert codec.decode(packet, out) is out
    assert torch.equal(out.view(-1), plain)
    out.fill_(1.0)
    codec.decode(packet, out, accumulate=True)
    assert torch.allclose(out.view(-1), plain + 1.0)


# ----- stated properties ----------------------------------------------------------------------
@pytest.mark.parametrize("cid", ["none", "topk-ratio", "topk-k", "sign", "sign-block"])
@given(x=tensors(dtypes=[torch.float32, torch.float64], kinds=("normal", "sparse", "constant", "huge", "tiny")))
def test_deterministic_contraction(cid, x):
    """||C(x) - x||^2 <= (1 - delta) ||x||^2 for the deterministic contractive codecs."""
    codec = make_codec(cid)
    m = float(x.abs().max()) if x.numel() else 1.0
    m = m or 1.0  # measure relative to max |x| so 1e300 inputs do not overflow the squares
    err = sq((codec.decode(codec.encode(x)).double() - x.double()) / m)
    delta = codec.delta(x.numel())
    # relative slack for float rounding of the stored scale (float32) and of the sums
    assert err <= (1 - delta) * sq(x.double() / m) * (1 + 1e-5) + 1e-300


def test_topk_keeps_the_largest():
    x = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0])
    dec = codecs.get("topk", k=2).decode(codecs.get("topk", k=2).encode(x))
    assert dec.tolist() == [0.0, -5.0, 0.0, 4.0, 0.0, 0.0]


def test_sign_maps_zero_and_negative_zero_to_plus_scale():
    x = torch.tensor([0.0, -0.0, -2.0, 2.0])
    assert codecs.get("sign").decode(codecs.get("sign").encode(x)).tolist() == [1.0, 1.0, -1.0, 1.0]


def _mean_and_var(codec, x, n):
    total = torch.zeros_like(x, dtype=torch.float64)
    var = 0.0
    for s in range(n):
        d = codec.decode(codec.encode(x, seed=s)).double()
        total += d
        var += sq(d - x.double())
    return total / n, var / n


# Statistical tests use fixed seeds 0..N-1, so they are deterministic; the tolerance is stated.
# For an unbiased codec E||mean_N - x||^2 = V / N with V the per-draw variance; with d >= 64
# degrees of freedom, exceeding 3 V / N has probability far below 1e-6.
@pytest.mark.parametrize("cid", ["qsgd2", "qsgd4", "qsgd8", "randomk-scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unbiased(cid, dtype):
    codec = make_codec(cid)
    assert codec.unbiased
    x = (torch.randn(200, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3).to(dtype)
    n = 1500
    mean, var = _mean_and_var(codec, x, n)
    assert sq(mean - x.double()) <= 3 * var / n


@pytest.mark.parametrize("cid", ["topk-ratio", "randomk-unscaled", "sign"])
def test_unbiasedness_check_detects_biased_codecs(cid):
    """The statistic above has power: it rejects codecs that are biased."""
    codec = make_codec(cid)
    assert not codec.unbiased
    x = torch.randn(200, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3
    n = 300
    mean, var = _mean_and_var(codec, x, n)
    assert sq(mean - x) > 3 * var / n


@given(x=tensors(dtypes=[torch.float32], lengths=st.integers(64, 600), kinds=("normal", "sparse")))
@settings(max_examples=15)
def test_randomk_unscaled_expected_contraction(x):
    codec = make_codec("randomk-unscaled")
    _, err = _mean_and_var(codec, x, 200)
    # expectation bound; 200 draws: allow 15% sampling slack
    assert err <= (1 - codec.delta(x.numel())) * sq(x) * 1.15 + 1e-30


@pytest.mark.parametrize("bits,levels,bucket", [(2, 1, 64), (4, 7, 512), (4, 3, 100), (8, 127, 256)])
@given(x=tensors(dtypes=[torch.float32, torch.float64], lengths=st.integers(1, 1200), kinds=("normal", "sparse", "constant")))
@settings(max_examples=10)
def test_qsgd_variance_bound(bits, levels, bucket, x):
    """E||Q(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2 (estimated over 100 seeds, 10% slack)."""
    codec = codecs.get("qsgd", bits=bits, levels=levels, bucket_size=bucket)
    _, err = _mean_and_var(codec, x, 100)
    assert err <= codec.variance_bound(x.numel()) * sq(x) * 1.1 + 1e-30


def test_randomk_indices_shared_by_seed_not_by_data():
    codec = codecs.get("randomk", k=10, scaled=False)
    a = codec.decode(codec.encode(torch.arange(1.0, 101.0), seed=77))
    b = codec.decode(codec.encode(-torch.arange(1.0, 101.0), seed=77))
    assert torch.equal(a.nonzero(), b.nonzero()) and a.count_nonzero() == 10


# ----- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("cid", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_rejected(cid, bad):
    x = torch.randn(100)
    x[17] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        make_codec(cid).encode(x)


@pytest.mark.parametrize("cid", ALL)
def test_wrong_dtype_rejected(cid):
    with pytest.raises(CodecError, match="dtype"):
        make_codec(cid).encode(torch.arange(10))
    with pytest.raises(CodecError, match="torch.Tensor"):
        make_codec(cid).encode([1.0, 2.0])


@pytest.mark.parametrize(
    "name,params,match",
    [
        ("nope", {}, "unknown codec"),
        ("topk", {}, "exactly one of ratio or k"),
        ("topk", {"ratio": 0.1, "k": 3}, "exactly one"),
        ("topk", {"ratio": 0.0}, "ratio"),
        ("topk", {"ratio": 1.5}, "ratio"),
        ("topk", {"k": 0}, "k must be"),
        ("randomk", {"ratio": -1}, "ratio"),
        ("randomk", {"ratio": 0.1, "scaled": "yes"}, "scaled"),
        ("sign", {"block_size": -1}, "block_size"),
        ("qsgd", {"bits": 3}, "bits"),
        ("qsgd", {"bits": 4, "levels": 8}, "levels"),
        ("qsgd", {"bucket_size": 0}, "bucket_size"),
        ("none", {"ratio": 0.1}, "codec .none.: .*takes no arguments"),
        ("qsgd", {"ratio": 0.1}, "unexpected keyword"),
    ],
)
def test_bad_configuration_rejected(name, params, match):
    with pytest.raises(CodecError, match=match):
        codecs.get(name, **params)


def test_k_larger_than_numel_rejected():
    with pytest.raises(CodecError, match="k=20 exceeds"):
        codecs.get("topk", k=20).encode(torch.randn(10))


def test_fp16_overflow_rejected_with_hint():
    with pytest.raises(CodecError, match="bf16"):
        codecs.get("fp16").encode(torch.tensor([1e6]))


def test_qsgd_norm_beyond_output_dtype_rejected():
    with pytest.raises(CodecError, match="bucket norm"):
        codecs.get("qsgd").encode(torch.full((64,), 3e4, dtype=torch.float16))


def test_decode_checks_codec_and_out():
    packet = codecs.get("sign").encode(torch.randn(10))
    with pytest.raises(CodecError, match="encoded by codec 'sign'"):
        codecs.get("none").decode(packet)
    with pytest.raises(CodecError, match="out has"):
        codecs.get("sign").decode(packet, torch.zeros(11))
    with pytest.raises(CodecError, match="contiguous"):
        codecs.get("sign").decode(packet, torch.zeros(20)[::2])


def test_config_round_trip():
    for cid in ALL:
        codec = make_codec(cid)
        assert codecs.from_config(codec.config()) == codec


def test_spec_round_trip_and_errors():
    for cid in ALL:
        codec = make_codec(cid)
        assert codecs.from_spec(codecs.to_spec(codec)) == codec
    assert codecs.from_spec("randomk:ratio=0.1,scaled=false").config()["scaled"] is False
    for bad, match in [("", "non-empty"), ("topk:ratio", "key=value"), ("topk:ratio=2", "ratio")]:
        with pytest.raises(CodecError, match=match):
            codecs.from_spec(bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_matches_isfinite(dtype):
    from commpress.spec.numerics import all_finite

    big = torch.finfo(dtype).max
    cases = [
        torch.zeros(0, dtype=dtype),
        torch.randn(1000).to(dtype),
        torch.full((64,), big, dtype=dtype),  # finite, but the sum overflows: the slow path decides
        torch.tensor([big, -big, big], dtype=dtype),
    ]
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(1000).to(dtype)
        t[417] = bad
        cases.append(t)
    both = torch.randn(10).to(dtype)
    both[2], both[7] = float("inf"), float("-inf")
    cases.append(both)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all())


def test_lossless_is_the_rounding_only_codecs():
    assert {name for name in codecs.available() if codecs.codec_class(name).lossless} == {"none", "fp16", "bf16"}


def test_codecs_register_into_the_wire_registry():
    from commpress.wire import registry

    for name in codecs.available():
        cls = codecs.codec_class(name)
        assert registry.by_name(name) is cls and registry.by_id(cls.codec_id) is cls
    with pytest.raises(CodecError, match="unknown codec"):
        registry.by_name("nope")
