#!/usr/bin/env python
"""Re-run the red-team pass of issue #12 against the current code and print a markdown table.

Every case of the issue's "Why" (failures 1-8 and the cheap "held" items) is reproduced as the
issue describes it, through the public APIs, ``mpirun ... python -m commpress.ps`` or a rank
script run under ``mpirun`` (``--rank``), and a 2-rank gloo DDP job for case 8. Each row runs
in its own subprocess with a timeout, so a segfault or a hang is reported as such (``CRASH``,
``HANG``) instead of ending this script. Columns: what the issue saw on the old main; the
outcome now (exception type and the first words of its message, exit code, or result); the
time (the measured operation where the case has one, else the subprocess's wall time); the
peak RSS growth where memory is the question (``ru_maxrss`` after minus before, in a fresh
process, so it is the operation's high-water mark).

    python scripts/redteam.py              # every case (about 5 min on 2 busy cores)
    python scripts/redteam.py --only 3     # case 3's rows; also a row id (6b) or "held"
    python scripts/redteam.py --list       # the row ids

Needs the dev requirements (pytest: the regression tests' helpers are imported from tests/)
and ``mpirun`` in the venv for the parameter-server rows (without it they say so).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
for _p in (TESTS, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ENV = {
    **os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
RESULT = "REDTEAM-RESULT "  # a child's last stdout line: its result as JSON
RANK_OUT = "REDTEAM-RANK "  # a rank script's report line (rank 0, and every rank's RSS)
AS_LIMIT = 8 << 30  # address-space cap of the memory-bomb children: a regression fails, never swaps
PS_STEPS = 20
DDP_CAP_S = 60.0  # case 8: how long after the corruption the other ranks get to report an error
DDP_PG_TIMEOUT_S = 120.0


# ----- small helpers -------------------------------------------------------------------------
def words(text: str, n: int = 110) -> str:
    """``text`` on one line, cut to about ``n`` characters."""
    one = " ".join(str(text).split())
    return one if len(one) <= n else one[: n - 1].rstrip() + "…"


def describe(exc: BaseException, n: int = 110) -> str:
    """Exception type and the first words of its message."""
    return words(f"{type(exc).__name__}: {exc}", n)


def maxrss_mb() -> float:
    """This process's peak resident set size so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cap_address_space() -> None:
    """Cap this child's address space (a regression then raises MemoryError instead of swapping)."""
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def scratch(prefix: str) -> str:
    """A temporary directory removed when this (child) process exits."""
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, True)
    return d


def measured(fn: Callable[[], str]) -> dict[str, Any]:
    """Run ``fn`` once: its result (or the exception it raised), seconds and peak RSS growth."""
    r0, t0 = maxrss_mb(), time.perf_counter()
    try:
        outcome = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is whatever it raised
        outcome = describe(exc)
    return {"outcome": outcome, "seconds": time.perf_counter() - t0, "rss_mb": maxrss_mb() - r0}


