"""Wire format: exact layout, strict validation, and fuzzing (only WireError, never a crash)."""

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import WireError, codecs, wire

from strategies import CODEC_CONFIGS, make_codec

ALL = list(CODEC_CONFIGS)


def sample(cid, n=100, dtype=torch.float32, seed=3):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    codec = make_codec(cid)
    return codec, wire.to_bytes(codec.encode(x, seed=seed))


def patch(buf, offset, fmt, value):
    out = bytearray(buf.numpy().tobytes())
    struct.pack_into(fmt, out, offset, value)
    return torch.frombuffer(out, dtype=torch.uint8)


def test_header_layout_documented():
    codec, buf = sample("topk-ratio", n=200)
    raw = buf.numpy().tobytes()
    magic, version, cid, dt, nsec, numel, seed, p0, p1 = struct.unpack_from("<4sBBBBQQQQ", raw)
    assert (magic, version, cid, dt, nsec, numel, seed) == (b"CPRS", 1, 4, 1, 2, 200, 3)
    assert (p0, p1) == (10, 0)  # k = 5% of 200
    assert struct.unpack_from("<QQ", raw, 40) == (40, 40)  # 10 int32 indices, 10 float32 values
    assert len(raw) == 40 + 16 + 40 + 40


def test_bytes_input_accepted():
    codec, buf = sample("sign")
    assert torch.equal(codec.decode(wire.from_bytes(buf.numpy().tobytes())), codec.decode(wire.from_bytes(buf)))


def test_misaligned_buffer_is_copied_not_rejected():
    codec, buf = sample("qsgd4")
    big = torch.zeros(buf.numel() + 3, dtype=torch.uint8)
    big[3:] = buf
    assert torch.equal(codec.decode(wire.from_bytes(big[3:])), codec.decode(wire.from_bytes(buf)))


@pytest.mark.parametrize(
    "offset,fmt,value,field",
    [
        (0, "<4s", b"XXXX", "magic"),
        (4, "<B", 2, "version"),
        (5, "<B", 99, "codec_id"),
        (6, "<B", 9, "dtype"),
        (7, "<B", 3, "nsections"),
        (8, "<Q", 5, "params.k"),  # k > numel
        (24, "<Q", 0, "params.k"),
        (32, "<Q", 1, "params\\[1\\]"),
        (40, "<Q", 44, "length\\[0\\]"),
    ],
)
def test_corrupted_header_fields_named(offset, fmt, value, field):
    _, buf = sample("topk-ratio", n=200)
    with pytest.raises(WireError, match=field):
        wire.from_bytes(patch(buf, offset, fmt, value))


@pytest.mark.parametrize("cid", ALL)
def test_truncated_and_oversized(cid):
    _, buf = sample(cid)
    for cut in sorted({0, 1, 39, 40, 47, buf.numel() - 1}):
        with pytest.raises(WireError, match="truncated"):
            wire.from_bytes(buf[:cut])
    with pytest.raises(WireError, match="oversized"):
        wire.from_bytes(torch.cat([buf, torch.zeros(8, dtype=torch.uint8)]))


def test_topk_indices_out_of_range_or_duplicated():
    codec = codecs.get("topk", k=3)
    buf = wire.to_bytes(codec.encode(torch.tensor([5.0, 0.0, 4.0, 0.0, 3.0])))
    idx_at = 40 + 16
    with pytest.raises(WireError, match="out of range"):
        wire.from_bytes(patch(buf, idx_at + 8, "<i", 5))
    with pytest.raises(WireError, match="out of range"):
        wire.from_bytes(patch(buf, idx_at, "<i", -1))
    with pytest.raises(WireError, match="strictly increasing"):
        wire.from_bytes(patch(buf, idx_at + 4, "<i", 0))


def test_nonzero_padding_rejected():
    codec = codecs.get("topk", k=3)
    buf = wire.to_bytes(codec.encode(torch.tensor([5.0, 0.0, 4.0, 0.0, 3.0])))
    with pytest.raises(WireError, match="padding after section 'indices'"):
        wire.from_bytes(patch(buf, 40 + 16 + 12, "<B", 1))


