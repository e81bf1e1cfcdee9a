"""Digests of what training produces, per configuration: refactors must leave them unchanged.

Runs short, deterministic trainings on 2 gloo ranks (CPU) through the public entry points
(``commpress.ddp.register`` with SGD momentum, AdamW and no optimizer; warm-up, the guard,
``auto`` on a given link; ``commpress.fsdp.register``) and prints one line per configuration:
a SHA-256 prefix of the final parameters and of the commpress state's tensors, plus the bytes
sent. Two trees that print the same lines train bit-identically on these paths.

    python scripts/fingerprint.py                # every configuration, ~1 min on 2 cores
    python scripts/fingerprint.py --only ddp-topk-sgd
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

STEPS = 30


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    return x, y


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            h.update(str(t.dtype).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, float):
            h.update(repr(obj).encode())
        elif isinstance(obj, (int, bool, str)) or obj is None:
            h.update(repr(obj).encode())

    walk(tensors)
    return h.hexdigest()[:16]


def _state_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The parts of a state_dict that training determines (counters of seconds are timing, not state)."""
    out = dict(state_dict)
    stats = out.pop("stats", None)
    if isinstance(stats, dict):
        out["bytes"] = {k: v for k, v in stats.items() if "bytes" in k or "wire" in k}
    return out


def _opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.05)


# name -> (path, codec, options, optimizer kind, pass optimizer=)
CONFIGS: dict[str, tuple[str, str, dict[str, Any], str, bool]] = {
    "ddp-dense-sgd": ("ddp", "none", {}, "sgd", True),
    "ddp-fp16-sgd": ("ddp", "fp16", {}, "sgd", True),
    "ddp-topk-defaults": ("ddp", "topk", {"ratio": 0.01}, "sgd", True),
    "ddp-sign-defaults": ("ddp", "sign", {}, "sgd", True),
    "ddp-topk-sgd": ("ddp", "topk", {"ratio": 0.05, "min_numel": 256}, "sgd", True),
    "ddp-topk-sgd-masking": ("ddp", "topk", {"ratio": 0.05, "min_numel": 256, "momentum_masking": True}, "sgd", True),
    "ddp-sign-sgd": ("ddp", "sign", {"min_numel": 256}, "sgd", True),
    "ddp-sign-noopt": ("ddp", "sign", {"min_numel": 256}, "sgd", False),
    "ddp-sign-momentum": ("ddp", "sign", {"min_numel": 256, "momentum": 0.9}, "plain", False),
    "ddp-randomk-sgd": ("ddp", "randomk", {"ratio": 0.1, "min_numel": 256, "warmup_steps": 5}, "sgd", True),
    "ddp-randomk-scaled": ("ddp", "randomk", {"ratio": 0.25, "scaled": True, "min_numel": 256}, "sgd", True),
    "ddp-qsgd-sgd": ("ddp", "qsgd", {"min_numel": 256}, "sgd", True),
    "ddp-qsgd-allgather": ("ddp", "qsgd", {"min_numel": 256, "algorithm": "allgather"}, "sgd", True),
    "ddp-sign-twophase": ("ddp", "sign", {"min_numel": 256, "algorithm": "twophase"}, "sgd", True),
    "ddp-topk-adamw": ("ddp", "topk", {"ratio": 0.05, "min_numel": 256, "warmup_steps": 8}, "adamw", True),
    "ddp-sign-adamw": ("ddp", "sign", {"min_numel": 256, "warmup_steps": 8, "warmup_codec": "dense"}, "adamw", True),
    "ddp-sign-guard": ("ddp", "sign", {"min_numel": 256, "divergence_guard_spec": (2, 0.6, 3)}, "sgd", True),
    # interval beyond the run: a re-decision rescales by measured (load-dependent) encode times
    "ddp-auto-slow": ("ddp", "auto", {"min_numel": 256, "auto_link_spec": (1e-5, 1e-6), "auto_device_spec": True,
                                      "auto_interval": 1000}, "sgd", True),
    "ddp-auto-fast": ("ddp", "auto", {"min_numel": 256, "auto_link_spec": (1e-6, 1e-12), "auto_device_spec": True,
                                      "auto_interval": 10}, "sgd", True),
    "fsdp-topk": ("fsdp", "topk", {"ratio": 0.05}, "sgd", False),
    "fsdp-sign": ("fsdp", "sign", {"block_size": 64}, "sgd", False),
    "fsdp-qsgd": ("fsdp", "qsgd", {"bits": 4}, "adamw", False),
    "fsdp-none": ("fsdp", "none", {}, "sgd", False),
}


def _options(opts: dict[str, Any]) -> dict[str, Any]:
    from commpress.comm.costmodel import DeviceCost, Link
    from commpress.optim import DivergenceGuard

    out = dict(opts)
    if "divergence_guard_spec" in out:
        interval, threshold, dense = out.pop("divergence_guard_spec")
        out["divergence_guard"] = DivergenceGuard(interval=interval, threshold=threshold, dense_steps=dense)
    if "auto_link_spec" in out:
        out["auto_link"] = Link(*out.pop("auto_link_spec"))
    if out.pop("auto_device_spec", False):
        out["auto_device"] = DeviceCost(encode_s=1e-9, decode_s=1e-9, pass_s=1e-10, cast_s=1e-10)
    return out


def _run_ddp(rank: int, codec: str, opts: dict[str, Any], kind: str, pass_opt: bool) -> tuple[Any, Any, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress.ddp

    model = DDP(_net(), bucket_cap_mb=0.01)
    opt = _opt(kind, model.parameters())
    state = commpress.ddp.register(model, codec, optimizer=opt if pass_opt else None, **_options(opts))
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return list(model.parameters()), _state_tensors(state.state_dict()), state.stats()["bytes_sent"]


def _run_fsdp(rank: int, codec: str, opts: dict[str, Any], kind: str) -> tuple[Any, Any, float]:
    from torch.distributed.fsdp import fully_shard

    import commpress.fsdp

    model = _net()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = commpress.fsdp.register(model, codec, **opts)
    opt = _opt(kind, model.parameters())
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    params = [p.detach().full_tensor() for p in model.parameters()]  # type: ignore[operator]
    return params, _state_tensors(state.state_dict()), state.stats()["bytes_sent"]


def _worker(rank: int, world: int, port: int, names: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    lines = []
    for name in names:
        path, codec, opts, kind, pass_opt = CONFIGS[name]
        if path == "ddp":
            params, state, sent = _run_ddp(rank, codec, opts, kind, pass_opt)
        else:
            params, state, sent = _run_fsdp(rank, codec, opts, kind)
        digests = [None] * world
        dist.all_gather_object(digests, (_digest(params), _digest(state)))
        same = all(d[0] == digests[0][0] for d in digests)  # type: ignore[index]
        lines.append(f"{name:24s} params {digests[0][0]}  state r0 {digests[0][1]} r1 {digests[1][1]}  "  # type: ignore[index]
                     f"bytes {int(sent)}  ranks {'identical' if same else 'DIFFER'}")
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    args = ap.parse_args(argv)
    names = args.only or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fingerprint.txt")
        mp.spawn(_worker, args=(2, port, names, out), nprocs=2, join=True)
        with open(out) as f:
            sys.stdout.write(f.read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
