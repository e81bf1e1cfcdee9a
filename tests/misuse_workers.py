"""Misuse cases of the DDP hook, each launched on separate gloo ranks (tests/test_misuse.py).

Unlike :func:`ddp_workers.launch`, the launcher here lets ranks die or be stopped on purpose:
each rank writes what it saw (the exception, or nothing) and when, and the test asserts that
every live rank ended with an error within the documented bound.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import commpress.ddp

from ddp_workers import free_port, make_ddp, train_step


def _entry(
    rank: int, world: int, port: int, pg_timeout_s: float, out: str, case: str | Callable[..., None],
    args: tuple[Any, ...], linger_s: float,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    start = time.monotonic()
    error = ""
    try:
        (CASES[case] if isinstance(case, str) else case)(rank, *args)
    except Exception as exc:  # noqa: BLE001 - the test inspects which error each rank saw
        error = f"{type(exc).__name__}: {exc}"
    report = {"error": error, "seconds": time.monotonic() - start, "at": time.monotonic(), "log": LOG}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    if error:
        time.sleep(linger_s)  # alive and silent: its connections stay open
    os._exit(0)  # the process group is broken by design here: no orderly teardown


def launch(
    case: str | Callable[..., None], world: int, out: Path, *args: Any, pg_timeout_s: float = 60.0, bound_s: float = 120.0,
    stopped: tuple[int, ...] = (), linger: dict[int, float] | None = None,
) -> dict[int, dict]:
    """Run ``CASES[case](rank, *args)`` on ``world`` ranks; return what each rank reported.

    ``case`` may also be a module-level function (another adapter's rank program, e.g.
    :func:`fsdp_workers.case_corrupt`).

    Raises AssertionError if a rank other than the ``stopped`` ones (SIGSTOPped on purpose) is
    still running after ``bound_s`` seconds (a hang). A rank in ``linger`` that ends with an
    error stays alive that many seconds after reporting it (as a process whose exit is slow).
    Reports carry ``at``, the system-wide monotonic clock when the rank finished.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, pg_timeout_s, str(out), case, args, (linger or {}).get(r, 0.0)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + bound_s
    for r, p in enumerate(procs):
        if r not in stopped:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in stopped]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)  # a stopped rank must be able to die
            p.kill()
            p.join()
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if (out / f"rank{r}.json").exists()}
    assert not hung, f"{getattr(case, '__name__', case)}: ranks {hung} hung; reports {reports}"
    return reports


#: what a case wants reported besides its final error (e.g. errors it caught and went on from)
LOG: list[str] = []


def _train(ddp: Any, steps: int, on_step: Callable[[int], None] | None = None) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        train_step(ddp, opt, dist.get_rank(), step)


def case_differ_unverified(rank: int, option: str) -> None:
    """verify=False, and rank 1 differs in ``option`` (codec, ratio or algorithm)."""
    ddp = make_ddp()
    configs = {
        "codec": [("topk", {"ratio": 0.1}), ("sign", {})],
        "ratio": [("topk", {"ratio": 0.1}), ("topk", {"ratio": 0.2})],
        "algorithm": [("sign", {"algorithm": "allgather"}), ("sign", {"algorithm": "twophase"})],
    }[option]
    codec, opts = configs[min(rank, 1)]
    commpress.ddp.register(ddp, codec, verify=False, **opts)
    _train(ddp, 3)


def case_some_ranks_register(rank: int, registered: list[int]) -> None:
    """Only the ranks in ``registered`` call ``register`` (verify_timeout 3 s)."""
    ddp = make_ddp()
    if rank in registered:
        commpress.ddp.register(ddp, "topk", ratio=0.1, verify_timeout=3)
    _train(ddp, 3)


def _kill_self_at(step: int, sig: int, victims: list[int]) -> Callable[[int], None]:
    def on_step(s: int) -> None:
        if s == step and dist.get_rank() in victims:
            os.kill(os.getpid(), sig)
    return on_step


def case_killed(rank: int, victims: list[int]) -> None:
    """The ranks in ``victims`` are killed (SIGKILL) at step 5 of 20, mid-training."""
    ddp = make_ddp()
    commpress.ddp.register(ddp, "topk", ratio=0.1)
    _train(ddp, 20, _kill_self_at(5, signal.SIGKILL, victims))


def case_stopped(rank: int, victims: list[int]) -> None:
    """The ranks in ``victims`` stop (SIGSTOP: alive, silent) at step 5 of 20."""
    ddp = make_ddp()
    commpress.ddp.register(ddp, "topk", ratio=0.1)
    _train(ddp, 20, _kill_self_at(5, signal.SIGSTOP, victims))


def _corrupt_received(victim: int) -> list[bool]:
    """Once armed (``flag[0] = True``), rank ``victim`` sees the next frame it unpacks from a peer zeroed.

    Models bytes corrupted on the way to one rank: every other rank decodes what was sent.
    """
    from commpress.wire.frame import FrameLayout

    original = FrameLayout.unpack
    armed = [False]

    def unpack(self: FrameLayout, buf: torch.Tensor, source: int | None = None, **kw: Any) -> Any:
        if armed[0] and source is not None and source != victim:
            armed[0] = False
            buf = torch.zeros_like(buf)
        return original(self, buf, source, **kw)

    if dist.get_rank() == victim:
        FrameLayout.unpack = unpack  # type: ignore[method-assign]
    return armed


def case_corrupt(rank: int, victim: int, codec: str, opts: dict[str, Any], catch: bool) -> None:
    """Rank ``victim`` receives corrupt bytes at step 3 of 10; with ``catch`` it logs the error and trains on."""
    ddp = make_ddp()
    commpress.ddp.register(ddp, codec, **opts)
    armed = _corrupt_received(victim)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(10):
        armed[0] = armed[0] or step == 3
        try:
            train_step(ddp, opt, rank, step)
        except Exception as exc:
            if not (catch and rank == victim):
                raise
            LOG.append(f"step {step}: {type(exc).__name__}: {exc}")
            catch = False  # the next error ends it


CASES: dict[str, Callable[..., None]] = {
    "corrupt": case_corrupt,
    "differ_unverified": case_differ_unverified,
    "some_ranks_register": case_some_ranks_register,
    "killed": case_killed,
    "stopped": case_stopped,
}
