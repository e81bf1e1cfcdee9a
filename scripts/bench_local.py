"""Low-communication training at equal steps: DDP every step vs LocalSGD vs DiLoCo (dense and compressed outer).

gloo ranks on loopback (``--world``, default 2), every method from the same initialisation on the
same batches, DDP with the same optimizer as the dense baseline. Two workloads
(``commpress.demo.workloads``):

- ``--workload digits`` (the default): the digits MLP 64-256-256-10 with the user's
  ``SGD(lr=0.1, momentum=0.9)`` as the (inner) optimizer, batches of 32 per rank drawn from each
  rank's share of the training set; the digits rows (``METHODS``) at ``--sync-every``.
- ``--workload lm``: the byte LM of ``scripts/bench_fsdp_lm.py`` (``ByteLM`` dim 160, 4 blocks,
  MLP 4096 wide, context 64: 5.8M parameters), the user's ``AdamW(lr=1e-3)``, 8 windows per rank
  and step from each rank's own stream of the stdlib text (``TextBatches``), held-out loss over
  64 fixed windows of the held-out text; the LM rows (``LM_METHODS``), each at its own H, the
  first DiLoCo row ``DiLoCo(model, opt)`` at the library's defaults. The header gives the text's
  unigram entropy, the plateau a model that learned no context sits on.

``--optim sgd|adamw`` swaps the optimizer of either workload. Prints, per method: held-out loss
of the synced parameters (DiLoCo: the global copy, after ``finish()``), on digits the accuracy,
on the LM the loss against DDP's in %; bytes each rank handed to collectives in total (DDP: the
fp32 gradient every step) and the ratio to DDP's; on digits, for streaming DiLoCo, the peak
bytes one sync has in flight and the seconds the inner loop blocked on syncs (``sync_wait_s``)
against the syncs' launch-to-completion time (``sync_transfer_s``), summed over rank 0's run
(wall-clock: noisy under load; loopback, so the transfers are short). ``--only`` picks rows of
either list by label (a whole label: that row alone); ``--add k=v,...`` adds a DiLoCo row with
those keywords; ``--json`` keeps the results.

    PYTHONPATH=$PWD python scripts/bench_local.py --steps 640 --sync-every 16
    PYTHONPATH=$PWD python scripts/bench_local.py --only streaming --fragments 4 --overlap 2
    PYTHONPATH=$PWD python scripts/bench_local.py --workload lm --steps 384 --world 2
    PYTHONPATH=$PWD python scripts/bench_local.py --workload lm --only - --add sync_every=64,bits=2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress.local
from commpress.codecs import parse_params
from commpress.demo.workloads import ByteLM, TextBatches, digits_mlp, digits_split, lm_loss, seeded

#: (label, kind, options)
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("DDP all-reduce every step", "ddp", {}),
    ("LocalSGD", "localsgd", {}),
    ("DiLoCo default (qsgd 4-bit outer, overlap H/4, alpha 0.5)", "diloco", {}),
    ("DiLoCo qsgd 4-bit outer, blocking (overlap 0)", "diloco", {"overlap": 0}),
    ("DiLoCo dense outer, blocking", "diloco", {"codec": "none", "overlap": 0}),
    ("DiLoCo dense outer, overlap H/4, alpha 0.5", "diloco", {"codec": "none"}),
    ("DiLoCo qsgd 8-bit outer, blocking", "diloco", {"codec": "qsgd", "bits": 8, "overlap": 0}),
    ("DiLoCo sign outer (EF), blocking", "diloco", {"codec": "sign", "overlap": 0}),
    ("DiLoCo top-k 1% outer (EF), blocking", "diloco", {"codec": "topk", "ratio": 0.01, "overlap": 0}),
    ("DiLoCo dense outer, paper's lr 0.7 m 0.9, blocking", "diloco",
     {"codec": "none", "outer_lr": 0.7, "outer_momentum": 0.9, "overlap": 0}),
    ("DiLoCo qsgd 4-bit outer, paper's lr 0.7 m 0.9, blocking", "diloco",
     {"outer_lr": 0.7, "outer_momentum": 0.9, "overlap": 0}),
    ("streaming DiLoCo, fragments 2, blocking", "diloco", {"fragments": 2, "overlap": 0}),
    ("streaming DiLoCo, fragments 4, blocking", "diloco", {"fragments": 4, "overlap": 0}),
    ("streaming DiLoCo, fragments 4, overlap 1, alpha 0.5", "diloco", {"fragments": 4, "overlap": 1}),
    ("streaming DiLoCo, fragments 4, overlap 4, alpha 0 (replace)", "diloco", {"fragments": 4, "overlap": 4, "merge_alpha": 0.0}),
    ("streaming DiLoCo, fragments 4, overlap 4, alpha 0.5", "diloco", {"fragments": 4, "overlap": 4}),
    ("streaming DiLoCo, fragments 1, overlap H/4, alpha 0 (replace)", "diloco", {"merge_alpha": 0.0}),
]


#: the LM rows (``--workload lm``): issue #26's goal, DiLoCo at its defaults within 1% of DDP's
#: held-out loss at >= 500x fewer bytes, and the settings around it. ``sync_every: None`` is
#: ``DiLoCo(model, opt)`` itself (the library's H); the other rows name their H.
LM_METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("DDP all-reduce every step", "ddp", {}),
    ("DiLoCo at its defaults (H=16, qsgd 4-bit outer, overlap H/4)", "diloco", {"sync_every": None}),
    ("DiLoCo H=32, qsgd 4-bit outer", "diloco", {"sync_every": 32}),
    ("DiLoCo H=64, qsgd 4-bit outer", "diloco", {"sync_every": 64}),
    ("DiLoCo H=128, qsgd 4-bit outer", "diloco", {"sync_every": 128}),
    ("DiLoCo H=32, qsgd 2-bit outer", "diloco", {"sync_every": 32, "bits": 2}),
    ("DiLoCo H=64, qsgd 2-bit outer", "diloco", {"sync_every": 64, "bits": 2}),
    ("DiLoCo H=96, qsgd 4-bit outer", "diloco", {"sync_every": 96}),
    ("DiLoCo H=128, qsgd 8-bit outer", "diloco", {"sync_every": 128, "bits": 8}),
    ("DiLoCo H=32, top-k 2% outer (EF)", "diloco", {"sync_every": 32, "codec": "topk", "ratio": 0.02}),
    ("DiLoCo H=64, dense outer", "diloco", {"sync_every": 64, "codec": "none"}),
    ("LocalSGD H=16", "localsgd", {"sync_every": 16}),
    # the candidate the LM table found (docs/local.md): 4-bit outer at H=96, outer SGD lr 1 without momentum
    ("DiLoCo H=96, qsgd 4-bit outer, outer lr 1 m 0", "diloco",
     {"sync_every": 96, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}),
    # the paper's outer optimizer at the large H (the library's outer default is lr 0.5, momentum 0.8)
    ("DiLoCo H=64, qsgd 4-bit outer, paper's lr 0.7 m 0.9", "diloco",
     {"sync_every": 64, "outer_lr": 0.7, "outer_momentum": 0.9}),
    ("DiLoCo H=128, qsgd 4-bit outer, paper's lr 0.7 m 0.9", "diloco",
     {"sync_every": 128, "outer_lr": 0.7, "outer_momentum": 0.9}),
]


class Digits:
    """The digits MLP 64-256-256-10, batches of 32 from this rank's share of the training set."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        xtr, ytr, self.xte, self.yte = digits_split()
        self.xtr, self.ytr, self.rank = xtr[rank::world], ytr[rank::world], rank

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return digits_mlp(256, 256)

    def loss(self, net: torch.nn.Module, step: int) -> torch.Tensor:
        idx = torch.randint(0, len(self.ytr), (32,), generator=seeded(7, self.rank, step))
        return F.cross_entropy(net(self.xtr[idx]), self.ytr[idx])

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        logits = model(self.xte)
        return {"loss": float(F.cross_entropy(logits, self.yte)), "acc": float((logits.argmax(1) == self.yte).float().mean())}


