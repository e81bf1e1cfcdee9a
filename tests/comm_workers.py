"""Rank programs for tests/test_comm_algorithms.py: each algorithm run directly on a gloo group."""

from __future__ import annotations

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
