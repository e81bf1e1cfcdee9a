"""The red-team rank programs (scripts/redteam.py): the processes a case starts, one per rank.

``rank_main(NAME)`` is a rank of a parameter-server job set up as case NAME describes (run as
``mpirun -n N python scripts/redteam.py --rank NAME``; it reports JSON lines, ``RANK_OUT``), with
the red team's own fault kinds taught to the worker's fault hook; ``ddp_rank`` is one gloo rank
of case 8, started by ``torch.multiprocessing`` (spawn) from ``redteam_cases.case_8``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from redteam_harness import DDP_PG_TIMEOUT_S, PS_STEPS, RANK_OUT, describe, maxrss_mb


def ddp_rank(rank: int, world: int, port: int, out: str, victim: int, linger_s: float) -> None:
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
