"""Shared hypothesis strategies and codec configurations for the property tests."""

import torch
from hypothesis import strategies as st

from commpress import codecs

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
EDGE_LENGTHS = [0, 1, 2, 7, 8, 9, 31, 32, 33, 63, 65, 511, 513, 1025]

# Every codec in the forms users configure it; ids are used as pytest ids.
CODEC_CONFIGS = {
    "none": dict(name="none"),
    "fp16": dict(name="fp16"),
    "bf16": dict(name="bf16"),
    "topk-ratio": dict(name="topk", ratio=0.05),
    "topk-k": dict(name="topk", k=1),
    "randomk-scaled": dict(name="randomk", ratio=0.1),
    "randomk-unscaled": dict(name="randomk", ratio=0.1, scaled=False),
    "sign": dict(name="sign"),
    "sign-block": dict(name="sign", block_size=16),
    "qsgd2": dict(name="qsgd", bits=2, bucket_size=64),
    "qsgd4": dict(name="qsgd", bits=4),
    "qsgd8": dict(name="qsgd", bits=8, levels=100, bucket_size=100),
    "qsgd4-gamma": dict(name="qsgd", bits=4, coding="gamma"),
    "qsgd8-gamma": dict(name="qsgd", bits=8, levels=100, bucket_size=100, coding="gamma"),
    "int8": dict(name="int8"),
    "int4-block": dict(name="int4", block_size=16),
}


def make_codec(cid):
    return codecs.from_config(dict(CODEC_CONFIGS[cid]))


# Large magnitudes with headroom: fp16's is kept where a QSGD bucket norm or a random-k value
# scaled by d/k still fits fp16 (codecs reject input whose decoded form would overflow).
HUGE = {torch.float32: 1e30, torch.float16: 1e3, torch.bfloat16: 1e30, torch.float64: 1e300}
TINY = {torch.float32: 1e-40, torch.float16: 1e-7, torch.bfloat16: 1e-40, torch.float64: 1e-310}


@st.composite
def tensors(draw, dtypes=DTYPES, lengths=None, kinds=("normal", "normal", "zeros", "constant", "huge", "tiny", "sparse")):
    """Finite tensors of edge-case lengths and magnitudes."""
    dtype = draw(st.sampled_from(dtypes))
    n = draw(lengths if lengths is not None else st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, 1500)))
    kind = draw(st.sampled_from(kinds))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    base = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "constant":
        x = torch.full((n,), -0.75, dtype=torch.float64)
    elif kind == "huge":
        x = base.sign() * HUGE[dtype]
    elif kind == "tiny":
        x = base.sign() * TINY[dtype]
    elif kind == "sparse":
        x = base * (torch.rand(n, generator=g, dtype=torch.float64) < 0.1)
    else:
        x = base * draw(st.sampled_from([1e-3, 1.0, 50.0]))
    return x.to(dtype)