def attempt(fn: Callable[[], str]) -> str:
    """``fn()``'s result, or the exception it raised."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return describe(exc, 90)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_cmd(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str, float]:
    """Run ``cmd`` in its own session; (returncode or None on timeout, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    with subprocess.Popen(cmd, env=env or ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
            rc: int | None = p.returncode
        except subprocess.TimeoutExpired:
            _kill_group(p)
            out, err = p.communicate()
            rc = None
    return rc, out, err, time.monotonic() - t0


def mpirun(n: int, args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str, float]:
    """``mpirun -n n --oversubscribe python ARGS`` with a hard timeout (every rank killed on expiry)."""
    if not os.path.exists(MPIRUN):
        raise RuntimeError(f"no mpirun next to {sys.executable}: parameter-server rows need it")
    return run_cmd([MPIRUN, "-n", str(n), "--oversubscribe", sys.executable, *args], timeout, env)


def rank_reports(out: str) -> list[dict[str, Any]]:
    """The report lines a rank script printed."""
    return [json.loads(line[len(RANK_OUT):]) for line in out.splitlines() if line.startswith(RANK_OUT)]


def ps_error(err: str) -> str:
    """The line of a parameter-server job's stderr that says why it stopped (or '')."""
    found = re.findall(r"\[commpress\.ps rank \d+\] error: .*", err)
    if found:
        return words(found[0], 150)
    sig = re.search(r"exited on signal (\d+) \(([^)]+)\)", err)
    if sig:
        return f"CRASH: a rank died on signal {sig.group(1)} ({sig.group(2)})"
    tail = [ln for ln in err.splitlines() if re.match(r"^\w*(Error|Exception)\b", ln)]
    return words(tail[-1], 150) if tail else ""


def rejections(err: str) -> list[str]:
    """The servers' 'rejected a message' / implausible-push lines, shortened."""
    lines = re.findall(r"rejected a message from rank \d+: .*|rank \d+\b.*\bimplausible.*|PUSH at step \d+: norm .*", err)
    return [words(ln, 120) for ln in lines]


def ps_summary(rc: int | None, secs: float, out: str, err: str, timeout: float) -> str:
    """One line for a ``python -m commpress.ps --json`` job."""
    if rc is None:
        return f"HANG: no exit within {timeout:.0f} s"
    head = f"exit {rc}"
    if rc == 0:
        try:
            rep = json.loads(out.strip().splitlines()[-1])
            acc = rep["metrics"].get("test_accuracy")
            head += (f", {rep['steps']} steps, accuracy {acc:.1f}%, rejected {rep['rejected']}, "
                     f"skipped pushes {rep['skipped_pushes']}")
        except (ValueError, KeyError, IndexError):
            head += ", no summary"
    why = ps_error(err)
    return head + (f": {why}" if why and rc != 0 else "")


# ----- case 1: block sizes near 2**63, p0 >= 2**63 -------------------------------------------
def case_1a() -> dict[str, Any]:
    import torch

    from commpress import codecs

    x = torch.randn(1000)

    def go(bs: int) -> str:
        codec = codecs.get("sign", block_size=bs)
        out = codec.decode(codec.encode(x))
        return "encode+decode ok, finite" if bool(torch.isfinite(out).all()) else "decode NOT finite"

    sizes = (("2**63-1", 2**63 - 1), ("2**63-2", 2**63 - 2), ("2**62+1", 2**62 + 1), ("2**63", 2**63))
    return measured(lambda: "; ".join(f"{label}: {attempt(lambda: go(bs))}" for label, bs in sizes))


def ps_case(*options: str) -> dict[str, Any]:
    """A 3-process parameter-server run with ``options`` added; its outcome as a row."""
    args = ["-m", "commpress.ps", "--steps", str(PS_STEPS), "--no-progress", "--json", "--timeout", "10", *options]
    rc, out, err, secs = mpirun(3, args, 150)
    return {"outcome": ps_summary(rc, secs, out, err, 150), "seconds": None}


def case_1b() -> dict[str, Any]:
    return ps_case("--codec", "sign:block_size=9223372036854775807")


def case_1c() -> dict[str, Any]:
    import torch
    from test_hostile import SPECS

    from commpress import codecs, wire
    from commpress.errors import WireError

    counts: dict[str, int] = {}
    first_other = ""

    def run() -> str:
        nonlocal first_other
        for spec in SPECS:
            codec = codecs.from_spec(spec)
            base = bytearray(wire.to_bytes(codec.encode(torch.randn(64), seed=1)).numpy().tobytes())
            for p0 in (2**63, 2**63 + 1, 2**64 - 1):
                buf = bytearray(base)
                buf[24:32] = p0.to_bytes(8, "little")  # header field p0 (after magic..numel, seed)
                try:
                    codec.decode(wire.from_bytes(bytes(buf)))
                    key = "accepted"
                except WireError:
                    key = "WireError"
                except Exception as exc:  # noqa: BLE001 - counted: the finding
                    key = type(exc).__name__
                    first_other = first_other or describe(exc, 80)
                counts[key] = counts.get(key, 0) + 1
        total = sum(counts.values())
        text = f"{total} packets ({len(SPECS)} codec specs x p0 in 2**63, 2**63+1, 2**64-1): " + ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items()))
        return text + (f" (first: {first_other})" if first_other else "")

    return measured(run)


# ----- case 2: NaN loss, negative batch size -------------------------------------------------
def case_2a() -> dict[str, Any]:
    rc, out, err, secs = mpirun(3, [__file__, "--rank", "nanloss"], 150)
    return {"outcome": rank_summary(rc, out, err, 150), "seconds": None}


def case_2b() -> dict[str, Any]:
    return ps_case("--batch-size", "-5")


# ----- case 3: memory bombs ------------------------------------------------------------------
def case_3a() -> dict[str, Any]:
    """The gamma bomb wrapped in a PUSH, handled by a server's state machine (as ``serve`` would)."""
    cap_address_space()
    from test_hostile import gamma_bomb
    from test_ps_server import Cluster

    from commpress.ps import ProtocolError, PSConfig
    from commpress.ps.protocol import MsgType, build

    cfg = PSConfig(servers=1, steps=4, seed=0, progress=False, codec="qsgd:bits=4,coding=gamma")
    cfg.validate()
    c = Cluster(cfg)
    c.start()
    msg = build(MsgType.PUSH, shard=0, worker=0, step=0, parts=[gamma_bomb()]).numpy()

    def go() -> str:
        try:
            c.servers[0].handle(c.S, msg)
        except ProtocolError as exc:  # serve() logs, counts and goes on
            return f"{len(msg)}-byte PUSH: {describe(exc, 100)} (server rejects it, keeps serving)"
        return f"{len(msg)}-byte PUSH accepted"

    return measured(go)


def _wire_bomb(name: str) -> dict[str, Any]:
    cap_address_space()
    import torch
    from test_hostile import BOMBS

    from commpress import codecs, wire

    codec = {"topk": codecs.get("topk", k=1), "randomk": codecs.get("randomk", k=1, scaled=False)}[name]
    buf = BOMBS[name]()

    def go() -> str:
        out = codec.decode(wire.from_bytes(buf))
        return f"{len(buf)}-byte packet accepted: decoded {out.numel()} elements ({out.numel() * 4 / 1e9:.2f} GB)" + (
            "" if bool(torch.isfinite(out).all()) else ", not finite")

    res = measured(go)
    res["outcome"] = f"{len(buf)} bytes: {res['outcome']}" if not res["outcome"].startswith(f"{len(buf)}") else res["outcome"]
    return res


def case_3b() -> dict[str, Any]:
    return _wire_bomb("topk")


def case_3c() -> dict[str, Any]:
    return _wire_bomb("randomk")


