"""``mpirun -n N python -m commpress.ps [options]``: parameter-server training demos.

Examples (the first ``--servers`` ranks serve, the others train)::

    mpirun -n 4 python -m commpress.ps --demo digits --servers 1 --codec topk:ratio=0.05
    mpirun -n 4 python -m commpress.ps --demo bytelm --servers 2 --mode ssp --staleness 2 --codec qsgd:bits=8
    mpirun -n 3 python -m commpress.ps --demo digits --local-steps 10 --steps 30 --codec qsgd:bits=4  # DiLoCo: outer-step servers

Exit codes: 0 done; 2 bad options or checkpoint; 3 a worker timed out in sync mode; 4 a
worker got no reply from a server; 5 a dropped worker never exited (training completed);
143 preempted: a rank got SIGTERM, every rank stopped after one agreed step and checkpointed
there (with ``--checkpoint``; ``--resume`` continues); 1 anything else. Errors go to stderr naming the rank; rank 0 prints the summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..preemption import EXIT_CODE
from .config import MODES, PSConfig, codec_spec
from .errors import ConfigError
from .faults import parse_fault
from .protocol import DENSE, HEADER_NBYTES


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (also used for ``--help`` without starting MPI)."""
    p = argparse.ArgumentParser(
        prog="python -m commpress.ps",
        description="Parameter-server training over MPI with compressed push and pull. Run under "
                    "mpirun: the first --servers ranks are servers, the rest are workers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="demos:\n"
               "  mpirun -n 4 python -m commpress.ps --demo digits --servers 1 --codec topk:ratio=0.05\n"
               "  mpirun -n 4 python -m commpress.ps --demo bytelm --servers 2 --mode ssp --codec qsgd:bits=8 --steps 300\n"
               "(as root add --oversubscribe and OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)\n\n"
               "codec specs: none, fp16, bf16, topk:ratio=0.01, randomk:ratio=0.05[,scaled=false],\n"
               "  sign[:block_size=256], qsgd:bits=4[,bucket_size=512]\n"
               "exit codes: 0 ok, 2 bad options, 3 worker timeout (sync), 4 no reply from a server,\n"
               "  5 a dropped worker never exited (training completed), 1 other",
    )
    g = p.add_argument_group("task")
    g.add_argument("--demo", choices=("digits", "bytelm"), default="digits",
                   help="digits: MLP on scikit-learn's digits; bytelm: byte-level LM on the stdlib's .py files")
    g.add_argument("--steps", type=int, default=300, help="steps per worker (default 300)")
    g.add_argument("--batch-size", type=int, default=None, help="per worker per step (digits 32, bytelm 16)")
    g.add_argument("--optimizer", choices=("sgd", "adam"), default=None, help="digits: sgd, bytelm: adam")
    g.add_argument("--lr", type=float, default=None, help="learning rate (digits sgd 0.05, bytelm adam 3e-3)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    g.add_argument("--device", default="cpu", help="workers' device: cpu, cuda, cuda:N")
    g = p.add_argument_group("parameter server")
    g.add_argument("--servers", type=int, default=1, help="number of server ranks / shards (default 1)")
    g.add_argument("--mode", choices=MODES, default="sync")
    g.add_argument("--staleness", type=int, default=2, help="ssp: max steps a worker may lead the slowest (default 2)")
    g.add_argument("--codec", default="none", help="push codec spec (default none)")
    g.add_argument("--pull-codec", default="same", help="reply codec spec, 'same' as --codec (default), none = dense")
    g.add_argument("--error-feedback", choices=("auto", "on", "off"), default="auto",
                   help="worker-side error feedback (auto: on for contractive codecs)")
    g.add_argument("--min-compress", type=int, default=512, help="smaller pieces and 1-D params travel dense (512)")
    g.add_argument("--max-drift", type=float, default=0.01,
                   help="max ||x_server - x_worker|| / ||x_server|| per shard after a reply (default 0.01)")
    g.add_argument("--max-push-norm", type=float, default=1e3, metavar="FACTOR",
                   help="servers drop a push whose norm exceeds FACTOR x the running norm of accepted pushes, "
                        "count it and name its worker (default 1e3; 0: off)")
    g.add_argument("--resync-every", type=int, default=0, help="send dense parameters every N replies (0: off)")
    g.add_argument("--timeout", type=float, default=30.0, help="seconds before a silent worker counts as gone (30)")
    g.add_argument("--local-steps", type=int, default=0, metavar="H",
                   help="DiLoCo outer-step servers: each step a worker takes H steps of its optimizer and pushes "
                        "the pseudo-gradient; --steps then counts syncs (default 0: push gradients)")
    g.add_argument("--outer-lr", type=float, default=1.0, help="with --local-steps: the servers' SGD lr (default 1)")
    g.add_argument("--outer-momentum", type=float, default=0.0, help="with --local-steps: its momentum (default 0)")
    g.add_argument("--outer-nesterov", action="store_true", help="with --local-steps: Nesterov momentum")
    g.add_argument("--cuda-aware", choices=("auto", "yes", "no"), default="auto",
                   help="hand MPI device buffers via CuPy (auto: when MPI reports CUDA support)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint", metavar="DIR", help="save server shards, optimizer state and residuals here")
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in DIR")
    g.add_argument("--no-preemption", action="store_true",
                   help="leave SIGTERM's default (the rank dies) instead of stopping every rank at one step, "
                        "checkpointing there and exiting with 143")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    g.add_argument("--log-dir", help="servers write JSON-lines event logs here (replies, staleness, drops)")
    g.add_argument("--out", metavar="FILE", help="rank 0 saves final parameters, metrics and stats (torch.save)")
    g.add_argument("--json", action="store_true", help="rank 0 prints the summary as one JSON object")
    g = p.add_argument_group("testing only")
    g.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="inject a fault, e.g. corrupt:worker=0,step=3 or hang:worker=1,step=5,seconds=60 "
                        "(see commpress/ps/faults.py; for tests and drills, never in production)")
    return p


