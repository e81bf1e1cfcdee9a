"""Every loop that moves the parameter server's bytes over MPI, and nothing else.

:func:`serve` runs a :class:`~.server.ShardServer`, :func:`work` a
:class:`~.worker.WorkerRun`, :func:`send_final` / :func:`gather_final` carry the final
shards and counters to rank 0; :func:`world`, :func:`private` and :func:`abort` are the
communicator calls the runner needs. The state machines decide what to send; this module only
probes, receives, posts and waits (with deadlines). ``mpi4py`` itself is imported only by
:mod:`.transport`, the MPI adapter (buffers, requests, CUDA-awareness) these loops use.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .errors import ProtocolError, PSError, ServerTimeout
from .preempt import StopAgreement
from .protocol import (
    DENSE,
    HEADER_NBYTES,
    MAX_STATS_NBYTES,
    TO_ROOT,
    MsgType,
    parse_header,
    parse_segments,
    payload_nbytes,
)
from .server import ShardServer
from .sharding import Layout
from .transport import TAG_FINAL, Backoff, Inbox, Outbox, mpi
from .worker import WorkerOutcome, WorkerRun

logger = logging.getLogger("commpress")


# ----- communicators -----------------------------------------------------------------------------
def world() -> Any:
    """``MPI.COMM_WORLD`` (starts MPI on first use)."""
    return mpi().COMM_WORLD


@contextmanager
def private(comm: Any) -> Iterator[Any]:
    """A duplicate of ``comm`` for one run (its traffic cannot meet the caller's), freed after."""
    dup = comm.Dup()
    try:
        yield dup
    finally:
        dup.Free()


def abort(comm: Any, code: int) -> None:
    """End the whole job with exit code ``code`` (a rank that simply raised would leave the others waiting)."""
    comm.Abort(code)


# ----- the server ---------------------------------------------------------------------------------
def serve(
    comm: Any,
    server: ShardServer,
    *,
    bar: Any = None,
    save: Callable[[int, dict[str, Any]], None] | None = None,
    stop: StopAgreement | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[int]:
    """Run ``server`` on ``comm`` until every worker said goodbye or was dropped and abandoned.

    A dropped worker gets ``2 * timeout + 5`` seconds to come back, be told to stop and say
    goodbye; the ranks of those that never do are returned (they may hang: the caller ends
    the job). ``bar`` is a tqdm-like progress bar (rank 0), ``save(step, state)`` writes a
    checkpoint, ``stop`` the preemption agreement (polled with liveness: the run ends at its
    step), ``on_step(progress)`` runs once a handled message advanced
    :meth:`~.server.ShardServer.progress`, after its replies were posted (it sends nothing).
    Raises :class:`WorkerTimeout` and other fatal :class:`PSError`; rejected
    messages are logged (``commpress`` logger) and counted. Liveness is checked at least every 50 ms,
    also while messages keep arriving.
    """
    inbox = Inbox(comm, server.max_message())
    outbox = Outbox(comm)
    backoff = Backoff()
    grace = 2 * server.cfg.timeout + 5.0
    sec = server.stats.seconds
    for key in ("recv", "send", "checkpoint"):
        sec.setdefault(key, 0.0)
    last_bar = last_check = 0.0
    reported = server.progress()
    t_start = time.monotonic()
    while True:
        outbox.poll()
        now = time.monotonic()
        src = inbox.probe()
        if src is None or now - last_check > 0.05:
            last_check = now
            if stop is not None and (at := stop.poll(server.furthest_step())) is not None:
                server.stop_at(at)
            for dest, msg in server.check():
                outbox.post(dest, msg)
            if all(w in server.done for w in range(server.W) if w not in server.dropped) and len(
                server.abandoned(grace)
            ) == sum(1 for w in server.dropped if w not in server.done):
                break
        if bar is not None and now - last_bar > 0.25:
            last_bar = now
            _update_bar(bar, server, now - t_start)
        if src is None:
            backoff.wait()
            continue
        backoff.reset()
        t0 = time.perf_counter()
        try:
            buf = inbox.receive(src)
            t1 = time.perf_counter()
            sec["recv"] += t1 - t0
            out = server.handle(src, buf)
        except ProtocolError as exc:
            _reject(server, exc)
            continue
        t2 = time.perf_counter()
        for dest, msg in out:
            outbox.post(dest, msg)
        t3 = time.perf_counter()
        sec["send"] += t3 - t2
        step = server.checkpoint_due()
        if step is not None and save is not None:
            save(step, server.state_dict())
            server.mark_saved(step)
            sec["checkpoint"] += time.perf_counter() - t3
        if on_step is not None and server.progress() > reported:  # after the replies went out
            reported = server.progress()
            on_step(reported)
    server.stats.wall_seconds = time.monotonic() - t_start
    if bar is not None:
        _update_bar(bar, server, time.monotonic() - t_start)
    outbox.flush(time.monotonic() + 1.0)
    outbox.cancel()
    return server.abandoned(grace)


def _reject(server: ShardServer, exc: ProtocolError) -> None:
    rank = -1 if exc.sender is None else exc.sender
    n = server.stats.rejected.get(rank, 0) + 1
    server.stats.rejected[rank] = n
    server._event(event="reject", rank=rank, reason=exc.reason)
    if n <= 10 or n % 100 == 0:
        logger.warning("[commpress.ps server %d] rejected a message from rank %d: %s%s", server.index, rank, exc.reason,
                       " (further rejections from this rank are counted, logged every 100th)" if n == 10 else "")


def _update_bar(bar: Any, server: ShardServer, elapsed: float) -> None:
    done = server.progress()
    if done > bar.n:
        bar.update(done - bar.n)
    s = server.stats
    post = {
        "live": len(server.live()),
        "msg/s": f"{s.msgs_in / max(elapsed, 1e-9):.0f}",
        "MB/s": f"{(s.bytes_in + s.reply_bytes) / max(elapsed, 1e-9) / 1e6:.1f}",
    }
    if server.last_loss:
        post["loss"] = f"{sum(server.last_loss.values()) / len(server.last_loss):.4f}"
    if s.rejected:
        post["rejected"] = sum(s.rejected.values())
    if s.implausible:
        post["implausible"] = sum(s.implausible.values())
    if s.dropped:
        post["dropped"] = len(s.dropped)
    bar.set_postfix(post, refresh=False)


# ----- the worker ---------------------------------------------------------------------------------
def work(comm: Any, run: WorkerRun, *, device_buffers: bool = False, stop: StopAgreement | None = None) -> WorkerOutcome:
    """Carry ``run``'s messages on ``comm`` until it finished; every wait for replies has its deadline.

    ``stop``: the preemption agreement, polled before each step (the run ends at its step).

    Raises :class:`ServerTimeout` when a server does not answer within the exchange's patience.
    """
    node = run.node
    inbox = Inbox(comm, node.max_reply())
    outbox = Outbox(comm, device_buffers)
    t_begin = time.monotonic()
    out = run.begin()
    while True:
        for dest, msg in out:
            outbox.post(dest, msg)
        if run.finished:
            break
        deadline = time.monotonic() + run.patience
        while run.waiting:
            got = inbox.wait(sorted(run.waiting), deadline)
            if got is None:
                raise ServerTimeout(
                    f"worker {node.worker} (rank {comm.Get_rank()}) got no reply from server rank(s) "
                    f"{sorted(run.waiting)} for step {run.step} within {run.patience:g} s", min(run.waiting),
                )
            run.receive(*got)
        outbox.poll()
        if stop is not None and (at := stop.poll(run.step)) is not None:
            run.stop_at(at)
        out = run.advance()
    outcome = run.outcome
    if not outcome.vanished:
        outbox.flush(time.monotonic() + node.cfg.timeout)
        outbox.cancel()
    outcome.seconds = time.monotonic() - t_begin
    return outcome


# ----- the end of a run ---------------------------------------------------------------------------
def send_final(comm: Any, index: int, msgs: list[torch.Tensor], timeout: float) -> None:
    """Server ``index`` (not rank 0): hand its final SHARD and STATS messages to rank 0."""
    out = Outbox(comm)
    for msg in msgs:
        out.post(0, msg, TAG_FINAL)
    if not out.flush(time.monotonic() + timeout):
        raise PSError(f"server {index}: rank 0 did not take the final shard within {timeout:g} s")


def gather_final(comm: Any, layout: Layout, full: torch.Tensor, timeout: float) -> list[dict[str, Any]]:
    """Rank 0: decode the other servers' final shards into ``full``; return their counters in arrival order."""
    stats: list[dict[str, Any]] = []
    limit = HEADER_NBYTES + max(MAX_STATS_NBYTES, *(payload_nbytes(sh, lambda seg: DENSE, layout.dtype) for sh in layout.shards))
    inbox = Inbox(comm, limit, TAG_FINAL)
    waiting = {(r, k) for r in range(1, layout.servers) for k in (MsgType.SHARD, MsgType.STATS)}
    deadline = time.monotonic() + timeout
    while waiting:
        got = inbox.wait(sorted({r for r, _ in waiting}), deadline)
        if got is None:
            raise PSError(f"rank 0: servers {sorted({r for r, _ in waiting})} did not send their final shards")
        src, buf = got
        head = parse_header(buf, src, TO_ROOT)
        if head.shard != src:
            raise ProtocolError(f"final {head.type.name} for shard {head.shard}", src)
        if head.type == MsgType.SHARD:
            other = layout.shards[src]
            packets = parse_segments(buf[HEADER_NBYTES:], other, lambda seg: DENSE, layout.dtype, src)
            for seg, p in zip(other.segments, packets):
                DENSE.decode(p, full[seg.start : seg.stop])
        else:
            stats.append(json.loads(buf[HEADER_NBYTES:].tobytes().decode()))
        waiting.discard((src, head.type))
    return stats


__all__ = ["abort", "gather_final", "private", "send_final", "serve", "work", "world"]
