"""Hostile bytes and corrupt checkpoints (issue #12): regression tests for the red-team cases.

- failure 3, memory bombs: a header's ``numel`` never sizes an allocation the caller did not
  expect (72-byte top-k, 56-byte random-k, gamma-coded QSGD claiming 2**40 elements);
- failure 4, validated packets that decode to Inf: scales and values beyond the output dtype;
- failures 6/7, parameter-server checkpoints: private atomic writes, digest, plausibility.
"""

import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from commpress import codecs, varlen, wire
from commpress.errors import CodecError, WireError
from commpress.ps import ProtocolError
from commpress.ps.protocol import parse_segments
from commpress.ps.sharding import Layout
from commpress.wire.packet import FLOAT_DTYPE_CODES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NONE = codecs.get("none")


def _header(codec_id, dtype_code, lengths, numel, p0, p1, seed=0):
    return struct.pack("<4sBBBBQQQQ", b"CPRS", 1, codec_id, dtype_code, len(lengths), numel, seed, p0, p1) + b"".join(
        struct.pack("<Q", n) for n in lengths
    )


def _pad(b):
    return b + b"\0" * (-len(b) % 8)


def topk_bomb(numel=330_000_000):
    """The 72-byte top-k packet of the red-team run (k=1, numel 3.3e8: 1.31 GB decoded)."""
    return _header(4, 1, [4, 4], numel, 1, 0) + _pad(struct.pack("<i", 5)) + _pad(struct.pack("<f", 1.0))


def randomk_bomb(numel=1_400_000_000):
    """The 56-byte random-k packet (k=1, values only: 5.6 GB decoded)."""
    return _header(5, 1, [4], numel, 1, 0) + _pad(struct.pack("<f", 1.0))


