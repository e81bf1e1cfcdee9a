"""One training rank: train one workload under each method and report what it cost.

Used by ``commpress train`` (local workers, :mod:`.train`) and started once per emulated host
by ``scripts/bench_e2e.py`` as ``python -m commpress.demo.runner --rank R --world N ...``.
For every method in ``--methods`` it builds the same model from the same seed, wraps it in
DDP over gloo, attaches the method's communication hook, trains ``--steps`` steps and
records per-step wall time, the held-out curve (with wall-clock timestamps, evaluation
excluded), the bytes the hook says it sent and the bytes this host's interface really
transmitted (on an emulated cluster of several ranks per host, :mod:`.shaped_net`, every rank
reads its node's link: the node's cross-node bytes). Rank 0 writes everything to ``--out``.

Workloads (models and data from :mod:`.workloads`):

- ``lm``: the communication-bound byte-level LM (:func:`~.workloads.wide_byte_lm`, 10.8M
  parameters) on stdlib text, the user's ``AdamW(lr=1e-3)``; held-out loss.
- ``digits``: MLP 64-256-256-10 on the digits, the user's ``SGD(lr=0.1, momentum=0.9)``,
  ``bucket_cap_mb=1``; held-out loss and accuracy.
- ``wide-digits``: the communication-bound SGD workload: MLP 64-4096-4096-10 (17M parameters,
  a 67 MB gradient) on the same split, the user's ``SGD(lr=0.05, momentum=0.9)``, batch 64;
  held-out loss and accuracy.
- ``speed``: the 17M-parameter MLP on digits that only times steps; the user's ``SGD(lr=0.05,
  momentum=0.9)`` passed as ``optimizer=``, no warm-up steps (it times the steady state).
- ``quality`` (small byte-level transformer): the earlier e2e workload, SGD with momentum 0.9
  given to the hook by hand (``momentum=``, DGC momentum correction).

Methods: ``allreduce`` (DDP, no hook), ``fp16`` (PyTorch's fp16_compress_hook),
``powersgd`` (PyTorch's PowerSGD, rank 4, one bucket: on gloo it needs a single bucket),
and ``cp-<codec>[:k=v,...][@option=value,...]`` for commpress (e.g. ``cp-topk:ratio=0.01``;
``cp-auto[:auto_codec=topk,ratio=0.01]`` for ``codec="auto"`` and its candidate;
after ``@``, options of :func:`commpress.ddp.register`, e.g.
``cp-sign:block_size=256@momentum_masking=true,warmup_steps=50``). On ``lm`` and ``digits``
a commpress method is registered as a user would: ``register(ddp, name, **params,
optimizer=opt)`` when ``register`` takes ``optimizer``, else without it, plus only the
options after ``@`` (a "tuned" row).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
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
from ..codecs import parse_params
from .workloads import (
    ByteLM,
    TextBatches,
    digits_arrays,
    digits_mlp,
    digits_split,
    lm_loss,
    seeded,
    wide_byte_lm,
)

MOMENTUM = 0.9
WORKLOADS = ("lm", "digits", "wide-digits", "speed", "quality")
#: Workloads trained on the digits split, with held-out accuracy.
DIGITS_SPLIT = ("digits", "wide-digits")
LM_LR = 1e-3
LM_HELDOUT = 128  # held-out windows of the lm workload (32 bytes each; 4096 bytes)


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
    """Model, data, optimizer, loss and held-out metrics of one workload, seen from one rank.

    ``user_optimizer`` workloads (``lm``, ``digits``) train with the optimizer a user would
    bring and register commpress as a user would; ``speed`` passes its SGD as ``optimizer=``
    too (no warm-up); only ``quality`` (:attr:`hook_momentum`) gives the hook ``momentum=``.
    """

    def __init__(self, kind: str, rank: int, batch: int | None = None, lr: float | None = None, world: int = 1) -> None:
        if kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {kind!r}")
        self.kind, self.rank, self.world = kind, rank, world
        self.user_optimizer = kind in ("lm", *DIGITS_SPLIT)
        self.hook_momentum = kind == "quality"  # SGD momentum given to the hook by hand (momentum=)
        self.bucket_cap_mb = 1.0 if kind == "digits" else 25.0
        default_batch = {"lm": 4, "digits": 35, "wide-digits": 64, "speed": 64, "quality": 16}[kind]
        self.batch = batch if batch is not None else default_batch
        default_lr = {"lm": LM_LR, "digits": 0.1, "wide-digits": 0.05, "speed": 0.05, "quality": 0.1}[kind]
        self.lr = lr if lr is not None else default_lr
        if kind == "speed":
            self.x, self.y = digits_arrays()
        elif kind in DIGITS_SPLIT:
            self.x, self.y, self.x_test, self.y_test = digits_split()
            self.own = torch.arange(rank, len(self.y), world)  # this rank's part of the training set
        else:
            self.text = TextBatches(context=32 if kind == "lm" else 64)
            self.heldout = self.text.heldout(LM_HELDOUT if kind == "lm" else 64)

    def model(self) -> nn.Module:
        """A fresh model, identically initialised on every rank."""
        torch.manual_seed(0)
        if self.kind == "lm":
            return wide_byte_lm()
        if self.kind == "digits":
            return digits_mlp(256, 256)
        return digits_mlp(4096, 4096) if self.kind in ("speed", "wide-digits") else ByteLM(dim=128, layers=2, context=64)

    def optimizer(self, params: Any, momentum: float = MOMENTUM) -> torch.optim.Optimizer:
        """The optimizer of this workload (``momentum``: only for :attr:`hook_momentum` and ``speed``)."""
        if self.kind == "lm":
            return torch.optim.AdamW(params, lr=self.lr)
        if self.kind in DIGITS_SPLIT:
            return torch.optim.SGD(params, lr=self.lr, momentum=MOMENTUM)
        return torch.optim.SGD(params, lr=self.lr, momentum=momentum)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        """Training loss of this rank's batch at ``step``."""
        if self.kind == "speed":
            g = torch.Generator().manual_seed(step * 131 + self.rank)
            idx = torch.randint(0, self.x.shape[0], (self.batch,), generator=g)
            return nn.functional.cross_entropy(model(self.x[idx]), self.y[idx])
        if self.kind in DIGITS_SPLIT:  # epochs over this rank's part, reshuffled every epoch
            per_epoch = max(1, len(self.own) // self.batch)
            epoch, i = divmod(step, per_epoch)
            order = self.own[torch.randperm(len(self.own), generator=seeded(0, self.rank, epoch))]
            idx = order[i * self.batch : (i + 1) * self.batch]
            return nn.functional.cross_entropy(model(self.x[idx]), self.y[idx])
        return lm_loss(model, *self.text.batch(step, self.rank, self.batch))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out ``loss`` (and ``accuracy`` in percent for digits) on rank 0.

        ``lm`` spreads its held-out windows over the ranks (every rank must call this);
        the others evaluate on rank 0 only.
        """
        if self.kind == "speed":  # the whole digits set (it only measures speed)
            return {"loss": float(nn.functional.cross_entropy(model(self.x), self.y))}
        if self.kind in DIGITS_SPLIT:
            logits = model(self.x_test)
            return {"loss": float(nn.functional.cross_entropy(logits, self.y_test)),
                    "accuracy": 100.0 * float((logits.argmax(1) == self.y_test).float().mean())}
        if self.kind == "quality":
            return {"loss": float(lm_loss(model, *self.heldout))}
        x, y = self.heldout
        x, y = x[self.rank :: self.world], y[self.rank :: self.world]
        total = torch.tensor([float(lm_loss(model, x, y)) * y.numel(), float(y.numel())], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(total)
        return {"loss": float(total[0] / total[1])}

    @property
    def distributed_eval(self) -> bool:
        """True when every rank takes part in :meth:`evaluate`."""
        return self.kind == "lm"


def register_commpress(method: str, ddp: DDP, opt: torch.optim.Optimizer, work: Workload) -> tuple[Any, bool]:
    """Attach commpress for ``cp-<spec>[@options]``; return ``(state, optimizer passed)``."""
    spec, _, options = method[3:].partition("@")
    hook_options = parse_params(options, f"method {method!r}")
    name, _, params = spec.partition(":")
    codec_params = parse_params(params, f"method {method!r}")
    if work.hook_momentum:
        # DGC momentum correction: the hook keeps the velocity, the optimizer has none. The codec
        # goes by name with its parameters, as users register it (random-k: DDP's unscaled
        # default with error feedback, not the codec's scaled one); "auto" takes its candidate
        # codec as options (cp-auto:auto_codec=topk,ratio=0.01)
        kwargs = {"momentum": MOMENTUM, **codec_params, **hook_options}
        return commpress_ddp.register(ddp, name, **kwargs), False
    if work.kind == "speed":  # it times the steady state: no default warm-up steps
        hook_options.setdefault("warmup_steps", 0)
    takes_optimizer = "optimizer" in inspect.signature(commpress_ddp.register).parameters
    if takes_optimizer:
        hook_options.setdefault("optimizer", opt)
    return commpress_ddp.register(ddp, name, **codec_params, **hook_options), takes_optimizer


def run_method(method: str, work: Workload, steps: int, warmup: int, eval_every: int,
               progress: bool = False) -> dict[str, Any]:
    """Train ``work`` for ``steps`` under ``method``; return timings, bytes and the held-out curve."""
    world = dist.get_world_size()
    name = method.partition(":")[0]
    module = work.model()
    single_bucket = name == "powersgd"
    ddp = DDP(module, bucket_cap_mb=10_000 if single_bucket else work.bucket_cap_mb)
    state = None
    with_optimizer = False
    numel = dense_numel(module)
    # the user's optimizer; the hook-momentum workload drops its momentum under commpress
    opt = work.optimizer(module.parameters(), momentum=0.0 if name.startswith("cp-") and work.hook_momentum else MOMENTUM)
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
        state, with_optimizer = register_commpress(method, ddp, opt, work)
        claimed = 0
    else:
        raise SystemExit(f"unknown method {method!r}")
    step_s: list[float] = []
    curve: list[tuple[int, float, float]] = []  # (step, train seconds so far, held-out loss)
    accuracy: list[float] = []  # held-out accuracy at the curve's points (digits)
    train_s = 0.0
    tx0 = tx_bytes()
    bar = tqdm(total=steps, desc=f"{method:<28}", unit="step", file=sys.stderr, disable=not progress,
               mininterval=2.0)
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
        if eval_every and (step % eval_every == eval_every - 1 or step == steps - 1) and (
                work.rank == 0 or work.distributed_eval):
            metrics = work.evaluate(module)
            curve.append((step + 1, train_s, metrics["loss"]))
            if "accuracy" in metrics:
                accuracy.append(metrics["accuracy"])
            postfix = {"loss": f"{metrics['loss']:.3f}"}
            if state is not None:  # what the hook reports, where users look while it trains
                live = state.stats()
                postfix["ratio"] = f"{live['compression_ratio']:.1f}x"
                counted = step + 1 - (warmup if step >= warmup else 0)  # the stats restart at the warm-up
                postfix["MB/step"] = f"{live['bytes_wire'] / counted / 1e6:.2f}"
            bar.set_postfix(postfix)
        bar.update()
    bar.close()
    timed = steps - warmup
    tx1 = tx_bytes()
    if state is not None:
        stats = state.stats()
        claimed_wire = stats["bytes_wire"] / max(timed, 1)
        ratio = stats["compression_ratio"]
    else:
        claimed_wire = claimed * 2 * (world - 1) / world  # ring all-reduce per rank
        ratio = 4 * numel / claimed
    inter_wire = 0.0 if state is None else stats["inter_bytes_wire"] / max(timed, 1)
    intra_wire = 0.0 if state is None else stats["intra_bytes_wire"] / max(timed, 1)
    # per rank: bytes its interface transmitted, the wire bytes it claims, of which across nodes and inside
    # the node by the hierarchical path (the rest: flat collectives over every rank, e.g. auto's dense buckets)
    mine = torch.tensor([-1.0 if tx0 is None or tx1 is None else (tx1 - tx0) / max(timed, 1), claimed_wire, inter_wire,
                         intra_wire], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    auto = getattr(state, "auto", None)
    if state is not None and auto is not None and work.rank == 0:
        for row in auto.report():
            print(f"[auto] {method} bucket {row['bucket']} ({row['numel']} elements): {row['option']}; "
                  f"predicted {row['predicted_s']}, measured {row['measured_s']}; {row['reason']}",
                  file=sys.stderr, flush=True)
        print(f"[auto] {method} calibration: { {k: v for k, v in state.stats().items() if k.startswith('auto_') and '_b' not in k} }",
              file=sys.stderr, flush=True)
    final = work.evaluate(module) if not curve and (work.rank == 0 or work.distributed_eval) else {}
    dist.barrier()
    return {
        "method": method,
        "params": numel,
        "optimizer_passed": with_optimizer,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "claimed_wire_bytes_per_step": claimed_wire,
        "measured_wire_bytes_per_step": [float(t[0]) for t in gathered],
        "claimed_wire_bytes_per_step_by_rank": [float(t[1]) for t in gathered],
        "inter_bytes_wire_per_step_by_rank": [float(t[2]) for t in gathered],
        "intra_bytes_wire_per_step_by_rank": [float(t[3]) for t in gathered],
        "topology": None if state is None else state.topology.config(),
        "compression_ratio": ratio,
        # the hierarchical algorithm's bytes handed over across nodes (0 when flat), and all of them
        "inter_bytes_sent_per_step": None if state is None else stats["inter_bytes_sent"] / max(timed, 1),
        "bytes_sent_per_step": 4 * numel if state is None else stats["bytes_sent"] / max(timed, 1),
        "final_loss": curve[-1][2] if curve else final.get("loss"),
        "final_accuracy": accuracy[-1] if accuracy else final.get("accuracy"),
        "curve": curve,
        "accuracy": accuracy,
        "auto": None if auto is None else auto.report(),
    }


def main() -> int:
    """Command line of one rank (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", default="127.0.0.1", help="address of rank 0")
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--workload", choices=WORKLOADS, default="speed")
    ap.add_argument("--methods", required=True, help="semicolon-separated; see the module docstring")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--batch", type=int, help="per rank (default: the workload's: lm 4, digits 35, speed 64, quality 16)")
    ap.add_argument("--lr", type=float, help="learning rate (default: the workload's)")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--progress", action="store_true", help="rank 0 shows a progress bar per method")
    ap.add_argument("--out", help="rank 0 writes the results here (JSON)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before failing")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    work = Workload(args.workload, args.rank, args.batch, args.lr, world=args.world)
    results = []
    for method in args.methods.split(";"):
        res = run_method(method, work, args.steps, args.warmup, args.eval_every, progress=args.progress and args.rank == 0)
        if args.rank == 0:
            print(f"[e2e] {args.workload} x{args.world} {method}: median step {res['median_step_s']:.3f} s, "
                  f"final loss {res['final_loss']:.4f}", file=sys.stderr, flush=True)
        results.append(res)
    if args.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "workload": args.workload, "steps": args.steps, "batch": work.batch,
                       "lr": work.lr, "results": results}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
