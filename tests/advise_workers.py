"""Rank bodies for tests/test_advise.py (spawned: they must be importable)."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress.ddp
from commpress.advise import ddp_buckets, gradient_order


def model() -> nn.Module:
    """Mixed shapes: matrices past and under min_numel, biases, a 3-D tensor; several buckets at 1 MB."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    net.register_parameter("extra", nn.Parameter(torch.randn(4, 8, 8)))
    return net


def _loss(net: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 7 + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    inner = net.module if isinstance(net, DDP) else net
    return nn.functional.cross_entropy(net(x), y) + inner.extra.square().sum() * 1e-3


def _steps(ddp: DDP, rank: int, n: int) -> None:
    for step in range(n):
        ddp.zero_grad(set_to_none=True)
        _loss(ddp, rank, step).backward()


def worker_buckets_and_bytes(rank: int, world: int, out: str) -> None:
    """Record DDP's real buckets and commpress's bytes per step next to what advise predicts."""
    # "extra" is registered first, but its gradient is ready first too: not DDP's initial reverse order
    probe = model()
    named = gradient_order(probe, lambda: _loss(probe, rank, 0).backward())
    predicted = [[[e.numel, e.compressed] for e in b] for b in ddp_buckets(named, 1.0, ready_order=True)]
    real: list[list[int]] = []

    def record(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
        real.append([bucket.index(), *(p.numel() for p in bucket.parameters())])  # the index first
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp = DDP(model(), bucket_cap_mb=1.0)
    ddp.register_comm_hook(None, record)
    _steps(ddp, rank, 3)  # DDP rebuilds its buckets after the first backward: the last step is the real layout
    last = real[-1][0] + 1
    real = [b[1:] for b in real[-last:]]
    measured: dict[str, float] = {}  # advise prices the steady state: random-k without its warm-up
    for name, params in (("topk", {"ratio": 0.01}), ("qsgd", {}), ("randomk", {"ratio": 0.01, "scaled": False, "warmup_steps": 0})):
        ddp = DDP(model(), bucket_cap_mb=1.0)
        state = commpress.ddp.register(ddp, name, optimizer=None, **params)
        _steps(ddp, rank, 2)
        measured[name] = state.stats()["bytes_wire"] / 2
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"predicted": predicted, "real": real, "bytes": measured}, f)
