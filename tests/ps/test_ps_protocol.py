"""Serial tests of the parameter server's message format, sharding, config and fault specs."""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from commpress import codecs, wire
from commpress.ps import ConfigError, ProtocolError, PSConfig, parse_codec, parse_fault
from commpress.ps.protocol import (
    FLAG_CRC,
    FLAG_SKIP,
    HEADER,
    HEADER_NBYTES,
    TO_SERVER,
    TO_WORKER,
    MsgType,
    build,
    parse_header,
    parse_segments,
    payload_nbytes,
    segment_parts,
)
from commpress.ps.sharding import Layout, fingerprint

NONE = codecs.get("none")


def _np(msg: torch.Tensor) -> np.ndarray:
    return msg.numpy().copy()


def test_header_is_48_bytes_and_roundtrips():
    assert HEADER_NBYTES == 48
    msg = build(MsgType.PUSH, shard=3, worker=7, step=123456789, parts=[b"abcdefgh"], value=1.5)
    head = parse_header(_np(msg), 9, TO_SERVER)
    assert (head.type, head.shard, head.worker, head.step, head.nbytes, head.value) == (
        MsgType.PUSH, 3, 7, 123456789, 8, 1.5)
    assert head.flags & FLAG_CRC and head.crc32 == zlib.crc32(b"abcdefgh")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: b.__setitem__(slice(0, 4), np.frombuffer(b"XXXX", np.uint8)), "magic"),
        (lambda b: b.__setitem__(4, 9), "version"),
        (lambda b: b.__setitem__(5, 77), "type"),
        (lambda b: b.__setitem__(6, 0x80), "flags"),
        (lambda b: b.__setitem__(36, 1), "reserved"),
        (lambda b: b.__setitem__(HEADER_NBYTES + 2, b[HEADER_NBYTES + 2] ^ 1), "crc32"),
        (lambda b: b.__setitem__(24, 99), "nbytes"),
    ],
)
def test_header_validation_names_the_field(mutate, field):
    buf = _np(build(MsgType.PUSH, shard=0, worker=0, step=1, parts=[b"12345678"]))
    mutate(buf)
    with pytest.raises(ProtocolError, match=field) as info:
        parse_header(buf, 5, TO_SERVER)
    assert info.value.sender == 5 and "rank 5" in str(info.value)


def test_header_rejects_wrong_direction_truncation_and_nan_value():
    buf = _np(build(MsgType.PARAMS, shard=0, worker=0, step=0))
    with pytest.raises(ProtocolError, match="type: PARAMS is not accepted"):
        parse_header(buf, 1, TO_SERVER)
    assert parse_header(buf, 1, TO_WORKER).type == MsgType.PARAMS
    with pytest.raises(ProtocolError, match="truncated"):
        parse_header(buf[:20], 1, TO_WORKER)
    nan = _np(build(MsgType.PUSH, shard=0, worker=0, step=0))  # build refuses a NaN value: a liar patches it in
    nan[40:48] = np.frombuffer(np.float64(np.nan).tobytes(), dtype=np.uint8)
    with pytest.raises(ProtocolError, match="value"):
        parse_header(nan, 1, TO_SERVER)
    skip_pull = _np(build(MsgType.PULL, shard=0, worker=0, step=0, flags=FLAG_SKIP))
    with pytest.raises(ProtocolError, match="SKIP"):
        parse_header(skip_pull, 1, TO_SERVER)


@given(st.binary(min_size=0, max_size=200))
def test_random_bytes_never_crash_the_parser(data):
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    try:
        parse_header(buf, 2, TO_SERVER)
    except ProtocolError:
        pass


def _layout(servers=2, min_compress=16):
    return Layout([("w1", (8, 10)), ("b1", (8,)), ("w2", (3, 8)), ("b2", (3,))], torch.float32, servers, min_compress)


def test_shards_are_balanced_and_cover_everything():
    for servers in (1, 2, 3, 5, 7):
        lay = _layout(servers)
        sizes = [sh.numel for sh in lay.shards]
        assert sum(sizes) == lay.numel == 80 + 8 + 24 + 3
        assert max(sizes) - min(sizes) <= 1
        covered = [i for sh in lay.shards for seg in sh.segments for i in range(seg.start, seg.stop)]
        assert covered == list(range(lay.numel))
        pieces = [i for sh in lay.shards for pc in sh.pieces for i in range(pc.start, pc.stop)]
        assert pieces == list(range(lay.numel))


