"""Rank programs for tests/test_comm_algorithms.py and tests/comm/: algorithms run directly on a gloo group, and whole rank programs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from commpress import codecs, comm
from commpress.comm import CommStats, Slot
from commpress.comm.costmodel import Entry, compressed_plan

from ddp_workers import assert_all_ranks

SHAPES = ((40, 8), (7,), (300,))
CASES = (("none", {}, "allreduce"), ("none", {}, "allgather"), ("none", {}, "twophase"),
         ("randomk", {"ratio": 0.1}, "allreduce"), ("topk", {"ratio": 0.1}, "allgather"),
         ("sign", {}, "twophase"), ("sign", {}, "allgather"))


def _same_everywhere(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], x) for x in everyone)


def _sent(algorithm: str, plan: dict[str, float], n: int) -> float:
    """What ``bytes_sent`` should read for one buffer, from the algorithm's own wire plan."""
    if algorithm.startswith("reducescatter"):
        return plan["alltoall"] * (n - 1) / n
    return plan["allreduce"] + plan["allgather"] + plan["alltoall"]


def worker_algorithms(rank: int, world: int) -> None:
    """All-reduce algorithms: the lossless average, wire_plan's bytes, ranks bit-identical."""
    for name, params, algorithm in CASES:
        codec = codecs.get(name, **params)
        dense = codecs.get("none")
        numels = [torch.Size(s).numel() for s in SHAPES]
        inputs = [torch.randn(world, n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(numels)]
        buf = torch.cat([x[rank] for x in inputs])
        slots, off = [], 0
        for i, (shape, n) in enumerate(zip(SHAPES, numels)):
            slots.append(Slot(f"t{i}", off, shape, codec if i != 1 else dense, seed=11 + i))
            off += n
        stats = CommStats()
        comm.run(algorithm, buf, slots, stats=stats).wait()
        what = f"{name} {algorithm}"
        if name == "none":
            mean = torch.cat([x.mean(0) for x in inputs])
            assert_all_ranks(torch.allclose(buf, mean, atol=1e-6), f"{what}: not the average")
        assert_all_ranks(_same_everywhere(buf), f"{what}: ranks differ")
        entries = [Entry(n, i != 1 and name != "none") for i, n in enumerate(numels)]
        plan = compressed_plan(entries, codec, algorithm, world)
        sent = stats.as_dict()["bytes_sent"]
        assert_all_ranks(sent == _sent(algorithm, plan, world), f"{what}: sent {sent}, wire_plan {plan}")


def worker_reduce_scatter(rank: int, world: int) -> None:
    """The shard algorithms: this rank's chunk of the average, wire_plan's bytes."""
    chunk_numels = (24, 5, 64)
    chunk = sum(chunk_numels)
    for name, params, algorithm in (("none", {}, "reducescatter"), ("none", {}, "reducescatter-dense"),
                                    ("topk", {"ratio": 0.25}, "reducescatter"), ("sign", {}, "reducescatter")):
        codec = codecs.get(name, **params)
        inputs = torch.randn(world, world * chunk, generator=torch.Generator().manual_seed(3))
        buf = inputs[rank].clone()
        slots, off = [], 0
        for j in range(world):
            for p, n in enumerate(chunk_numels):
                slots.append(Slot(f"p{p}#{j}", off, (n,), codec if p != 1 else codecs.get("none"), seed=5 + p))
                off += n
        out = torch.empty(chunk)
        stats = CommStats()
        comm.run(algorithm, buf, slots, stats=stats, output=out).wait()
        what = f"{name} {algorithm}"
        if name == "none":
            mean = inputs.mean(0)[rank * chunk : (rank + 1) * chunk]
            assert_all_ranks(torch.allclose(out, mean, atol=1e-6), f"{what}: not this rank's average")
        entries = [Entry(n, p != 1 and name != "none") for p, n in enumerate(chunk_numels)]
        plan = compressed_plan(entries, codec, algorithm, world)
        sent = stats.as_dict()["bytes_sent"]
        assert_all_ranks(sent == _sent(algorithm, plan, world), f"{what}: sent {sent}, wire_plan {plan}")
        assert_all_ranks(stats.as_dict()["dense_bytes"] == (world - 1) * buf.numel() * 4 / world, f"{what}: baseline")


def worker_fault_channel_close(rank: int, world: int) -> None:
    """``FaultChannel.close`` stops the watcher thread even when its wake key cannot be sent (no
    client: a store that no longer answers), within one watch slice: a watcher still blocked in
    the store when the interpreter finalizes aborts the process."""
    import time

    from commpress.comm.faults import WATCH_SLICE_S, FaultChannel

    channel = FaultChannel.of(dist.new_group(list(range(world))))
    thread = channel._thread
    assert thread is not None and thread.is_alive()
    channel._client = None  # the wake key cannot be posted: only the stop flag can end the wait
    start = time.monotonic()
    channel.close()
    took = time.monotonic() - start
    assert_all_ranks(not thread.is_alive() and took < WATCH_SLICE_S + 2.5,
                     f"the watcher outlived close() ({took:.2f} s, alive={thread.is_alive()})")
    dist.barrier()


def exit_after_the_store_host(rank: int, world: int, port: int, groups: int, linger_s: float) -> None:
    """A whole rank program (``mp.spawn`` target): ``groups`` process groups with a fault channel
    each, then ``destroy_process_group`` on every rank, and rank 0, which hosts the store, exits
    first. Every rank must exit cleanly (before the watcher waited in slices: SIGABRT at exit in
    4 of 12 such runs with 16 groups, measured)."""
    import datetime
    import faulthandler
    import time

    from commpress.comm.faults import FaultChannel

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    for _ in range(groups):
        FaultChannel.of(dist.new_group(list(range(world))))
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        time.sleep(linger_s)  # still running, then exiting, after the store's host is gone


def init_twice_on_one_port(rank: int, world: int, port: int) -> None:
    """A whole rank program: a process group with a fault channel, destroyed, then created again on
    the same port in the same process (a user's restart loop): the channel must not keep the first
    store's server alive (the second rendezvous would find it)."""
    import datetime

    from commpress.comm.faults import FaultChannel

    for _ in range(2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        FaultChannel.of(dist.group.WORLD)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        dist.barrier()
        dist.destroy_process_group()


class _SlowToFree:
    """Freed 1 s late (the sleep lets go of the GIL): the main thread runs on towards exit meanwhile."""

    def __del__(self) -> None:
        import time

        time.sleep(1.0)


def _doubles_holding_a_slow_to_free() -> Callable[[torch.futures.Future[list[torch.Tensor]]], torch.Tensor]:
    held = _SlowToFree()

    def callback(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        assert held is not None  # the closure alone keeps it, until torch frees the callback
        return f.value()[0] * 2

    return callback


def exit_while_a_callback_is_freed(rank: int, world: int, port: int, register: str) -> None:
    """A whole rank program: a callback on an all-reduce's future (through commpress's ``register``:
    ``then`` or ``add_done_callback``) that gloo's thread frees 1 s after the future completed,
    and the main thread exits at once. With torch's own ``then`` every such run aborts at exit
    ("terminate called without an active exception", measured); commpress's exit hook waits."""
    import datetime
    import faulthandler

    from commpress.comm import callbacks

    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(3)
    fut = dist.all_reduce(t, async_op=True).get_future()
    if register == "then":
        out = callbacks.then(fut, _doubles_holding_a_slow_to_free()).wait()
        assert torch.equal(out, torch.full((3,), 2.0 * world)), out
    else:
        callbacks.add_done_callback(fut, _doubles_holding_a_slow_to_free())
        fut.wait()
