"""One training rank: train one workload under each method and report what it cost.

Used by ``commpress train`` (local workers, :mod:`.train`) and started once per emulated host
by ``scripts/bench_e2e.py`` as ``python -m commpress.demo.runner --rank R --world N ...``.
For every method in ``--methods`` it builds the same model from the same seed, wraps it in
DDP over gloo, attaches the method's communication hook, trains ``--steps`` steps and
records per-step wall time, the loss curve (with wall-clock timestamps, evaluation excluded),
the bytes the hook says it sent and the bytes this host's interface really transmitted.
Rank 0 writes everything to ``--out``.

Methods: ``allreduce`` (DDP, no hook), ``fp16`` (PyTorch's fp16_compress_hook),
``powersgd`` (PyTorch's PowerSGD, rank 4, one bucket: on gloo it needs a single bucket),
and ``cp-<codec>[:k=v,...][@option=value,...]`` for commpress (e.g. ``cp-topk:ratio=0.01``;
after ``@``, options of :func:`commpress.ddp.register`, e.g.
``cp-sign:block_size=256@momentum_masking=true,warmup_steps=50``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from .. import ddp as commpress_ddp
from ..codecs import from_spec, parse_params
from .workloads import ByteLM, TextBatches, digits, lm_loss, wide_mlp

MOMENTUM = 0.9


def tx_bytes() -> int | None:
    """Bytes gloo's interface (GLOO_SOCKET_IFNAME, else lo) has transmitted, None if unreadable."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def dense_numel(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def powersgd_floats(model: nn.Module, rank: int) -> int:
    """Floats PowerSGD all-reduces per step: P and Q per matrix, 1-D tensors dense."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += p.numel()
        else:
            n, m = p.shape[0], p[0].numel()
            r = min(rank, n, m)
            total += min((n + m) * r, n * m)
    return total


class Workload:
    """Model + data + loss for one of the two workloads."""

    def __init__(self, kind: str, rank: int, batch: int, lr: float | None = None) -> None:
        self.kind, self.rank, self.batch = kind, rank, batch
        self.lr = lr if lr is not None else (0.05 if kind == "speed" else 0.1)
        if kind == "speed":
            self.x, self.y = digits()
        else:
            self.text = TextBatches(context=64)
            self.heldout = self.text.heldout(64)

    def model(self) -> nn.Module:
        """A fresh model, identically initialised on every rank."""
        torch.manual_seed(0)
        return wide_mlp(4096, 2) if self.kind == "speed" else ByteLM(dim=128, layers=2, context=64)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        """Training loss of this rank's batch at ``step``."""
        if self.kind == "speed":
            g = torch.Generator().manual_seed(step * 131 + self.rank)
            idx = torch.randint(0, self.x.shape[0], (self.batch,), generator=g)
            return nn.functional.cross_entropy(model(self.x[idx]), self.y[idx])
        return lm_loss(model, *self.text.batch(step, self.rank, self.batch))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """Held-out loss (the whole digits set for the speed workload)."""
        if self.kind == "speed":
            return float(nn.functional.cross_entropy(model(self.x), self.y))
        return float(lm_loss(model, *self.heldout))


def run_method(method: str, work: Workload, steps: int, warmup: int, eval_every: int,
               progress: bool = False) -> dict[str, Any]:
    """Train ``work`` for ``steps`` under ``method``; return timings, bytes and the loss curve."""
    world = dist.get_world_size()
    name = method.partition(":")[0]
    module = work.model()
    single_bucket = name == "powersgd"
    ddp = DDP(module, bucket_cap_mb=10_000 if single_bucket else 25)
    state = None
    opt_momentum = MOMENTUM
    numel = dense_numel(module)
    if name == "allreduce":
        claimed = 4 * numel
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        claimed = 2 * numel
    elif name == "powersgd":
        ps_state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                          start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(ps_state, powersgd.powerSGD_hook)
        claimed = 4 * powersgd_floats(module, 4)
    elif name.startswith("cp-"):
        # DGC momentum correction: the hook keeps the velocity, the optimizer has none
        spec, _, options = method[3:].partition("@")
        hook_options = {"momentum": MOMENTUM, **parse_params(options, f"method {method!r}")}
        state = commpress_ddp.register(ddp, from_spec(spec), **hook_options)
        opt_momentum = 0.0
        claimed = 0
    else:
        raise SystemExit(f"unknown method {method!r}")
    opt = torch.optim.SGD(module.parameters(), lr=work.lr, momentum=opt_momentum)
    step_s: list[float] = []
    curve: list[tuple[int, float, float]] = []  # (step, train seconds so far, eval loss)
    train_s = 0.0
    tx0 = tx_bytes()
    bar = tqdm(total=steps, desc=f"{method:<28}", unit="step", file=sys.stderr, disable=not progress)
    for step in range(steps):
        if step == warmup:
            tx0 = tx_bytes()
            if state is not None:
                state.reset_stats()
        t0 = time.perf_counter()
        loss = work.loss(ddp, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        train_s += dt
        if step >= warmup:
            step_s.append(dt)
        if work.rank == 0 and eval_every and (step % eval_every == eval_every - 1 or step == steps - 1):
            curve.append((step + 1, train_s, work.evaluate(module)))
            bar.set_postfix(loss=f"{curve[-1][2]:.3f}")
        bar.update()
    bar.close()
    timed = steps - warmup
    tx1 = tx_bytes()
    measured = torch.tensor([-1.0 if tx0 is None or tx1 is None else (tx1 - tx0) / max(timed, 1)], dtype=torch.float64)
    gathered = [torch.zeros_like(measured) for _ in range(world)]
    dist.all_gather(gathered, measured)
    if state is not None:
        stats = state.stats()
        claimed_wire = stats["bytes_wire"] / max(timed, 1)
        ratio = stats["compression_ratio"]
    else:
        claimed_wire = claimed * 2 * (world - 1) / world  # ring all-reduce per rank
        ratio = 4 * numel / claimed
    dist.barrier()
    return {
        "method": method,
        "params": numel,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "claimed_wire_bytes_per_step": claimed_wire,
        "measured_wire_bytes_per_step": [float(t) for t in gathered],
        "compression_ratio": ratio,
        "final_loss": curve[-1][2] if curve else work.evaluate(module),
        "curve": curve,
    }


def main() -> int:
    """Command line of one rank (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", default="127.0.0.1", help="address of rank 0")
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--workload", choices=["speed", "quality"], default="speed")
    ap.add_argument("--methods", required=True, help="semicolon-separated; see the module docstring")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="rank 0 writes the results here (JSON)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before failing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    work = Workload(args.workload, args.rank, args.batch)
    results = []
    for method in args.methods.split(";"):
        res = run_method(method, work, args.steps, args.warmup, args.eval_every)
        if args.rank == 0:
            print(f"[e2e] {method}: median step {res['median_step_s']:.3f} s, final loss {res['final_loss']:.4f}",
                  file=sys.stderr, flush=True)
        results.append(res)
    if args.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "workload": args.workload, "results": results}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