# ----- case 4: mutated packets ---------------------------------------------------------------
def case_4() -> dict[str, Any]:
    """25,000 mutations of real packets (every codec spec x dtype): bit flips anywhere, extreme
    floats planted in the payload, extreme integers planted in the header's u64 fields."""
    cap_address_space()
    import numpy as np
    import torch
    from test_hostile import SPECS

    from commpress import codecs, wire
    from commpress.errors import CodecError, WireError
    from commpress.wire.packet import FLOAT_DTYPE_CODES

    total = 25_000
    rng = np.random.default_rng(12)
    extremes = np.array([np.inf, -np.inf, np.nan, 1e10, 65504.0, 65520.0, 3.4e38, 1e300, -1e30], dtype=np.float64)
    ints = [2**63, 2**63 + 1, 2**64 - 1, 2**40, 2**32, 2**31, 0, 1]
    g = torch.Generator().manual_seed(12)
    bases = []
    for spec in SPECS:
        codec = codecs.from_spec(spec)
        for dtype in FLOAT_DTYPE_CODES:
            for n in (37, 200):
                packet = codec.encode((torch.randn(n, generator=g) * 100).to(dtype), seed=3)
                bases.append((wire.to_bytes(packet).numpy().copy(), len(packet.sections)))
    counts = {"rejected (WireError)": 0, "decoded finite": 0, "decoded NOT finite": 0}
    others: dict[str, int] = {}
    first_other = ""
    slowest, slowest_spec = 0.0, [""]

    def codec_for(packet: Any) -> Any:  # as scripts/fuzz_wire.py: decode reads its parameters from the packet
        extra = {"k": max(packet.params[0], 1)} if packet.codec in ("topk", "randomk") else {}
        return codecs.get(packet.codec, **extra)

    for base, _ in bases:  # warm-up: first calls compile (numba's gamma coder) and load kernels
        packet = wire.from_bytes(base.tobytes())
        codec_for(packet).decode(packet)

    def run() -> str:
        nonlocal first_other, slowest
        for i in range(total):
            base, nsec = bases[i % len(bases)]
            buf = base.copy()
            mode = i % 3
            if mode == 0:
                for _ in range(int(rng.integers(1, 4))):
                    j = int(rng.integers(0, buf.size))
                    buf[j] ^= np.uint8(1 << int(rng.integers(0, 8)))
            elif mode == 1:
                width = int(rng.choice([2, 4, 8]))
                start = wire.HEADER_NBYTES + 8 * nsec
                if buf.size - width > start:
                    j = int(rng.integers(start, buf.size - width)) // width * width
                    as_t = {2: np.float16, 4: np.float32, 8: np.float64}[width]
                    with np.errstate(over="ignore"):
                        buf[j : j + width] = np.frombuffer(np.array([extremes[int(rng.integers(0, extremes.size))]],
                                                                    dtype=as_t).tobytes(), np.uint8)
            else:  # numel, seed, p0, p1 or a section length
                j = 8 * int(rng.integers(1, 5 + nsec))
                v = ints[int(rng.integers(0, len(ints)))] if rng.random() < 0.7 else int(rng.integers(0, 2**63))
                buf[j : j + 8] = np.frombuffer(v.to_bytes(8, "little"), np.uint8)
            t0 = time.perf_counter()
            try:
                packet = wire.from_bytes(buf.tobytes())
                out = codec_for(packet).decode(packet)
                key = "decoded finite" if bool(torch.isfinite(out).all()) else "decoded NOT finite"
            except WireError:
                key = "rejected (WireError)"
            except Exception as exc:  # noqa: BLE001 - counted: the finding
                name = type(exc).__name__ + (" (a CodecError)" if isinstance(exc, CodecError) else "")
                others[name] = others.get(name, 0) + 1
                first_other = first_other or describe(exc, 80)
                key = ""
            dt = time.perf_counter() - t0
            if dt > slowest:
                slowest, slowest_spec[0] = dt, f"{SPECS[(i % len(bases)) // (2 * len(FLOAT_DTYPE_CODES))]}"
            if key:
                counts[key] += 1
        text = f"{total} mutated: " + ", ".join(f"{k} {v}" for k, v in counts.items())
        text += "; other exceptions: " + (", ".join(f"{k} {v}" for k, v in sorted(others.items())) or "none")
        if first_other:
            text += f" (first: {first_other})"
        return text + f"; slowest input {slowest * 1e3:.1f} ms ({slowest_spec[0]})"

    return measured(run)


# ----- case 5: one message must not stop the server ------------------------------------------
def case_5a() -> dict[str, Any]:
    rc, out, err, secs = mpirun(3, [__file__, "--rank", "badfp"], 150)
    return {"outcome": rank_summary(rc, out, err, 150), "seconds": None}


def case_5b() -> dict[str, Any]:
    rc, out, err, secs = mpirun(3, [__file__, "--rank", "bye0"], 150)
    return {"outcome": rank_summary(rc, out, err, 150), "seconds": None}