class ByteText:
    """The byte LM of ``scripts/bench_fsdp_lm.py`` (its model sizes, batches and held-out set).

    Every rank draws its own windows of the stdlib text (``TextBatches.batch(step, rank, ...)``,
    the same stream for every method); the held-out loss is over ``--heldout`` fixed windows of
    the held-out text, evaluated whole on every rank (the models agree when it is taken).
    """

    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        self.text = TextBatches(context=args.context)
        self.heldout = self.text.heldout(args.heldout)
        self.rank, self.args = rank, args

    def model(self) -> torch.nn.Module:
        a = self.args
        torch.manual_seed(0)
        return ByteLM(dim=a.dim, layers=a.layers, context=a.context, heads=a.heads, ffn=a.ffn)

    def loss(self, net: torch.nn.Module, step: int) -> torch.Tensor:
        return lm_loss(net, *self.text.batch(step, self.rank, self.args.batch))

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return {"loss": float(lm_loss(model, *self.heldout))}


def unigram_nats(text: TextBatches) -> float:
    """Entropy (nats) of the training text's byte frequencies: the loss of the best context-free predictor."""
    p = torch.bincount(text.train, minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def make_optimizer(args: argparse.Namespace, params: Any) -> torch.optim.Optimizer:
    """The user's optimizer: ``SGD(lr, momentum=0.9)`` or ``AdamW(lr)`` (lr: ``--lr`` or the workload's)."""
    if args.optim == "adamw":
        return torch.optim.AdamW(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9)


def run_one(rank: int, world: int, kind: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """One method on this rank: train ``args.steps`` steps, evaluate the synced model, count the bytes."""
    work = (ByteText if args.workload == "lm" else Digits)(rank, world, args)
    model = work.model()
    numel = sum(p.numel() for p in model.parameters())
    net: torch.nn.Module = DDP(model) if kind == "ddp" else model
    opt = make_optimizer(args, net.parameters())
    options = {"sync_every": args.sync_every, **options}
    if options["sync_every"] is None:  # the library's own default H
        del options["sync_every"]
    trainer: Any = None
    if kind == "localsgd":
        trainer = commpress.local.LocalSGD(model, opt, **options)
    elif kind == "diloco":
        trainer = commpress.local.DiLoCo(model, opt, **options)
    ctx = trainer if trainer is not None else _Null()
    t0 = time.perf_counter()
    with ctx:
        for step in range(args.steps):
            opt.zero_grad()
            loss = work.loss(net, step)
            loss.backward()
            opt.step()
            if args.progress and rank == 0 and (step + 1) % max(1, args.steps // 10) == 0:
                print(f"  [{kind} {options if trainer else ''}] step {step + 1}: train loss {float(loss.detach()):.4f}, "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    extra: dict[str, float] = {"train_s": time.perf_counter() - t0}
    if trainer is not None:
        extra["sync_every"] = trainer.sync_every
    if kind == "diloco":  # evaluate the global copy (between syncs the fragments differ per rank)
        trainer.finish()  # merge the sync in flight and load the global copy into the model
        s = trainer.stats()
        extra.update({k: s[k] for k in ("peak_bytes_in_flight", "sync_wait_s", "sync_transfer_s", "syncs")})
    with torch.no_grad():
        metrics = work.evaluate(model)
    sent = numel * 4.0 * args.steps if kind == "ddp" else float(trainer.stats()["bytes_sent"])
    return {**metrics, "bytes": sent, "params": numel, **extra}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def select(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """The rows to run: the workload's list, or with ``--only`` every row of both lists whose label matches, plus ``--add``."""
    if not args.only:
        methods = list(LM_METHODS if args.workload == "lm" else METHODS)
    else:
        pool = {label: (label, kind, opts) for label, kind, opts in [*METHODS, *LM_METHODS]}
        exact = [o for o in args.only if o in pool]  # a whole label selects that row alone
        parts = [o for o in args.only if o not in exact and o != "-"]  # "-" selects none (it is in most labels)
        methods = [m for m in pool.values() if m[0] in exact or any(o in m[0] for o in parts)]
    if args.fragments or args.overlap:  # the row of --fragments / --overlap runs whatever --only says
        methods.append((f"streaming DiLoCo, fragments {args.fragments or 1}, overlap {args.overlap}, alpha {args.merge_alpha}",
                        "diloco", {"fragments": args.fragments or 1, "overlap": args.overlap, "merge_alpha": args.merge_alpha}))
    for spec in args.add:  # DiLoCo with these keywords (sync_every=64,bits=2,outer_lr=0.7,...)
        methods.append((f"DiLoCo {spec}", "diloco", parse_params(spec, "--add")))
    return methods


def _entry(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results: list[dict[str, Any]] = []
    for label, kind, options in select(args):
        results.append({"label": label, **run_one(rank, world, kind, options, args)})
        if rank == 0:
            r = results[-1]
            print(f"[bench_local] {label}: held-out loss {r['loss']:.4f}, {r['bytes'] / 1e6:.2f} MB, "
                  f"{r['train_s']:.0f} s", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The markdown table (digits: accuracy and the streaming columns; LM: loss vs DDP's in %)."""
    ddp = next((r for r in results if r["label"].startswith("DDP")), None)
    lines = []
    if args.workload == "lm":
        lines += ["| method | H | held-out loss | vs DDP | bytes sent per rank | DDP bytes / bytes | train s (rank 0) |",
                  "|---|---|---|---|---|---|---|"]
    else:
        lines += ["| method | held-out loss | accuracy | bytes sent per rank | DDP bytes / bytes | peak bytes in flight "
                  "| sync wait / transfer (s) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{ddp['bytes'] / r['bytes']:.0f}x" if ddp and r["bytes"] else "-"
        if args.workload == "lm":
            vs = f"{100 * (r['loss'] / ddp['loss'] - 1):+.2f}%" if ddp else "-"
            h = str(int(r["sync_every"])) if "sync_every" in r else "1"
            lines.append(f"| {r['label']} | {h} | {r['loss']:.4f} | {vs} | {r['bytes'] / 1e6:.2f} MB | {ratio} "
                         f"| {r['train_s']:.0f} |")
            continue
        peak = f"{r['peak_bytes_in_flight'] / 1e3:.1f} kB" if "peak_bytes_in_flight" in r else "-"
        wait = f"{r['sync_wait_s']:.3f} / {r['sync_transfer_s']:.3f}" if "sync_wait_s" in r else "-"
        lines.append(f"| {r['label']} | {r['loss']:.4f} | {100 * r['acc']:.1f}% | {r['bytes'] / 1e6:.2f} MB | {ratio} "
                     f"| {peak} | {wait} |")
    return lines


def header(args: argparse.Namespace, params: int) -> str:
    """The line above the table: workload, ranks, optimizer, steps, tokens."""
    opt = f"inner {'AdamW' if args.optim == 'adamw' else 'SGD'}(lr={args.lr:g}{'' if args.optim == 'adamw' else ', momentum=0.9'})"
    if args.workload == "digits":
        return (f"digits MLP, {args.world} gloo ranks, {opt}, batch 32/rank, {args.steps} steps, "
                f"H={args.sync_every}; torch {torch.__version__}")
    a = args
    tokens = a.steps * a.batch * a.context * a.world
    return (f"ByteLM dim {a.dim}, {a.layers} blocks, MLP {a.ffn} wide, context {a.context} ({params:,} parameters), "
            f"{a.world} gloo ranks, {opt}, batch {a.batch} windows/rank, {a.steps} steps ({tokens:,} training tokens "
            f"per method), held-out: {a.heldout} windows; unigram entropy of the text "
            f"{unigram_nats(TextBatches(context=a.context)):.4f} nats; torch {torch.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("digits", "lm"), default="digits")
    parser.add_argument("--optim", choices=("sgd", "adamw"), help="the inner (and DDP's) optimizer; default: SGD "
                        "momentum 0.9 on digits, AdamW on the LM")
    parser.add_argument("--lr", type=float, help="default: 0.1 (digits SGD), 0.05 (LM SGD), 1e-3 (AdamW)")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks on loopback")
    parser.add_argument("--steps", type=int, help="inner steps per method (default: 640 digits, 384 LM: a multiple of every LM row's H, 96 and 128 included, so no LM run ends between syncs)")
    parser.add_argument("--sync-every", type=int, default=16, help="H of the rows that name none (the digits rows)")
    parser.add_argument("--only", nargs="*", default=[], help="run only methods whose label is or contains one of these "
                        "(either workload's rows; --only - with --fragments/--overlap/--add: those rows alone)")
    parser.add_argument("--fragments", type=int, default=0, help="add a streaming DiLoCo row with this many fragments")
    parser.add_argument("--overlap", type=int, default=0, help="... and this overlap (inner steps)")
    parser.add_argument("--merge-alpha", type=float, default=0.5, help="... and this merge_alpha")
    parser.add_argument("--add", action="append", default=[], metavar="K=V,...",
                        help="add a DiLoCo row with these keywords, e.g. sync_every=64,bits=2 (repeatable)")
    lm = parser.add_argument_group("the LM (defaults: scripts/bench_fsdp_lm.py's)")
    lm.add_argument("--dim", type=int, default=160)
    lm.add_argument("--layers", type=int, default=4)
    lm.add_argument("--heads", type=int, default=4)
    lm.add_argument("--ffn", type=int, default=4096)
    lm.add_argument("--context", type=int, default=64)
    lm.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    lm.add_argument("--heldout", type=int, default=64, help="held-out windows")
    parser.add_argument("--progress", action="store_true", help="rank 0's training loss 10 times per method (stderr)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.optim = args.optim or ("adamw" if args.workload == "lm" else "sgd")
    args.lr = args.lr if args.lr is not None else 1e-3 if args.optim == "adamw" else 0.05 if args.workload == "lm" else 0.1
    args.steps = args.steps or (384 if args.workload == "lm" else 640)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_entry, args=(args.world, port, args, out), nprocs=args.world)
        with open(out) as f:
            results = json.load(f)
    head = header(args, int(results[0]["params"]) if results else 0)  # the LM's reads the whole text: once
    print(head)
    print("\n".join(table(results, args)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "argv": sys.argv[1:], "results": results}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
