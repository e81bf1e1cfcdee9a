"""The red-team cases (scripts/redteam.py): one function per row of issue #12's table.

Each ``case_*`` runs in a child process of its own (``redteam.py --child ID``) and returns its
result as a dict: ``outcome`` (one line), ``seconds`` (the measured operation, or None),
``rss_mb`` (peak RSS growth) and optionally ``time_text``. Cases reach the code through its
public APIs, ``mpirun ... python -m commpress.ps``, a rank program (:mod:`redteam_ranks`) or a
2-rank gloo DDP job; the table that names them is in ``redteam.py``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from typing import Any

from redteam_harness import (
    DDP_CAP_S,
    DDP_PG_TIMEOUT_S,
    ENV,
    PS_STEPS,
    attempt,
    cap_address_space,
    describe,
    measured,
    mpirun,
    ps_error,
    ps_summary,
    rank_job,
    rank_reports,
    rank_summary,
    rejections,
    scratch,
    words,
)
from redteam_ranks import ddp_rank


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
    rc, out, err, secs = rank_job(3, "nanloss", 150)
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
    rc, out, err, secs = rank_job(3, "badfp", 150)
    return {"outcome": rank_summary(rc, out, err, 150), "seconds": None}


def case_5b() -> dict[str, Any]:
    rc, out, err, secs = rank_job(3, "bye0", 150)
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
    rc, out, err, secs = rank_job(3, "flip", 200)
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



def case_8() -> dict[str, Any]:
    import torch.multiprocessing as mp

    from ddp_workers import free_port

    world, victim = 2, 1
    out = scratch("redteam8.")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=ddp_rank, args=(r, world, port, out, victim, DDP_CAP_S + 30)) for r in range(world)]
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
    rc, out, err, secs = rank_job(4, "hostile", 240)
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
    rc, out, err, secs = rank_job(3, "kill9", 150, env=env)
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