# ----- case 6: integrity ---------------------------------------------------------------------
def case_6a() -> dict[str, Any]:
    """An honest push whose sender cleared the CRC flag (and zeroed the CRC field), to a server."""
    from test_ps_server import Cluster

    from commpress.ps import ProtocolError, PSConfig
    from commpress.ps.protocol import FLAG_CRC

    cfg = PSConfig(servers=1, steps=4, seed=0, progress=False, codec="topk:ratio=0.1")
    cfg.validate()
    c = Cluster(cfg)
    c.start()
    node = c.nodes[0]
    loss, grad = node.compute(c.task.loss, c.task.batch(0, 2, 0))
    msg = node.push(0, grad, loss)[0][1].numpy().copy()
    msg[6] = int(msg[6]) & ~FLAG_CRC & 0xFF
    msg[28:32] = 0  # the crc32 field

    def go() -> str:
        try:
            c.servers[0].handle(c.S, msg)
        except ProtocolError as exc:
            return describe(exc, 110)
        return "accepted (trusted without a CRC)"

    return measured(go)


def case_6b() -> dict[str, Any]:
    rc, out, err, secs = mpirun(3, [__file__, "--rank", "flip"], 200)
    reps = [r for r in rank_reports(out) if "metrics" in r]
    base = next((r for r in reps if r.get("run") == "clean"), None)
    bad = next((r for r in reps if r.get("run") == "tampered"), None)
    def acc(r: dict[str, Any] | None) -> str:
        return f"{r['metrics']['test_accuracy']:.1f}%" if r else "n/a"

    if rc is None:
        text = f"HANG: no exit within 200 s (clean run: {acc(base)})"
    elif bad is None:
        text = f"exit {rc}, clean {acc(base)}, tampered run did not finish: {ps_error(err) or 'no error line'}"
    else:
        text = (f"exit {rc}: accuracy {acc(base)} -> {acc(bad)}, max |param| {(base or {}).get('max_abs', 0):.3g} -> "
                f"{bad.get('max_abs', 0):.3g}; rejected {bad['rejected']}, "
                f"implausible {bad['implausible'] if bad['implausible'] is not None else '(no such counter)'}, "
                f"skipped pushes {bad['skipped']}")
    lines = rejections(err)
    if lines:
        text += f"; server: '{lines[0]}'"
    return {"outcome": text, "seconds": None}


def _shard_state() -> dict[str, Any]:
    """test_hostile's server state with a shard of six values, one of them 0.6 (exponent bit 30 clear)."""
    import torch
    from test_hostile import _state

    return {**_state(), "x": torch.tensor([-1.0, -0.6, -0.2, 0.2, 0.6, 1.0])}


def case_6c() -> dict[str, Any]:
    """A PS checkpoint with one byte flipped inside a stored float (0.6 -> 2e38)."""
    import numpy as np

    from commpress.ps import checkpoint as ckpt

    d = scratch("redteam6c.")
    path = ckpt.save(d, 0, 4, _shard_state())
    data = bytearray(open(path, "rb").read())
    pattern = np.float32(0.6).tobytes()
    at = bytes(data).find(pattern)
    if at < 0:
        return {"outcome": "harness: the stored 0.6 was not found in the file", "seconds": None}
    data[at + 3] ^= 0x40  # exponent bit 30: 0.6 -> about 2.0e38
    with open(path, "wb") as f:
        f.write(data)

    def go() -> str:
        x = ckpt.load(d, 0, 4)["x"]
        return f"loaded silently: x max {float(x.abs().max()):.3g}"

    return measured(go)


def case_6d() -> dict[str, Any]:
    """A worker's PS checkpoint (valid digest) with its error-feedback residuals set to 1e30."""
    import torch
    from test_ps_server import Cluster

    from commpress.ps import PSConfig
    from commpress.ps import checkpoint as ckpt

    cfg = PSConfig(servers=1, steps=4, seed=0, progress=False, codec="topk:ratio=0.1")
    cfg.validate()
    c = Cluster(cfg)
    c.start()
    c.sync_step(0)
    node = c.nodes[0]
    state = node.state_dict()
    state["ef"]["residuals"] = {k: torch.full_like(v, 1e30) for k, v in state["ef"]["residuals"].items()}
    d = scratch("redteam6d.")
    ckpt.save(d, c.S, 1, state)

    def go() -> str:
        node.load_state_dict(ckpt.load(d, c.S, 1, like=node.state_dict()))
        res = max(float(node.ef.residual(k).abs().max()) for k in node.ef.keys())
        return f"accepted: residual max {res:.3g}"

    return measured(go)


def case_6e() -> dict[str, Any]:
    """DDP ``CompressionState.load_state_dict`` on one gloo rank: residual 1e30, step 2**70, codec 'topk' / 7."""
    import datetime

    import torch
    import torch.distributed as dist

    import commpress.ddp

    from ddp_workers import free_port, make_ddp, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    ddp = make_ddp()
    state = commpress.ddp.register(ddp, "topk", ratio=0.01)
    train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), 0, 0)
    good = state.state_dict()
    huge = {**good["feedback"], "residuals": {k: torch.full_like(v, 1e30) for k, v in good["feedback"]["residuals"].items()}}

    def go(field: str, value: Any) -> str:
        state.load_state_dict({**good, field: value})
        return "accepted"

    bad = (("residual 1e30", "feedback", huge), ("step 2**70", "step", 2**70), ("codec 'topk'", "codec", "topk"),
           ("codec 7", "codec", 7))
    return measured(lambda: "; ".join(f"{label}: {attempt(lambda: go(field, value))}" for label, field, value in bad))