def test_sign_padding_bits_rejected():
    buf = wire.to_bytes(codecs.get("sign").encode(torch.randn(5)))
    bits_at = 40 + 16 + 8
    with pytest.raises(WireError, match="padding bits"):
        wire.from_bytes(patch(buf, bits_at, "<B", int(buf[bits_at]) | 0x80))


def test_qsgd_level_out_of_range_rejected():
    codec = codecs.get("qsgd", bits=4, levels=3, bucket_size=8)
    buf = wire.to_bytes(codec.encode(torch.randn(8)))
    levels_at = 40 + 16 + 8
    with pytest.raises(WireError, match="exceeds 2\\*levels"):
        wire.from_bytes(patch(buf, levels_at, "<B", 0x0F))


@pytest.mark.parametrize("cid,section_at", [("sign", 56), ("qsgd4", 56), ("none", 48), ("topk-k", 64)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_float_sections_rejected(cid, section_at, bad):
    _, buf = sample(cid, n=20)
    if bad == -1.0 and cid in ("none", "topk-k"):
        return  # negative values are legal there
    with pytest.raises(WireError, match="section"):
        wire.from_bytes(patch(buf, section_at, "<f", bad))


@pytest.mark.parametrize(
    "codec_id,params,field",
    [(7, (3 | 7 << 8, 512), "params.bits"), (7, (4 | 9 << 8, 512), "params.levels"), (7, (4 | 7 << 8, 0), "params.bucket_size"),
     (5, (10, 2), "params.scaled"), (6, (0, 5), "params\\[1\\]"), (1, (1, 0), "params")],
)
def test_bad_codec_params_named(codec_id, params, field):
    cid = {7: "qsgd4", 5: "randomk-scaled", 6: "sign", 1: "none"}[codec_id]
    _, buf = sample(cid)
    buf = patch(buf, 24, "<Q", params[0])
    buf = patch(buf, 32, "<Q", params[1])
    with pytest.raises(WireError, match=field):
        wire.from_bytes(buf)


def test_numel_disagreeing_with_section_lengths():
    _, buf = sample("none", n=100)
    with pytest.raises(WireError, match="length\\[0\\]"):
        wire.from_bytes(patch(buf, 8, "<Q", 101))


def test_huge_numel_is_rejected_without_allocating():
    _, buf = sample("none")
    with pytest.raises(WireError, match="length\\[0\\]"):
        wire.from_bytes(patch(buf, 8, "<Q", 2**63))


def test_wrong_buffer_types():
    with pytest.raises(WireError, match="uint8"):
        wire.from_bytes(torch.zeros(10))
    with pytest.raises(WireError, match="bytes"):
        wire.from_bytes("CPRS")


# ----- fuzzing: arbitrary and mutated bytes ------------------------------------------------
def _decode_or_wire_error(data):
    try:
        packet = wire.from_bytes(data)
    except WireError:
        return
    # accepted: it must decode to a finite tensor of the declared size
    out = codecs.codec_class(packet.codec)
    codec = codecs.from_config({"name": out.name, **_ctor_params(packet)})
    decoded = codec.decode(packet)
    assert decoded.numel() == packet.numel and bool(torch.isfinite(decoded.double()).all())


def _ctor_params(packet):
    if packet.codec == "topk":
        return {"k": packet.params[0]} if packet.params[0] else {"ratio": 1.0}
    if packet.codec == "randomk":
        return {"k": max(packet.params[0], 1), "scaled": bool(packet.params[1])}
    return {}


@given(st.binary(max_size=300))
@settings(max_examples=300)
def test_fuzz_arbitrary_bytes(data):
    _decode_or_wire_error(data)


@given(st.sampled_from(ALL), st.data())
@settings(max_examples=300)
def test_fuzz_mutated_packets(cid, data):
    _, buf = sample(cid, n=data.draw(st.integers(0, 70)), seed=data.draw(st.integers(0, 5)))
    raw = bytearray(buf.numpy().tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "set", "cut", "extend"]))
        if action in ("flip", "set") and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = raw[i] ^ (1 << data.draw(st.integers(0, 7))) if action == "flip" else data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[data.draw(st.integers(0, len(raw))):]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=16))
    _decode_or_wire_error(bytes(raw))