def config_from(args: argparse.Namespace) -> PSConfig:
    """PSConfig from parsed arguments (raises :class:`ConfigError`)."""
    cfg = PSConfig(
        servers=args.servers, mode=args.mode, staleness=args.staleness, steps=args.steps, codec=args.codec,
        pull_codec=args.pull_codec, error_feedback=args.error_feedback, min_compress=args.min_compress,
        max_drift=args.max_drift, max_push_norm=args.max_push_norm, resync_every=args.resync_every, timeout=args.timeout,
        checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume, seed=args.seed,
        progress=not args.no_progress, log_dir=args.log_dir, device=args.device, cuda_aware=args.cuda_aware,
        faults=tuple(parse_fault(f) for f in args.fault), preemption=not args.no_preemption,
        local_steps=args.local_steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        outer_nesterov=args.outer_nesterov,
    )
    cfg.validate()
    return cfg


def summary(result: Any, cfg: PSConfig, workers: int) -> dict[str, Any]:
    """Rank 0's report: metrics, bytes per step per worker, server throughput."""
    st = result.stats
    per = list(st.get("per_server", []))
    busy = [sum(s["seconds"].values()) for s in per]
    dense = sum(  # what codec none would send: one message per shard
        HEADER_NBYTES + sum(DENSE.wire_size(seg.numel, result.layout.dtype) for seg in sh.segments)
        for sh in result.layout.shards
    )
    return {
        "mode": cfg.mode,
        "codec": codec_spec(cfg.push_codec()),
        "pull_codec": codec_spec(cfg.reply_codec()),
        "servers": cfg.servers,
        "workers": workers,
        "steps": result.steps_done,
        "local_steps": cfg.local_steps,
        "seconds": round(result.seconds, 3),
        "params": result.layout.numel,
        "metrics": result.metrics,
        # a worker sends one push to every server per step and gets one reply from each
        "push_bytes_per_step_per_worker": round(sum(s["push_bytes"] / max(s["push_msgs"], 1) for s in per), 1),
        "pull_bytes_per_step_per_worker": round(
            sum(s["step_reply_bytes"] / max(s["step_reply_msgs"], 1) for s in per), 1),
        "dense_bytes_per_step_per_worker": dense,
        "server_msgs_per_s": [round(s["msgs_in"] / max(result.seconds, 1e-9), 1) for s in per],
        "server_MB_per_s": [round((s["bytes_in"] + s["reply_bytes"]) / max(result.seconds, 1e-9) / 1e6, 3) for s in per],
        "server_busy_fraction": [round(b / max(result.seconds, 1e-9), 3) for b in busy],
        "rejected": st["rejected"],
        "implausible": st.get("implausible", 0),
        "dropped_ranks": st["dropped"],
        "resyncs": st["resyncs"],
        "max_drift": st["max_drift"],
        "max_ahead": st["max_ahead"],
        "skipped_pushes": st["skipped_pushes"],
    }


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run on ``MPI.COMM_WORLD``; return the exit code (0 on every rank that finishes)."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from(args)
        from .demos import DEMOS

        kwargs: dict[str, Any] = {"seed": args.seed, "momentum": args.momentum}
        for key in ("batch_size", "optimizer", "lr"):
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        if args.batch_size is not None and args.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.lr is not None and not args.lr > 0:  # also NaN
            raise ConfigError(f"--lr must be > 0, got {args.lr}")
    except ConfigError as exc:
        print(f"python -m commpress.ps: error: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    from . import mpi_loop
    from .runner import finish, run

    comm = mpi_loop.world()
    try:
        task = DEMOS[args.demo](**kwargs)
    except (ConfigError, ImportError) as exc:
        print(f"[commpress.ps rank {comm.Get_rank()}] error: {exc}", file=sys.stderr, flush=True)
        mpi_loop.abort(comm, 2)
        return 2
    result = run(task, cfg, comm)
    if result.rank == 0:
        report = summary(result, cfg, comm.Get_size() - cfg.servers)
        if args.out:
            torch.save({"params": result.params, "metrics": result.metrics, "summary": report,
                        "stats": {k: v for k, v in result.stats.items() if k != "per_server"}}, args.out)
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print(format_summary(report), flush=True)
    finish(result, comm)
    return 0 if result.preempted is None else EXIT_CODE


def format_summary(r: dict[str, Any]) -> str:
    """Human-readable form of :func:`summary`."""
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in r["metrics"].items())
    lines = [
        f"commpress.ps: {r['mode']} | {r['servers']} server(s), {r['workers']} worker(s) | codec {r['codec']} "
        f"(pull {r['pull_codec']}) | {r['params']} params | {r['steps']} steps in {r['seconds']:.1f} s"
        + (f" (syncs of {r['local_steps']} local steps each)" if r.get("local_steps") else ""),
        f"  final: {metrics}",
        f"  bytes/step/worker: push {r['push_bytes_per_step_per_worker']:.0f}, pull "
        f"{r['pull_bytes_per_step_per_worker']:.0f} (dense {r['dense_bytes_per_step_per_worker']})",
        f"  servers: msgs/s {r['server_msgs_per_s']}, MB/s {r['server_MB_per_s']}, busy {r['server_busy_fraction']}",
        f"  rejected {r['rejected']}, implausible pushes dropped {r['implausible']}, dropped {r['dropped_ranks']}, resyncs {r['resyncs']}, "
        f"max drift {r['max_drift']:.3g}, max lead {r['max_ahead']}, skipped pushes {r['skipped_pushes']}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