# ----- case 7: checkpoint files --------------------------------------------------------------
def case_7a() -> dict[str, Any]:
    """Symlinks planted at every temp name the old code used (``<file>.tmp<pid>``), then a save."""
    from test_hostile import _state

    from commpress.ps import checkpoint as ckpt

    d = scratch("redteam7a.")
    ck = os.path.join(d, "ck")
    os.mkdir(ck)
    victim = os.path.join(d, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    path = ckpt.path_for(ck, 0, 4)
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        os.symlink(victim, f"{path}.tmp{pid}")
        os.symlink(victim, os.path.join(ck, f"meta.json.tmp{pid}"))

    def go() -> str:
        ckpt.save(ck, 0, 4, _state())
        ckpt.write_meta(ck, {"world": 1})
        with open(victim, "rb") as f:
            intact = f.read() == b"precious"
        return ("victim intact, checkpoint written" if intact else "victim OVERWRITTEN through the planted symlink") + (
            "" if not os.path.islink(path) else "; the checkpoint is a symlink")

    return measured(go)


def case_7b() -> dict[str, Any]:
    from test_hostile import _state

    from commpress.ps import checkpoint as ckpt

    d = os.path.join(scratch("redteam7b."), "ck")
    old = os.umask(0o022)
    try:
        def go() -> str:
            path = ckpt.save(d, 0, 4, _state())
            ckpt.write_meta(d, {"world": 1})
            modes = [os.stat(p).st_mode & 0o777 for p in (path, os.path.join(d, "meta.json"), d)]
            left = sorted(set(os.listdir(d)) - {"meta.json", os.path.basename(path)})
            return (f"umask 022: checkpoint {modes[0]:o}, meta.json {modes[1]:o}, directory {modes[2]:o}"
                    + (f"; temp files left: {left}" if left else ""))
        return measured(go)
    finally:
        os.umask(old)


# ----- case 8: a DDP rank that receives corrupt bytes ----------------------------------------
def _ddp_rank(rank: int, world: int, port: int, out: str, victim: int, linger_s: float) -> None:
    """One gloo rank: top-k (all-gather), rank ``victim`` sees a peer's frame zeroed at step 3 of 10."""
    import datetime

    import torch
    import torch.distributed as dist

    import commpress.ddp
    from commpress.wire.frame import FrameLayout

    from ddp_workers import make_ddp, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DDP_PG_TIMEOUT_S))
    armed, corrupted_at = [False], [0.0]
    original = FrameLayout.unpack

    def unpack(self: Any, buf: Any, source: int | None = None, **kw: Any) -> Any:
        if armed[0] and source is not None and source != rank:
            armed[0] = False
            corrupted_at[0] = time.time()
            buf = torch.zeros_like(buf)  # corrupted on the way to this rank only
        return original(self, buf, source, **kw)

    if rank == victim:
        FrameLayout.unpack = unpack  # type: ignore[method-assign]
    ddp = make_ddp()
    commpress.ddp.register(ddp, "topk", ratio=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    error = ""
    try:
        for step in range(10):
            armed[0] = armed[0] or (rank == victim and step == 3)
            train_step(ddp, opt, rank, step)
    except Exception as exc:  # noqa: BLE001 - reported
        error = describe(exc, 140)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "at": time.time(), "corrupted_at": corrupted_at[0]}, f)
    if error:
        time.sleep(linger_s)  # alive and silent: its connections stay open (no exit to break the peers)
    os._exit(0)


