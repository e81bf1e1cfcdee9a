"""Wire format: exact layout, strict validation, and fuzzing (only WireError, never a crash)."""

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError, WireError, codecs, wire

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


# ----- the multi-packet frame (commpress.wire.frame) -------------------------------------------
def test_frame_roundtrip_and_hostile_bytes():
    topk = codecs.get("topk", ratio=0.1)
    dense = codecs.get("none")
    layout = wire.FrameLayout([("w", topk, 100), ("b", dense, 7)], torch.float32)
    x, b = torch.randn(100), torch.randn(7)
    frame = layout.pack([topk.encode(x), None])
    assert frame.numel() == layout.nbytes and layout.nbytes % 8 == 0
    got = layout.unpack(frame, source=0)
    assert got[1] is None  # the non-finite flag travels instead of a packet
    assert got[0] is not None and torch.equal(topk.decode(got[0]), topk.decode(topk.encode(x)))
    frame = layout.pack([topk.encode(x), dense.encode(b)])
    with pytest.raises(WireError, match="rank 3: 10 bytes"):
        layout.unpack(frame[:10], source=3)
    bad = frame.clone()
    bad[0] = 0
    with pytest.raises(WireError, match="bad header"):
        layout.unpack(bad, source=1)
    bad = frame.clone()
    bad[8] = 7  # unknown flag of slot 'w'
    with pytest.raises(WireError, match="slot 'w' has unknown flag"):
        layout.unpack(bad, source=1)
    bad = frame.clone()
    bad[layout.offsets[1] + 8] ^= 0xFF  # corrupt the numel of slot 'b'
    with pytest.raises(WireError, match="rank 2, slot 'b': numel"):
        layout.unpack(bad, source=2)
    other = wire.FrameLayout([("w", topk, 100), ("b", codecs.get("fp16"), 7)], torch.float32)
    with pytest.raises(WireError):
        other.unpack(frame, source=0)  # sizes disagree: rejected before any decode
    with pytest.raises(WireError, match="slot 'w': seed: got 0, expected 5"):
        layout.unpack(frame, source=0, seeds=[5, 0])


def test_frame_bytes_are_the_ddp_frame_bytes():
    """DDP's frames keep their bytes: pinned from the frame writer this class replaced
    (collectives.FrameLayout at 8b24d15; sha256 of the packed frame). Re-pinned when QSGD's
    encode became fixed point (branch qsgd2): only slot 'c''s 150 bytes of levels changed."""
    import hashlib

    entries = [("a", codecs.get("sign", block_size=32), 70), ("b", codecs.get("none"), 5),
               ("c", codecs.get("qsgd", bits=4), 300), ("d", codecs.get("topk", k=3), 9)]
    pinned = {
        torch.float32: (480, "641e179d4bb81e8d5a14052d88fb1015a3428121347674395005ecd1aa90f990"),
        torch.float16: (464, "b17fce02d96e504790ae41337f881d848c10080d944aed1408d6f575457f072d"),
    }
    for dtype, (nbytes, digest) in pinned.items():
        g = torch.Generator().manual_seed(1)
        packets = [c.encode(torch.randn(n, generator=g).to(dtype), seed=9) for _, c, n in entries]
        packets[1] = None
        frame = wire.FrameLayout(entries, dtype).pack(packets)
        assert frame.numel() == nbytes and hashlib.sha256(frame.numpy().tobytes()).hexdigest() == digest


def test_frame_without_flags_and_variable_entries():
    gamma = codecs.get("qsgd", bits=4, coding="gamma")
    dense = codecs.get("none")
    layout = wire.FrameLayout([(0, gamma, 500), (1, dense, 3), (2, gamma, 64)], torch.float32,
                              flags=False, what="payload", entry="segment")
    assert not layout.fixed and layout.header_nbytes == 0
    xs = [torch.randn(500), torch.randn(3), torch.randn(64)]
    packets = [c.encode(x, seed=i) for i, (c, x) in enumerate(zip(layout.codecs, xs))]
    frame = layout.pack(packets)
    assert frame.numel() < layout.nbytes  # gamma coding is shorter than its bound
    assert torch.equal(frame, torch.cat([wire.to_bytes(p) for p in packets]))  # just the packets
    got = layout.unpack(frame, seeds=[0, 1, 2])
    for c, p, q in zip(layout.codecs, got, packets):
        assert p is not None and torch.equal(c.decode(p), c.decode(q))
    with pytest.raises(WireError, match="after the last segment"):
        layout.unpack(torch.cat([frame, torch.zeros(8, dtype=torch.uint8)]))
    with pytest.raises(WireError, match="segment 2: truncated"):
        layout.unpack(frame[:-8])
    with pytest.raises(WireError, match="at most"):
        layout.unpack(torch.zeros(layout.nbytes + 1, dtype=torch.uint8))
    with pytest.raises(CodecError, match="needs a packet"):
        layout.pack([packets[0], None, packets[2]])


def test_frame_checks_the_header_before_any_content():
    """A packet claiming a huge numel is rejected by the expectation, before anything is sized by it."""
    gamma = codecs.get("qsgd", bits=4, coding="gamma")
    layout = wire.FrameLayout([(0, gamma, 64)], torch.float32, flags=False, entry="segment")
    frame = layout.pack([gamma.encode(torch.randn(64))])
    huge = patch(frame, 8, "<Q", 2**40)
    with pytest.raises(WireError, match="segment 0: numel: got 1099511627776, expected 64"):
        layout.unpack(huge)
    with pytest.raises(WireError, match="codec: got 'qsgd', expected 'none'"):
        wire.from_bytes(frame, wire.Expect.of(codecs.get("none"), 64, torch.float32))
    with pytest.raises(WireError, match="dtype"):
        wire.from_bytes(frame, wire.Expect.of(gamma, 64, torch.float16))