def gamma_bomb(numel=1 << 40):
    """QSGD gamma-coded packet claiming 2**40 elements with a few bytes of stream."""
    bucket = (1 << 32) - 1
    norms = struct.pack("<f", 1.0) * -(-numel // bucket)
    stream = b"\x01" * 64
    return _header(7, 1, [len(norms), len(stream)], numel, 4 | 7 << 8 | 1 << 16, bucket) + _pad(norms) + stream


BOMBS = {"topk": topk_bomb, "randomk": randomk_bomb, "gamma": gamma_bomb}


# ----- failure 3: memory bombs ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bomb_is_rejected_by_from_bytes(name):
    buf = BOMBS[name]()
    with pytest.raises(WireError, match="numel"):
        wire.from_bytes(buf)
    with pytest.raises(WireError, match="numel"):
        wire.packet_extent(buf)


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bomb_is_rejected_against_an_expectation(name):
    codec = {"topk": codecs.get("topk", k=1), "randomk": codecs.get("randomk", k=1, scaled=False),
             "gamma": codecs.get("qsgd", coding="gamma")}[name]
    with pytest.raises(WireError, match="numel: got"):
        wire.from_bytes(BOMBS[name](), wire.Expect.of(codec, 1000, torch.float32))


def test_bombs_cost_no_memory_and_no_time():
    """In a fresh process (ru_maxrss is a high-water mark): < 200 MB and < 1 s for all three."""
    script = textwrap.dedent(f"""
        import resource, sys, time
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from test_hostile import BOMBS
        from commpress import codecs, wire
        from commpress.errors import WireError
        decoders = {{"topk": codecs.get("topk", k=1), "randomk": codecs.get("randomk", k=1, scaled=False),
                    "gamma": codecs.get("qsgd", coding="gamma")}}
        for name, make in sorted(BOMBS.items()):
            buf = make()
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.perf_counter()
            try:
                decoders[name].decode(wire.from_bytes(buf))
                outcome = "accepted"
            except WireError:
                outcome = "WireError"
            dt = time.perf_counter() - t0
            mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024
            print(name, outcome, round(dt, 3), round(mb, 1))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    # an address-space cap turns a regression into a quick failure instead of a swapping machine
    prefix = "import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n"
    out = subprocess.run([sys.executable, "-c", prefix + script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    assert len(rows) == 3, out.stdout
    for name, outcome, dt, mb in rows:
        assert outcome == "WireError", (name, outcome)
        assert float(dt) < 1.0 and float(mb) < 200, (name, dt, mb)


def test_gamma_stream_shorter_than_one_bit_per_element_is_rejected_before_allocation():
    with pytest.raises(WireError, match="cannot hold"):
        varlen.decode(torch.zeros(100, dtype=torch.uint8), 1 << 40, 7)
    with pytest.raises(WireError, match="cannot hold"):
        varlen.decode(torch.zeros(2, dtype=torch.uint8), 17, 7)
    # exactly one bit per element (all-zero levels) is the shortest valid stream
    fields = varlen.decode(torch.full((2,), 0xFF, dtype=torch.uint8), 16, 7)
    assert torch.equal(fields, torch.full((16,), 7, dtype=torch.uint8))


def test_ps_gamma_push_claiming_2_40_elements_is_a_protocol_error():
    gamma = codecs.get("qsgd", bits=4, coding="gamma")

    def pick(seg):
        return gamma if seg.compress else NONE

    bomb = torch.frombuffer(bytearray(gamma_bomb()), dtype=torch.uint8)
    small = Layout([("w1", (8, 10)), ("b1", (8,))], torch.float32, 1, 16)
    with pytest.raises(ProtocolError, match="at most"):  # longer than the segment's packet can be
        parse_segments(bomb.numpy(), small.shards[0], pick, torch.float32, 3)
    big = Layout([("w", (100, 100))], torch.float32, 1, 16)  # room for the bomb: its header is read
    with pytest.raises(ProtocolError, match="segment 0: numel: got 1099511627776, expected 10000"):
        parse_segments(bomb.numpy(), big.shards[0], pick, torch.float32, 3)


def test_max_numel_bounds_sparse_packets_not_dense_ones():
    numel = wire.MAX_NUMEL + 1
    buf = topk_bomb(numel)
    with pytest.raises(WireError, match="max_numel"):
        wire.from_bytes(buf)
    assert wire.from_bytes(buf, max_numel=numel).numel == numel  # the caller raised the bound
    # a dense packet (1 bit per element) backs its numel with its own bytes: no cap applies
    bits = numel // 8 + 1
    sign = _header(6, 1, [4, bits], numel, 0, 0) + _pad(struct.pack("<f", 1.0)) + _pad(b"\0" * bits)
    assert wire.from_bytes(sign).numel == numel


def test_huge_numel_fields_are_wire_errors_for_every_codec():
    for codec_id in range(1, 10):  # every built-in codec (int8 = 8, int4 = 9)
        for numel in (1 << 63, (1 << 64) - 1, 1 << 40):
            buf = _header(codec_id, 1, [8, 8], numel, 1, 1) + b"\0" * 16
            with pytest.raises(WireError):
                wire.from_bytes(buf)


# ----- failure 4: validated packets decode to finite values ----------------------------------
def _with_section(packet, name, values):
    sections = dict(packet.sections)
    sections[name] = values.to(sections[name].dtype)
    return wire.to_bytes(type(packet)(packet.codec, packet.dtype, packet.numel, packet.params, packet.seed, sections))


@pytest.mark.parametrize("codec_spec, section", [("sign", "scales"), ("sign:block_size=4", "scales"),
                                                 ("qsgd", "norms"), ("qsgd:coding=gamma", "norms")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scales_beyond_the_output_dtype_are_rejected(codec_spec, section, dtype):
    codec = codecs.from_spec(codec_spec)
    packet = codec.encode(torch.randn(16).to(dtype), seed=1)
    limit = torch.finfo(dtype).max
    n = packet.sections[section].numel()
    for bad in (1e10 if dtype == torch.float16 else 3.39e38, limit * 1.0001, 3.4e38):
        buf = _with_section(packet, section, torch.full((n,), bad, dtype=torch.float64))
        with pytest.raises(WireError, match="exceeds"):
            wire.from_bytes(buf)
    # the largest scale the dtype holds is accepted, and decodes to finite values
    ok = wire.from_bytes(_with_section(packet, section, torch.full((n,), limit, dtype=torch.float64)))
    assert torch.isfinite(codec.decode(ok)).all()


def test_bf16_values_beyond_float16_are_rejected():
    codec = codecs.get("bf16")
    packet = codec.encode(torch.randn(8).half())
    for bad in (65536.0, -1e10, 3e38):
        values = torch.zeros(8, dtype=torch.float64)
        values[3] = bad
        with pytest.raises(WireError, match="exceeds"):
            wire.from_bytes(_with_section(packet, "values", values))
    ok = torch.zeros(8, dtype=torch.float64)
    ok[0] = 65280.0  # the largest bf16 value below float16's limit
    assert torch.isfinite(codec.decode(wire.from_bytes(_with_section(packet, "values", ok)))).all()
    # float32 output: the same bf16 values are fine
    packet32 = codec.encode(torch.randn(8))
    big = torch.full((8,), 3e38, dtype=torch.float64)
    assert torch.isfinite(codec.decode(wire.from_bytes(_with_section(packet32, "values", big)))).all()


def test_bf16_codec_refuses_float16_input_that_rounds_beyond_float16():
    codec = codecs.get("bf16")
    with pytest.raises(CodecError, match="fp16 codec"):
        codec.encode(torch.tensor([1.0, 65408.0], dtype=torch.float16))
    ok = codec.encode(torch.tensor([1.0, 65376.0], dtype=torch.float16))  # rounds down to 65280
    assert torch.isfinite(codec.decode(ok)).all()


SPECS = ["none", "fp16", "bf16", "topk:ratio=0.3", "randomk:ratio=0.3", "randomk:ratio=0.3,scaled=false",
         "sign", "sign:block_size=8", "qsgd", "qsgd:bits=2", "qsgd:bits=8,bucket_size=16", "qsgd:coding=gamma"]


def test_mutated_packets_either_fail_validation_or_decode_finite():
    """Random byte flips and planted extreme floats in every codec x dtype (a small fuzz)."""
    rng = np.random.default_rng(12)
    extremes = np.array([np.inf, -np.inf, np.nan, 1e10, 65504.0, 65520.0, 3.4e38, 1e300, -1e30], dtype=np.float64)
    tried = accepted = 0
    for spec in SPECS:
        codec = codecs.from_spec(spec)
        for dtype in FLOAT_DTYPE_CODES:
            packet = codec.encode((torch.randn(37) * 100).to(dtype), seed=3)
            base = wire.to_bytes(packet).numpy()
            for trial in range(40):
                buf = base.copy()
                if trial % 2:
                    for _ in range(int(rng.integers(1, 4))):
                        i = int(rng.integers(wire.HEADER_NBYTES, buf.size))
                        buf[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
                else:
                    # overwrite an aligned float of the payload with an extreme value of some width
                    width = int(rng.choice([2, 4, 8]))
                    start = wire.HEADER_NBYTES + 8 * len(packet.sections)
                    if buf.size - width <= start:
                        continue
                    i = int(rng.integers(start, buf.size - width)) // width * width
                    v = extremes[int(rng.integers(0, extremes.size))]
                    as_t = {2: np.float16, 4: np.float32, 8: np.float64}[width]
                    with np.errstate(over="ignore"):
                        buf[i : i + width] = np.frombuffer(np.array([v], dtype=as_t).tobytes(), np.uint8)
                tried += 1
                try:
                    p = wire.from_bytes(buf.tobytes())
                except WireError:
                    continue
                accepted += 1
                out = codec.decode(p)
                assert torch.isfinite(out).all(), (spec, dtype, trial)
    assert tried > 1000 and accepted > 0


# ----- failures 6 and 7: parameter-server checkpoints ----------------------------------------
def _ckpt():
    from commpress.ps import checkpoint

    return checkpoint


def _state():
    return {"x": torch.linspace(-1, 1, 6), "optimizer": {"state": {0: {"momentum_buffer": torch.ones(6)}},
            "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0]}]}, "clock": [3, 4], "fingerprint": (1 << 64) - 1}


def test_checkpoint_write_does_not_follow_a_planted_symlink(tmp_path):
    ckpt = _ckpt()
    d = tmp_path / "ck"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = ckpt.path_for(str(d), 0, 4)
    # the old code wrote through f"{path}.tmp{pid}": plant links at every name it could use
    for pid in {os.getpid(), os.getpid() + 1}:
        os.symlink(victim, f"{path}.tmp{pid}")
    os.symlink(victim, os.path.join(str(d), "meta.json.tmp%d" % os.getpid()))
    ckpt.save(str(d), 0, 4, _state())
    ckpt.write_meta(str(d), {"world": 1})
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(path) and torch.equal(ckpt.load(str(d), 0, 4)["x"], _state()["x"])
    # a symlink at the final name is replaced, never written through
    os.remove(path)
    os.symlink(victim, path)
    with pytest.raises(Exception, match="symlink|cannot read"):
        ckpt.load(str(d), 0, 4)
    ckpt.save(str(d), 0, 4, _state())
    assert victim.read_bytes() == b"precious" and not os.path.islink(path)


def test_checkpoint_files_are_private(tmp_path):
    ckpt = _ckpt()
    d = str(tmp_path / "ck")
    old = os.umask(0o022)
    try:
        path = ckpt.save(d, 0, 4, _state())
        ckpt.write_meta(d, {"world": 1})
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.join(d, "meta.json")).st_mode & 0o777 == 0o600
    assert os.stat(d).st_mode & 0o077 == 0
    assert sorted(os.listdir(d)) == ["meta.json", os.path.basename(path)]  # no temp files left


def test_checkpoint_flipped_byte_is_rejected_as_corrupt(tmp_path):
    from commpress.ps import ConfigError

    ckpt = _ckpt()
    d = str(tmp_path)
    path = ckpt.save(d, 0, 4, _state())
    data = bytearray(open(path, "rb").read())
    for i in (len(data) // 2, len(data) - 30, ckpt.HEADER_NBYTES + 3):
        bad = bytearray(data)
        bad[i] ^= 0x10
        open(path, "wb").write(bad)
        with pytest.raises(ConfigError, match="corrupt"):
            ckpt.load(d, 0, 4)
    open(path, "wb").write(data[:-100])  # a truncated write
    with pytest.raises(ConfigError, match="corrupt"):
        ckpt.load(d, 0, 4)
    open(path, "wb").write(data)
    assert ckpt.load(d, 0, 4)["clock"] == [3, 4]


@pytest.mark.parametrize("where, bad, match", [
    ("x", 3.5e37, "x holds 3.5e\\+37"),
    ("momentum", 1e30, "momentum_buffer holds 1e\\+30"),
    ("x", float("nan"), "NaN or Inf"),
    ("lr", float("inf"), "lr = inf"),
    ("step", 2**70, "64-bit"),
])
def test_checkpoint_implausible_values_are_rejected(tmp_path, where, bad, match):
    from commpress.ps import ConfigError

    ckpt = _ckpt()
    state = _state()
    if where == "x":
        state["x"][2] = bad
    elif where == "momentum":
        state["optimizer"]["state"][0]["momentum_buffer"][0] = bad
    elif where == "lr":
        state["optimizer"]["param_groups"][0]["lr"] = bad
    else:
        state["clock"][1] = bad
    # the digest is valid (a careful liar, or a run that diverged): the values are still checked
    ckpt.save(str(tmp_path), 0, 4, state)
    with pytest.raises(ConfigError, match=match):
        ckpt.load(str(tmp_path), 0, 4)


def test_checkpoint_shapes_are_checked_against_the_callers_state(tmp_path):
    from commpress.ps import ConfigError

    ckpt = _ckpt()
    ckpt.save(str(tmp_path), 0, 4, _state())
    assert ckpt.load(str(tmp_path), 0, 4, like=_state())["clock"] == [3, 4]
    bigger = {**_state(), "x": torch.zeros(7)}
    with pytest.raises(ConfigError, match=r"x is torch.float32 \(6,\), expected torch.float32 \(7,\)"):
        ckpt.load(str(tmp_path), 0, 4, like=bigger)
    with pytest.raises(ConfigError, match="replica is missing"):
        ckpt.load(str(tmp_path), 0, 4, like={**_state(), "replica": torch.zeros(6)})
    with pytest.raises(ConfigError, match="float64"):
        ckpt.load(str(tmp_path), 0, 4, like={**_state(), "x": torch.zeros(6, dtype=torch.float64)})


# ----- failure 6: the CRC is not optional ----------------------------------------------------
def test_a_sender_clearing_the_crc_flag_is_rejected():
    from commpress.ps.protocol import FLAG_CRC, TO_SERVER, MsgType, build, parse_header

    msg = build(MsgType.PUSH, shard=0, worker=0, step=1, parts=[b"12345678"], checksum=False)
    buf = msg.numpy().copy()
    assert not parse_header(buf, 2, TO_SERVER, require_crc=False).flags & FLAG_CRC  # device-buffer senders
    with pytest.raises(ProtocolError, match="CRC flag is cleared"):
        parse_header(buf, 2, TO_SERVER)
    good = build(MsgType.PUSH, shard=0, worker=0, step=1, parts=[b"12345678"]).numpy().copy()
    assert parse_header(good, 2, TO_SERVER).flags & FLAG_CRC
    good[6] = int(good[6]) & ~FLAG_CRC & 0xFF  # a liar clears the flag but keeps the payload
    with pytest.raises(ProtocolError, match="CRC"):
        parse_header(good, 2, TO_SERVER)