def case_8() -> dict[str, Any]:
    import torch.multiprocessing as mp

    from ddp_workers import free_port

    world, victim = 2, 1
    out = scratch("redteam8.")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, out, victim, DDP_CAP_S + 30)) for r in range(world)]
    for p in procs:
        p.start()
    start = time.time()
    reports: dict[int, dict[str, Any]] = {}
    deadline = start + 120.0  # start-up and the first three steps
    while time.time() < deadline:
        for r in range(world):
            f = os.path.join(out, f"rank{r}.json")
            if r not in reports and os.path.exists(f):
                try:
                    with open(f) as fh:
                        reports[r] = json.load(fh)
                except ValueError:
                    continue
        if len(reports) == world:
            break
        t_bad = reports.get(victim, {}).get("corrupted_at") or 0.0
        if t_bad:
            deadline = min(deadline, t_bad + DDP_CAP_S)
        if not any(p.is_alive() for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    t_bad = reports.get(victim, {}).get("corrupted_at") or 0.0
    if not t_bad:
        return {"outcome": f"harness: rank {victim} never decoded a corrupted frame; reports {reports}", "seconds": None}
    parts, worst = [], 0.0
    for r in range(world):
        rep = reports.get(r)
        if rep is None or not rep["error"]:
            parts.append(f"rank {r}: no error within {DDP_CAP_S:.0f} s (cap; process-group timeout "
                         f"{DDP_PG_TIMEOUT_S:.0f} s)" if rep is None else f"rank {r}: finished without an error")
            worst = float("inf")
        else:
            dt = rep["at"] - t_bad
            worst = max(worst, dt)
            parts.append(f"rank {r} after {dt:.2f} s: {words(rep['error'], 120)}")
    summary = ("every rank has an error" if worst != float("inf") else "NOT every rank has an error") + ": " + "; ".join(parts)
    return {"outcome": summary, "seconds": worst if worst != float("inf") else None,
            "time_text": f"> {DDP_CAP_S:.0f} s (cap)" if worst == float("inf") else None}


# ----- held items ----------------------------------------------------------------------------
def case_h1() -> dict[str, Any]:
    rc, out, err, secs = mpirun(4, [__file__, "--rank", "hostile"], 240)
    reps = rank_reports(out)
    clean = next((r for r in reps if r.get("run") == "clean" and "metrics" in r), None)
    bad = next((r for r in reps if r.get("run") == "hostile" and "metrics" in r), None)
    if rc is None:
        return {"outcome": "HANG: no exit within 240 s", "seconds": None}
    if clean is None or bad is None:
        return {"outcome": f"exit {rc}: {ps_error(err) or 'no report'}", "seconds": None}
    # ru_maxrss is a high-water mark: the hostile run's minus the clean run's is what the hostile messages added
    servers = {(r["run"], r["rank"]): r["maxrss_mb"] for r in reps if r.get("role") == "server"}
    ranks = sorted({rank for _, rank in servers})
    growth = max((servers.get(("hostile", k), 0.0) - servers.get(("clean", k), 0.0) for k in ranks), default=None)

    same = "bit-identical to the clean run" if bad["digest"] == clean["digest"] else (
        f"DIFFERENT from the clean run (max |diff| {bad['max_diff_vs']:.3g})")
    text = (f"exit {rc}: {bad['rejected']} invalid messages rejected over {bad['steps']} steps; final parameters "
            f"{same}; server peak RSS " + ", ".join(f"rank {k} {servers.get(('hostile', k), 0):.0f} MB" for k in ranks)
            + " (after the clean run: " + ", ".join(f"{servers.get(('clean', k), 0):.0f} MB" for k in ranks) + ")")
    return {"outcome": text, "seconds": None, "rss_mb": growth}


def case_h2() -> dict[str, Any]:
    fd, killfile = tempfile.mkstemp(prefix="redteam-kill.")  # the killed worker writes its time here
    os.close(fd)
    env = {**ENV, "REDTEAM_KILLFILE": killfile}
    rc, out, err, secs = mpirun(3, [__file__, "--rank", "kill9"], 150, env=env)
    end = time.time()
    if rc is None:
        return {"outcome": "HANG: the job did not end within 150 s of its start", "seconds": None}
    try:
        with open(killfile) as f:
            killed_at = float(f.read())
    except (OSError, ValueError):
        return {"outcome": f"exit {rc}, the worker was never killed: {ps_error(err) or 'no error line'}", "seconds": None}
    finally:
        if os.path.exists(killfile):
            os.remove(killfile)
    why = "mpirun: a rank exited on signal 9" if re.search(r"signal 9|Killed", err) else (ps_error(err) or "")
    return {"outcome": f"exit {rc} {end - killed_at:.2f} s after the kill" + (f" ({why})" if why else ""),
            "seconds": end - killed_at}


# ----- rank scripts (run under mpirun with --rank NAME) -------------------------------------
def rank_summary(rc: int | None, out: str, err: str, timeout: float) -> str:
    """One line for a rank-script job: exit code, rank 0's report, the first rejection."""
    if rc is None:
        return f"HANG: no exit within {timeout:.0f} s"
    reps = [r for r in rank_reports(out) if "metrics" in r]
    text = f"exit {rc}"
    if reps:
        r = reps[-1]
        text += (f", {r['steps']} steps, accuracy {r['metrics'].get('test_accuracy', float('nan')):.1f}%, "
                 f"rejected {r['rejected']}, skipped pushes {r['skipped']}")
    elif ps_error(err):
        text += f": {ps_error(err)}"
    lines = rejections(err)
    if lines:
        text += f"; server: '{lines[0]}'"
    return text


def _custom_faults() -> None:
    """Teach the worker's fault hook the red team's own acts (kinds only this script uses)."""
    import numpy as np

    from commpress import wire
    from commpress.ps import faults
    from commpress.ps.protocol import HEADER_NBYTES, MsgType, build

    original = faults.before_push

    def before_push(fault: Any, step: int, pushes: Any, send: Callable[[int, np.ndarray], None]) -> None:
        if fault.kind == "rt-flip":  # one pushed value's exponent bit flipped, CRC recomputed: a careful liar
            buf = pushes[0][1].numpy()  # shard 0's message, in place: this is what gets sent
            at = HEADER_NBYTES + wire.HEADER_NBYTES + 8  # codec none: segment 0's one section, float32
            n = int.from_bytes(buf[at - 8 : at].tobytes(), "little") // 4
            values = buf[at : at + 4 * n].view(np.float32)
            # the most negative gradient value (many are exactly 0); after the flip of exponent bit
            # 30 it is about -1e37, so SGD drives that weight to about +1e36 and its unit dominates
            i = int(values.argmin())
            buf[at + 4 * i + 3] ^= 0x40
            buf[:] = faults._reheader(buf)
        elif fault.kind == "rt-bye0":  # a BYE at step 0 to every server, then the honest push
            for dest, _msg in pushes:
                send(dest, build(MsgType.BYE, shard=dest, worker=fault.worker, step=0).numpy())
        elif fault.kind == "rt-kill9":
            with open(os.environ["REDTEAM_KILLFILE"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            original(fault, step, pushes, send)

    faults.before_push = before_push


def rank_main(name: str) -> int:
    """A rank of a parameter-server job set up as case ``name`` describes; reports as JSON lines."""
    import dataclasses

    import torch
    from mpi4py import MPI

    from commpress.ps import Fault, PSConfig, finish, parse_fault, run
    from commpress.ps.demos import digits_task
    from commpress.ps.sharding import fingerprint
    from commpress.ps.worker import WorkerNode

    torch.set_num_threads(1)
    _custom_faults()
    rank = MPI.COMM_WORLD.Get_rank()
    task = digits_task()
    base: dict[str, Any] = dict(servers=1, steps=PS_STEPS, progress=False, timeout=10.0, codec="none")

    def conf(**changes: Any) -> PSConfig:
        return PSConfig(**{**base, **changes})

    runs: list[tuple[str, Any, PSConfig]] = []
    if name == "nanloss":  # worker 0's batch at step 3 is NaN: its loss and gradient are NaN
        def batch(worker: int, workers: int, step: int, inner: Any = task.batch) -> Any:
            x, y = inner(worker, workers, step)
            return (x * float("nan"), y) if (worker, step) == (0, 3) else (x, y)
        runs.append(("nanloss", dataclasses.replace(task, batch=batch), conf(codec="topk:ratio=0.1")))
    elif name == "badfp":  # worker 1's first PULL carries another fingerprint, then it joins honestly
        original_pull = WorkerNode.pull

        def pull(self: Any, step: int) -> Any:
            msgs = original_pull(self, step)
            if self.worker == 1 and step == 0 and not getattr(self, "_rt_sent", False):
                self._rt_sent = True
                bad = fingerprint("another model", "another config", 2).to_bytes(8, "little")
                from commpress.ps.protocol import MsgType, build
                msgs = [(d, build(MsgType.PULL, shard=d, worker=1, step=0, parts=[bad])) for d, _ in msgs] + msgs
            return msgs
        WorkerNode.pull = pull  # type: ignore[method-assign]
        runs.append(("badfp", task, conf(mode="async")))
    elif name == "bye0":
        runs.append(("bye0", task, conf(faults=(Fault("rt-bye0", 1, 0),))))
    elif name == "flip":  # a clean run, then the same with worker 0's step-5 push tampered
        runs.append(("clean", task, conf(steps=40)))
        runs.append(("tampered", task, conf(steps=40, faults=(Fault("rt-flip", 0, 5),))))
    elif name == "hostile":  # every message fault, from both workers, at every step
        kinds = ("corrupt", "truncate", "wrongshard", "spoof", "badwire", "garbage", "oversize")
        runs.append(("clean", task, conf(servers=2, steps=30)))
        runs.append(("hostile", task, conf(servers=2, steps=30, faults=tuple(
            parse_fault(f"{k}:worker={w}") for k in kinds for w in (0, 1)))))
    elif name == "kill9":
        runs.append(("kill9", task, conf(faults=(Fault("rt-kill9", 0, 5),))))
    else:
        raise SystemExit(f"unknown rank script {name!r}")
    ref = None
    for label, t, config in runs:
        result = run(t, config)
        info: dict[str, Any] = {"run": label, "rank": rank, "role": result.role, "maxrss_mb": maxrss_mb()}
        if rank == 0:
            per = result.stats.get("per_server", [])
            implausible = [sum(s["implausible"].values()) for s in per if "implausible" in s]
            info.update(
                metrics=result.metrics, steps=result.steps_done, rejected=result.stats.get("rejected"),
                implausible=sum(implausible) if implausible else None, skipped=result.stats.get("skipped_pushes"),
            )
            if result.params is not None:
                info["digest"] = hashlib.sha256(result.params.numpy().tobytes()).hexdigest()
                info["max_abs"] = float(result.params.abs().max())
                if ref is not None:
                    info["max_diff_vs"] = float((result.params - ref).abs().max())
                ref = result.params.clone()
        print(RANK_OUT + json.dumps(info), flush=True)
        finish(result)
    return 0


# ----- the table -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One row of the table: what is tried, what the issue saw, the child that tries it."""

    id: str
    case: str
    saw: str
    fn: Callable[[], dict[str, Any]]
    timeout: float
    rss: bool = False


ROWS: list[Row] = [
    Row("1a", "`sign` block_size near 2**63, codec API (encode+decode 1000 floats)",
        "segfault in `_C` (block count overflow, `scales[0]` of an empty tensor)", case_1a, 60),
    Row("1b", "`--codec sign:block_size=9223372036854775807` on the PS (mpirun -n 3)", "segfault", case_1b, 170),
    Row("1c", "wire packet with p0 >= 2**63, `wire.from_bytes` + decode", "torch type error instead of `WireError`",
        case_1c, 60),
    Row("2a", "sync PS run, worker 0's loss NaN at step 3 (topk:ratio=0.1, mpirun -n 3)",
        "skip push carried the NaN loss, rejected; server: worker 'sent nothing', exit 3", case_2a, 170),
    Row("2b", "`--batch-size -5` on the PS (mpirun -n 3)", "same path: 'sent nothing', exit 3", case_2b, 170),
    Row("3a", "qsgd:coding=gamma PUSH claiming numel=2**40, to a server", "`MemoryError` in `from_bytes`, server exits",
        case_3a, 90, rss=True),
    Row("3b", "72-byte top-k packet, `wire.from_bytes` + decode", "allocated 1.31 GB", case_3b, 90, rss=True),
    Row("3c", "56-byte random-k packet, `wire.from_bytes` + decode", "allocated 5.7 GB, 8.4 s", case_3c, 90, rss=True),
    Row("4", "25,000 mutated packets, every codec x dtype, `from_bytes` + decode",
        "178 decodes not finite; 49 exceptions other than `WireError`", case_4, 200, rss=True),
    Row("5a", "async PS: worker 1's first PULL has a wrong fingerprint (then it joins)",
        "uncaught `ConfigError`, exit 2", case_5a, 170),
    Row("5b", "sync PS: worker 1 sends a BYE at step 0 (then trains on)", "exit 1", case_5b, 170),
    Row("6a", "PUSH whose sender cleared the CRC flag, to a server", "accepted (trusted)", case_6a, 60),
    Row("6b", "worker 0's step-5 push: one value's exponent bit flipped, CRC recomputed (none, 40 steps)",
        "accuracy 85.8% -> 20.6%, no magnitude check", case_6b, 220),
    Row("6c", "PS checkpoint with one byte flipped in a stored float", "loaded a shard value of 3.5e37 silently",
        case_6c, 60),
    Row("6d", "PS worker checkpoint (valid digest) with residuals of 1e30", "accepted", case_6d, 60),
    Row("6e", "DDP `CompressionState.load_state_dict`: residual 1e30, step 2**70, codec 'topk' / 7",
        "1e30 and 2**70 accepted; codec: cryptic `ValueError`/`TypeError`", case_6e, 90),
    Row("7a", "symlinks planted at the old temp names (`.tmp<pid>`), then a PS checkpoint save",
        "write redirected through the symlink", case_7a, 60),
    Row("7b", "PS checkpoint file modes (umask 022)", "world-readable", case_7b, 60),
    Row("8", "DDP, 2 gloo ranks, top-k: rank 1 receives a zeroed frame at step 3 and stays alive",
        "only rank 1 raises; the others wait for the gloo timeout", case_8, DDP_CAP_S + 150),
    Row("H1", "PS, 2 servers: 7 message faults x 2 workers x 30 steps (mpirun -n 4)",
        "held: 20,036 invalid messages, training bit-identical, bounded memory", case_h1, 260, rss=True),
    Row("H2", "PS: kill -9 of worker 0 at step 5 (mpirun -n 3)", "held: the job ends in 0.3 s", case_h2, 170),
]
BY_ID = {r.id.lower(): r for r in ROWS}


def run_row(row: Row) -> dict[str, Any]:
    """Run ``row`` in a child process with its timeout; what it reported, or how it died."""
    rc, out, err, wall = run_cmd([sys.executable, __file__, "--child", row.id], row.timeout)
    res: dict[str, Any] = {"wall": wall}
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if rc is None:
        res["outcome"] = f"HANG: no result within {row.timeout:.0f} s (killed)"
    elif lines:
        res.update(json.loads(lines[-1][len(RESULT):]))
    elif rc < 0:
        res["outcome"] = f"CRASH: the process died on {signal.Signals(-rc).name}"
    else:
        tail = [ln for ln in err.splitlines() if ln.strip()]
        res["outcome"] = f"harness error (exit {rc}): {words(tail[-1] if tail else 'no output', 150)}"
    return res


def cell(text: str) -> str:
    """A markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def fmt_time(res: dict[str, Any]) -> str:
    """The operation's time where the case measured one, and the row's wall time."""
    if res.get("time_text"):
        return f"{res['time_text']} (wall {res['wall']:.1f} s)"
    if res.get("seconds") is not None:
        s = float(res["seconds"])
        op = f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
        return f"{op} (wall {res['wall']:.1f} s)"
    return f"{res['wall']:.1f} s"


def header() -> str:
    """Where and when the table was measured."""
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "?", ""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"Red-team pass of issue #12, re-measured: commit {commit or '?'}{' (modified)' if dirty else ''}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average {load}. "
            f"Command: `python scripts/redteam.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`.")


def main(argv: list[str] | None = None) -> int:
    """Run the selected rows (or one child / one rank script) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[],
                   help="a case number (1-8), a row id (e.g. 6b) or 'held'; repeatable")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        return rank_main(args.rank)
    if args.child:
        res = BY_ID[args.child.lower()].fn()
        print(RESULT + json.dumps(res), flush=True)
        return 0
    if args.list:
        for r in ROWS:
            print(f"{r.id:4} {r.case}")
        return 0
    rows = ROWS
    if args.only:
        want = [w.lower() for w in args.only]
        rows = [r for r in ROWS if r.id.lower() in want or r.id.lower().rstrip("abcdefg") in want
                or ("held" in want and r.id.startswith("H"))]
        if not rows:
            p.error(f"--only {' '.join(args.only)}: no such case (see --list)")
    print(header())
    print()
    print("| # | case | what the issue saw | outcome now | time | peak RSS delta |")
    print("|---|---|---|---|---|---|")
    t0 = time.monotonic()
    for row in rows:
        res = run_row(row)
        rss = f"{res['rss_mb']:.0f} MB" if row.rss and res.get("rss_mb") is not None else ("n/a" if row.rss else "")
        print(f"| {row.id} | {cell(row.case)} | {cell(row.saw)} | {cell(res['outcome'])} | {fmt_time(res)} | {rss} |",
              flush=True)
    print()
    print(f"{len(rows)} rows in {time.monotonic() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