def test_segments_compress_big_matrices_and_merge_small_tensors():
    lay = _layout(1)
    segs = lay.shards[0].segments
    assert [(s.start, s.stop, s.compress) for s in segs] == [(0, 80, True), (80, 88, False), (88, 112, True), (112, 115, False)]
    lay = _layout(1, min_compress=32)  # w2 (24 elements) now travels dense, merged with b1 and b2
    assert [(s.start, s.stop, s.compress) for s in lay.shards[0].segments] == [(0, 80, True), (80, 115, False)]
    cut = _layout(2)  # shard boundary inside w1: both pieces compressed separately, 1-D views
    assert cut.shards[0].pieces[0].shape == (57,) and cut.shards[1].pieces[0].shape == (23,)


def test_segments_follow_the_shared_selection_rule():
    from commpress.selection import DEFAULT_MIN_NUMEL, SelectionRule, compress

    rule = SelectionRule(min_numel=16)
    for servers in (1, 2, 3):
        lay = _layout(servers)
        assert lay.rule == rule
        for sh in lay.shards:
            for pc in sh.pieces:
                seg = next(s for s in sh.segments if s.start <= pc.start < s.stop)
                assert seg.compress == rule(pc.name, lay.params[pc.param].shape, pc.numel)
    assert DEFAULT_MIN_NUMEL == 1024
    assert compress("fc.weight", (32, 32)) and not compress("fc.weight", (31, 32)) and not compress("b", (4096,))
    assert compress("b", (4096,), dense_1d=False) and not compress("w", (64, 64), 1000)
    with pytest.raises(ValueError, match="min_numel"):
        SelectionRule(min_numel=-1)


def test_selection_rule_is_ddp_default_rule():
    planning = pytest.importorskip("commpress.ddp.planning")
    from commpress.selection import SelectionRule

    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in
              [("w", (32, 32)), ("v", (31, 33)), ("b", (2048,)), ("s", ()), ("c", (2, 3, 4, 5))]}
    for min_numel in (0, 1, 120, 1024, 5000):
        for dense_1d in (True, False):
            ddp = planning.default_rule(min_numel, dense_1d)
            ours = SelectionRule(min_numel, dense_1d)
            for name, p in params.items():
                assert ddp(name, p) == ours(name, tuple(p.shape)), (name, min_numel, dense_1d)


def test_layout_rejects_bad_input():
    with pytest.raises(ConfigError, match="fewer than"):
        Layout([("a", (2,))], torch.float32, 3)
    with pytest.raises(ConfigError, match="floating"):
        Layout([("a", (2,))], torch.int64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(ConfigError, match="one dtype"):
        Layout.from_model(model, 1)


def test_bind_makes_parameters_views_of_the_flat_vector():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    lay = Layout.from_model(model, 2)
    before = lay.flatten(model.parameters())
    flat = torch.empty(lay.numel)
    lay.bind(model, flat)
    assert torch.equal(flat, before)
    flat.add_(1.0)
    assert torch.equal(lay.flatten(model.parameters()), before + 1.0)


def test_fingerprint_changes_with_setup():
    a = fingerprint(_layout(2).describe(), PSConfig(codec="topk:ratio=0.1").describe())
    assert a == fingerprint(_layout(2).describe(), PSConfig(codec="topk:ratio=0.1").describe())
    assert a != fingerprint(_layout(3).describe(), PSConfig(codec="topk:ratio=0.1").describe())
    assert a != fingerprint(_layout(2).describe(), PSConfig(codec="topk:ratio=0.2").describe())


def _push_payload(lay, shard, codec, values, seed=0):
    sh = lay.shards[shard]
    def pick(seg):
        return codec if seg.compress else NONE

    packets = [pick(s).encode(values[s.start : s.stop], seed=seed) for s in sh.segments]
    parts = segment_parts(packets)
    return torch.cat(parts), pick


def test_segment_payload_roundtrip_and_exact_size():
    lay = _layout(2)
    codec = codecs.get("topk", ratio=0.25)
    values = torch.randn(lay.numel)
    for s in range(2):
        payload, pick = _push_payload(lay, s, codec, values)
        assert payload.numel() == payload_nbytes(lay.shards[s], pick, torch.float32)
        packets = parse_segments(payload.numpy(), lay.shards[s], pick, torch.float32, 3)
        assert len(packets) == len(lay.shards[s].segments)


def test_variable_size_segments_split_by_their_headers():
    lay = _layout(2)
    gamma = codecs.get("qsgd", bits=4, coding="gamma")
    values = torch.randn(lay.numel)
    payload, pick = _push_payload(lay, 0, gamma, values, seed=3)
    most = payload_nbytes(lay.shards[0], pick, torch.float32)
    assert payload.numel() < most  # smaller than the fixed-size bound
    packets = parse_segments(payload.numpy(), lay.shards[0], pick, torch.float32, 3)
    fixed, _ = _push_payload(lay, 0, codecs.get("qsgd", bits=4), values, seed=3)
    want = parse_segments(fixed.numpy(), lay.shards[0], lambda seg: codecs.get("qsgd", bits=4) if seg.compress else NONE, torch.float32, 3)
    for seg, a, b in zip(lay.shards[0].segments, packets, want):
        assert torch.equal(pick(seg).decode(a), (codecs.get("qsgd", bits=4) if seg.compress else NONE).decode(b))
    with pytest.raises(ProtocolError, match="after the last segment"):
        parse_segments(torch.cat([payload, torch.zeros(8, dtype=torch.uint8)]).numpy(), lay.shards[0], pick, torch.float32, 3)
    with pytest.raises(ProtocolError, match="truncated"):
        parse_segments(payload[:-8].numpy(), lay.shards[0], pick, torch.float32, 3)
    with pytest.raises(ProtocolError, match="at most"):
        parse_segments(torch.zeros(most + 1, dtype=torch.uint8).numpy(), lay.shards[0], pick, torch.float32, 3)


def test_segment_payload_rejections_name_the_problem():
    lay = _layout(2)
    topk = codecs.get("topk", ratio=0.25)
    values = torch.randn(lay.numel)
    payload, pick = _push_payload(lay, 0, topk, values)
    with pytest.raises(ProtocolError, match="needs exactly"):
        parse_segments(payload[:-8].numpy(), lay.shards[0], pick, torch.float32, 3)
    bad = payload.clone()
    bad[:4] = torch.tensor(list(b"XXXX"), dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="segment 0: magic"):
        parse_segments(bad.numpy(), lay.shards[0], pick, torch.float32, 3)
    # the right size but another codec (same byte count impossible here: use none for both)
    other, _ = _push_payload(lay, 0, codecs.get("topk", ratio=0.25), values, seed=5)
    with pytest.raises(ProtocolError, match="seed"):
        parse_segments(other.numpy(), lay.shards[0], pick, torch.float32, 3, seeds=[0] * len(lay.shards[0].segments))
    # a packet that is valid wire format but for the wrong tensor size
    wrong = wire.to_bytes(topk.encode(torch.randn(lay.shards[0].segments[0].numel + 4)))
    with pytest.raises(ProtocolError):
        parse_segments(torch.cat([wrong, payload[wrong.numel():]]).numpy(), lay.shards[0], pick, torch.float32, 3)


def test_codec_specs():
    assert parse_codec("topk:ratio=0.01").config() == {"name": "topk", "ratio": 0.01, "k": None}
    assert parse_codec("qsgd:bits=8,bucket_size=128").config()["bucket_size"] == 128
    assert parse_codec("randomk:ratio=0.1,scaled=false").config()["scaled"] is False
    for bad in ("nope", "topk:ratio", "topk:ratio=2", ""):
        with pytest.raises(ConfigError):
            parse_codec(bad)


def test_config_validation_names_the_option():
    for kwargs, name in [({"mode": "bsp"}, "mode"), ({"servers": 0}, "servers"), ({"timeout": 0}, "timeout"),
                         ({"max_drift": 0}, "max_drift"), ({"resume": True}, "resume"), ({"staleness": -1}, "staleness"),
                         ({"codec": "topk"}, "topk")]:
        with pytest.raises(ConfigError, match=name):
            PSConfig(**kwargs).validate()
    cfg = PSConfig(codec="randomk:ratio=0.1")
    assert not cfg.use_error_feedback()  # unbiased, not contractive: error feedback would grow
    assert PSConfig(codec="topk:ratio=0.1").use_error_feedback()
    assert PSConfig(codec="sign", pull_codec="none").reply_codec().name == "none"
    assert PSConfig(codec="sign").reply_codec().name == "sign"
    assert PSConfig(codec="randomk:ratio=0.1").reply_codec().name == "none"  # see PSConfig.reply_codec


def test_fault_specs():
    f = parse_fault("hang:worker=1,step=3,seconds=2.5")
    assert (f.kind, f.worker, f.step, f.seconds) == ("hang", 1, 3, 2.5)
    assert f.applies(1, 3) and not f.applies(1, 4) and not f.applies(0, 3)
    assert parse_fault("slow:worker=0").applies(0, 99)
    assert parse_fault("hang: worker = 2 , seconds=inf").seconds == float("inf")  # the shared option parser
    for bad in ("explode:worker=1", "hang:step=1", "hang:worker=x", "hang:worker=1,step=1.5", "hang:worker=-1",
                "hang:worker=1,speed=3", "hang:worker=1,seconds=-2", "hang:worker"):
        with pytest.raises(ConfigError):
            parse_fault(bad)


def test_header_struct_layout_is_stable():
    assert HEADER.format == "<4sBBHIIQQIId"
