"""FSDP2 on a transformer LM: commpress against FSDP's fp32 and bf16 policies, on shaped links.

For each link (``--links``: unshaped, 10gbit, 1gbit) it starts one rank per emulated host
(scripts/shaped_net.py; loopback without root) and trains a decoder-only byte LM
(:class:`commpress.demo.workloads.ByteLM`, ``fully_shard`` per block and the root) with the
user's optimizer (``AdamW(lr=1e-3)``, or ``--optim sgd``: ``SGD(lr=0.05, momentum=0.9)``) under
every method, from the same initialisation on the same batches. It prints, per method: bytes
per rank and step split into the parameter all-gathers (forward + backward) and the gradient
reduce-scatter, the bytes the host's interface really sent, the median step, held-out loss at
equal steps, training time to FSDP fp32's final loss x 1.02, and memory per rank (parameter
shard, gradient shard, optimizer state, commpress's compression state: residuals, velocities and
the peak of forward frames kept for the backward). ``--doc`` writes the
tables into docs/benchmarks.md (between the fsdp-lm markers) and a loss-vs-time plot.

Methods (``--methods``, ``;``-separated): ``fp32`` (FSDP2 as is), ``bf16`` (FSDP2 with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, the built-in policy), and
``diloco[:k=v,...][@mp=bf16]`` (FSDP2 over each node's ranks, ``commpress.local.DiLoCo(model, opt,
replica_group=<the node's group>, k=v, ...)`` across the nodes: dense inside, the outer sync across; its
held-out points are the global copy's, at the steps a sync merged), and
``cp-<codec>[:k=v,...][@option=value,...]`` for ``commpress.fsdp.register(model, codec,
optimizer=opt, ...)`` where the options after ``@`` are ``mp=bf16`` (the bf16 policy
underneath), ``param=<codec>`` or ``param=<forward>/<backward>`` (``param_codec=``; ``param=none``:
FSDP's own all-gather, gradient-only), and any other keyword of :func:`commpress.fsdp.register`
(``warmup_steps=0``); ``exact=a+b`` (a diagnostic) sends the parameters named ``a`` and ``b``
exact (a ``compress_filter=`` on the default rule). Without ``param=`` a row runs ``register``'s default: a compressing codec
(``cp-topk:ratio=0.01``, ``cp-sign``, ``cp-qsgd``, ...) gathers int8 parameters with the backward
reusing the forward's frames, ``none`` and the casts keep FSDP's own all-gather. ``cp-auto`` is
``register(model, "auto", optimizer=opt)``: per module, exact / bf16 / compressed for the
reduce-scatter and the all-gather from the cost model (``docs/fsdp.md``); its choices are printed
and kept in the JSON (``auto``).

    sudo python scripts/bench_fsdp_lm.py --links 1gbit --world 2
    sudo python scripts/bench_fsdp_lm.py --links unshaped,1gbit --world 2 --doc
    python scripts/bench_fsdp_lm.py --quick                     # loopback, a few steps of each
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

DEFAULT_METHODS = [
    "fp32",
    "cp-bf16@param=bf16",  # FSDP's bf16 wire with fp32 compute (the bf16 policy's bytes, this CPU's fast math)
    "cp-qsgd@param=none",  # gradient-only
    "cp-qsgd:bits=2@param=int8/reuse",  # the recommended setting (docs/fsdp.md)
    "cp-sign@param=int8/reuse",
    "cp-auto",  # per module from the cost model (commpress.fsdp.auto)
]
LOSS_TARGET = 1.02  # time to FSDP fp32's final held-out loss x this
START, END = "<!-- fsdp-lm:start -->", "<!-- fsdp-lm:end -->"


# ----- one rank ------------------------------------------------------------------------------------
def build_model(args: argparse.Namespace) -> nn.Module:
    from commpress.demo.workloads import ByteLM

    torch.manual_seed(args.seed)
    return ByteLM(dim=args.dim, layers=args.layers, context=args.context, heads=args.heads, ffn=args.ffn)


def parse_method(method: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``cp-sign:block_size=256@mp=bf16,param=int8/int4`` -> ("sign", codec params, options)."""
    from commpress.codecs import parse_params

    spec, _, extra = method[3:].partition("@")
    name, _, params = spec.partition(":")
    options = parse_params(extra) if extra else {}
    return name, (parse_params(params) if params else {}), options


def shard_model(model: nn.Module, mp: str | None, mesh: str | None = None) -> None:
    """``fully_shard`` per block and the root; ``mesh``: None (every rank), ``"node"`` (the node's ranks:
    :func:`commpress.fsdp.node_mesh`) or ``"hsdp"`` (FSDP2's own HSDP: a 2-D mesh, dense all-reduce across nodes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import commpress.fsdp

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp == "bf16" else MixedPrecisionPolicy()
    kw: dict[str, Any] = {}
    if mesh == "node":
        kw["mesh"] = commpress.fsdp.node_mesh("cpu")
    elif mesh == "hsdp":
        L = int(os.environ["LOCAL_WORLD_SIZE"])
        kw["mesh"] = init_device_mesh("cpu", (dist.get_world_size() // L, L), mesh_dim_names=("replicate", "shard"))
    elif mesh is not None:
        raise SystemExit(f"unknown mesh {mesh!r}: node or hsdp")
    for block in model.blocks.layers:  # type: ignore[union-attr]
        fully_shard(block, mp_policy=policy, **kw)
    fully_shard(model, mp_policy=policy, **kw)


def fsdp_wire(model: nn.Module, world: int, ag_bytes: int, rs_bytes: int) -> tuple[float, float]:
    """Per rank and step: what FSDP's ring all-gathers (forward + backward) and reduce-scatter send.

    Each block is gathered twice (forward, backward); the root's own parameters once: FSDP does
    not reshard the root after forward, so its backward needs no all-gather.
    """
    def padded(params: Any) -> int:
        return sum(-(-p.shape[0] // world) * world * (p.numel() // max(p.shape[0], 1)) for p in params)

    in_blocks = list(model.blocks.parameters())  # type: ignore[union-attr]
    blocks = padded(in_blocks)
    root = padded(p for p in model.parameters() if all(p is not q for q in in_blocks))
    frac = (world - 1) / world
    return frac * (2 * blocks + root) * ag_bytes, frac * (blocks + root) * rs_bytes


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


#: ``@param=`` left out: register's own default (commpress.fsdp.allgather.DEFAULT)
DEFAULT = object()


def run_method(method: str, args: argparse.Namespace, text: Any, heldout: tuple[torch.Tensor, torch.Tensor],
               rank: int, world: int) -> dict[str, Any]:
    from bench_local import synced_at  # the steps where DiLoCo's global copy changes (a merge)

    import commpress.fsdp
    from commpress.demo.runner import tx_bytes
    from commpress.demo.workloads import lm_loss

    model = build_model(args)
    numel = sum(p.numel() for p in model.parameters())
    state = None
    if method in ("fp32", "bf16", "hsdp-fp32", "hsdp-bf16"):
        shard_model(model, "bf16" if method.endswith("bf16") else None, "hsdp" if method.startswith("hsdp") else None)
        codec, options = None, {}
    elif method.startswith("diloco"):  # FSDP2 inside each node, DiLoCo across the nodes (replicas)
        _, diloco_params, options = parse_method("cp-" + method)
        shard_model(model, options.pop("mp", None), "node")
        codec = None
        if options:
            raise SystemExit(f"{method}: unknown option(s) {sorted(options)} (mp=bf16 only)")
    elif method.startswith("cp-"):
        codec, params, options = parse_method(method)
        shard_model(model, options.pop("mp", None), options.pop("mesh", None))
        param = options.pop("param", DEFAULT)
        if param is None:  # parse_params reads "none" as None: FSDP's own all-gather, counted (gradient-only)
            param = "none"
        exact = options.pop("exact", None)
        if exact is not None:  # diagnostic: these parameters (``+``-separated names) sent exact
            from commpress.selection import SelectionRule

            names, rule = set(str(exact).split("+")), SelectionRule()
            options["compress_filter"] = lambda n, p: n not in names and rule(n, tuple(p.shape), p.numel())
        if isinstance(param, str) and "/" in param:
            fwd, bwd = param.split("/")
            param = {"forward": fwd, "backward": bwd}
    else:
        raise SystemExit(f"unknown method {method!r}")
    opt = (torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optim == "adamw"
           else torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    if codec is not None:
        # ``@optimizer=none``: the optimizer runs unchanged (not handed to commpress)
        handed = None if str(options.pop("optimizer", "")).lower() == "none" else opt
        state = commpress.fsdp.register(model, codec, optimizer=handed, **params, **options,
                                        **({"param_codec": param} if param is not DEFAULT else {}))
    trainer = None
    if method.startswith("diloco"):
        import commpress.local

        inside = next(iter(model.parameters())).device_mesh.get_group()  # type: ignore[attr-defined]
        trainer = commpress.local.DiLoCo(model, opt, replica_group=inside, **diloco_params)
        trainer.__enter__()
    bf16 = method.endswith("bf16") or (method.startswith(("cp-", "diloco")) and "mp=bf16" in method)
    sharded_over = world if trainer is None else dist.get_world_size(trainer.replica_group)
    fsdp_ag, fsdp_rs = fsdp_wire(model, sharded_over, 2 if bf16 else 4, 2 if bf16 else 4)
    x_ho, y_ho = heldout[0][rank::world], heldout[1][rank::world]

    def evaluate() -> float:
        with torch.no_grad():
            replica = None
            if trainer is not None and trainer.step < args.steps:  # DiLoCo: the global copy, not the replica
                replica = trainer.flat_params()
                trainer.set_params(torch.cat([g.reshape(-1) for g in trainer.global_params]))
            total = torch.tensor([float(lm_loss(model, x_ho, y_ho)) * y_ho.numel(), float(y_ho.numel())],
                                 dtype=torch.float64)
            if replica is not None:
                trainer.set_params(replica)
        dist.all_reduce(total)
        return float(total[0] / total[1])

    def wire() -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        s = state.stats()
        return s.get("allgather_bytes_wire", 0.0), s["bytes_wire"]

    step_s: list[float] = []
    curve: list[tuple[int, float, float]] = []
    train_s = 0.0
    eval_ag = eval_rs = 0.0
    warm = min(2, args.steps - 1)
    tx0, w0 = tx_bytes(), wire()
    eval_every = max(1, args.steps // args.points)
    due = eval_every
    for step in range(args.steps):
        if step == warm:
            tx0, w0 = tx_bytes(), wire()
            eval_ag = eval_rs = 0.0
        t0 = time.perf_counter()
        loss = lm_loss(model, *text.batch(step, rank, args.batch, seed=args.seed))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if trainer is not None and step == args.steps - 1:
            trainer.finish()  # merge the sync in flight, sync the last steps, load the global copy (timed)
            trainer.__exit__(None, None, None)
        dt = time.perf_counter() - t0
        train_s += dt
        if step >= warm:
            step_s.append(dt)
        if (step + 1 >= due and (trainer is None or synced_at(trainer, step + 1))) or step == args.steps - 1:
            due = ((step + 1) // eval_every + 1) * eval_every
            before = wire()
            tx_e = tx_bytes()
            value = evaluate()
            after = wire()
            eval_ag += after[0] - before[0]
            eval_rs += after[1] - before[1]
            if tx0 is not None and tx_e is not None:
                tx0 += (tx_bytes() or 0) - tx_e  # evaluation traffic is not training traffic
            curve.append((step + 1, train_s, value))
            if rank == 0 and args.progress:
                print(f"  [{method}] step {step + 1}: held-out {value:.4f}, {train_s:.1f} s", file=sys.stderr, flush=True)
    timed = max(args.steps - warm, 1)
    tx1, w1 = tx_bytes(), wire()
    measured = None if tx0 is None or tx1 is None else (tx1 - tx0) / timed
    if trainer is not None:  # FSDP's own traffic inside the node, plus DiLoCo's outer bytes (per step) across
        ag, rs = fsdp_ag, fsdp_rs + trainer.stats()["bytes_sent"] / args.steps
        # DiLoCo's state on this rank: the global copy, its outer gradient and the working delta (each of the
        # synced shard's size: docs/local.md), plus the outer optimizer's (none at the default plain SGD)
        cstate = 3 * tensor_bytes(trainer.global_params) + tensor_bytes(
            v for st in trainer.outer_optimizer.state.values() for v in st.values())
    elif state is None:
        ag, rs = fsdp_ag, fsdp_rs
        cstate = 0
    else:
        s = state.stats()
        ag = (w1[0] - w0[0] - eval_ag) / timed if "allgather_bytes_wire" in s else fsdp_ag
        rs = (w1[1] - w0[1] - eval_rs) / timed
        cstate = int(s["compression_state_bytes"]) + int(s.get("allgather_kept_peak_bytes", 0))
    opt_state = sum(tensor_bytes(local(v) for v in st.values()) for st in opt.state.values())
    param_shard = tensor_bytes(local(p.data) for p in model.parameters())
    grad_shard = param_shard  # FSDP keeps the reduced gradient shard in the parameters' dtype
    gathered = [None] * world
    dist.all_gather_object(gathered, {"measured_tx": measured, "cstate": cstate})
    dist.barrier()
    return {
        "method": method, "params": numel, "median_step_s": statistics.median(step_s), "curve": curve,
        "final_loss": curve[-1][2], "ag_bytes": ag, "rs_bytes": rs, "fsdp_bf16_bytes": sum(fsdp_wire(model, world, 2, 2)),
        "measured_tx": [g["measured_tx"] for g in gathered],  # type: ignore[index]
        "param_shard_bytes": param_shard, "grad_shard_bytes": grad_shard, "optimizer_bytes": opt_state,
        "compression_bytes": max(g["cstate"] for g in gathered),  # type: ignore[index]
        "stats": ({k: v for k, v in trainer.stats().items() if isinstance(v, (int, float))} if trainer is not None
                  else {} if state is None else {k: v for k, v in state.stats().items() if isinstance(v, (int, float))}),
        "auto": [] if state is None else [[row["module"], row["reduce_scatter"], row["all_gather"]]
                                          for row in state.auto_report()],
    }


def rank_main(args: argparse.Namespace) -> int:
    from commpress.demo.workloads import TextBatches

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    text = TextBatches(context=args.context)
    heldout = text.heldout(args.heldout)
    results = []
    for method in args.methods.split(";"):
        res = run_method(method, args, text, heldout, args.rank, args.world)
        if args.rank == 0:
            print(f"[fsdp-lm] x{args.world} {method}: median step {res['median_step_s']:.3f} s, "
                  f"final loss {res['final_loss']:.4f}, AG {res['ag_bytes'] / 1e6:.2f} MB RS {res['rs_bytes'] / 1e6:.2f} MB",
                  file=sys.stderr, flush=True)
            if res["auto"]:
                st = res["stats"]
                print(f"[fsdp-lm] x{args.world} {method} (link {st.get('auto_link_gbit', 0):.2f} Gbit/s, alpha "
                      f"{st.get('auto_link_alpha_s', 0) * 1e6:.0f} us, calibrated in {st.get('auto_calibration_s', 0):.2f} s) "
                      "chose (module: reduce-scatter/all-gather): "
                      + ", ".join(f"{m}: {rs}/{ag}" for m, rs, ag in res["auto"]), file=sys.stderr, flush=True)
        results.append(res)
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "results": results}, f)
    dist.destroy_process_group()
    return 0


# ----- the driver ----------------------------------------------------------------------------------
def time_to(curve: list[list[float]], target: float) -> float | None:
    return next((c[1] for c in curve if c[2] <= target), None)


def table(data: dict[str, Any]) -> list[str]:
    res = data["results"]
    if not any(r["method"] == "fp32" for r in res):  # rows run apart from their fp32 baseline: no target
        res = [{"method": "fp32", "final_loss": float("nan"), "curve": []}, *res]
        data = {**data, "results": res}
    base = next(r for r in res if r["method"] == "fp32")
    # the bf16 baseline: FSDP's MixedPrecisionPolicy, else its bytes with fp32 compute (bf16 math is ~8x slower on AVX2 CPUs)
    bf16 = next((r for r in res if r["method"] == "bf16"), None) or next(
        (r for r in res if r["method"] == "cp-bf16@param=bf16"), None)
    target = base["final_loss"] * LOSS_TARGET
    t_bf16 = time_to(bf16["curve"], target) if bf16 else None
    cluster = bool(data.get("nodes"))
    tx_of = {r["method"]: max((m for m in r.get("measured_tx", []) if m is not None), default=float("nan"))
             for r in res}
    head = ("| method | AG MB/step | RS MB/step | total vs bf16 | "
            + ("cross-node tx MB/node/step (measured) | bf16's cross-node / this |" if cluster
               else "tx MB/step (measured) |") + " median step (s) | "
            "held-out loss | vs fp32 | time to target (s) | vs bf16 | memory MB (params+grads+optim+commpress) |")
    lines = [f"Target: held-out loss {target:.4f} (FSDP fp32's final x {LOSS_TARGET}); bytes per rank and step.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in res:
        if "ag_bytes" not in r:  # the placeholder baseline
            continue
        t = time_to(r["curve"], target)
        total = r["ag_bytes"] + r["rs_bytes"]
        tx = [m for m in r["measured_tx"] if m is not None]
        mem = [r["param_shard_bytes"], r["grad_shard_bytes"], r["optimizer_bytes"], r["compression_bytes"]]
        lines.append(
            f"| {r['method']} | {r['ag_bytes'] / 1e6:.2f} | {r['rs_bytes'] / 1e6:.2f} | "
            f"{r['fsdp_bf16_bytes'] / total:.2f}x | {max(tx) / 1e6 if tx else float('nan'):.2f} | "
            + (f"{tx_of.get('bf16', float('nan')) / max(tx):.1f}x | " if cluster and tx else "| " if cluster else "")
            + f"{r['median_step_s']:.3f} | {r['final_loss']:.4f} | {100 * (r['final_loss'] / base['final_loss'] - 1):+.2f}% | "
            + ("not reached | - |" if t is None else f"{t:.1f} | " + (f"{t_bf16 / t:.2f}x faster |" if t_bf16 else "- |"))
            + f" {' + '.join(f'{m / 1e6:.1f}' for m in mem)} |"
        )
    for r in res:
        if r.get("auto"):
            lines += ["", f"`{r['method']}` chose (module: reduce-scatter / all-gather): "
                      + ", ".join(f"{m}: {rs} / {ag}" for m, rs, ag in r["auto"]) + "."]
    return lines


def plot(runs: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (key, data) in zip(axes[0], runs.items()):
        for r in data["results"]:
            ax.plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], label=r["method"])
        ax.set_title(key)
        ax.set_xlabel("training wall-clock time (s)")
        ax.set_ylabel("held-out loss (nats)")
        ax.legend(fontsize=7)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def driver(args: argparse.Namespace, rest: list[str]) -> int:
    from shaped_net import ShapedNetwork

    runs: dict[str, dict[str, Any]] = {}
    port = 29900 + os.getpid() % 500
    t0 = time.monotonic()
    for link in args.links.split(","):
        nodes = args.nodes or args.world
        with ShapedNetwork(nodes, None if link == "unshaped" else link, ranks_per_node=args.world // nodes) as net:
            out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name

            def argv(r: int, net: Any = net, out: str = out) -> list[str]:
                return [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--master", net.addr(0),
                        "--port", str(port), "--out", out, *rest]

            codes = net.run(argv, args.timeout)
            if any(codes):
                raise SystemExit(f"a rank failed (exit codes {codes}); see its output above")
            shaped = net.shaped
        port += 1
        with open(out) as f:
            data = json.load(f)
        os.unlink(out)
        layout = f"{args.world} ranks" if not args.nodes else f"{args.nodes} nodes x {args.world // args.nodes} ranks"
        key = f"{layout}, {link}" + ("" if shaped or link == "unshaped" else " (NOT shaped: loopback)")
        runs[key] = {**data, "nodes": args.nodes}
    r0 = next(iter(runs.values()))["results"][0]
    intro = (f"ByteLM dim {args.dim}, {args.layers} blocks, MLP {args.ffn} wide, context {args.context} ({r0['params']:,} parameters), "
             f"`fully_shard` per block and the root, {args.optim} lr={args.lr}, batch {args.batch} windows per rank, "
             f"{args.steps} steps, torch {torch.__version__}, gloo, one thread per rank; "
             f"held-out: {args.heldout} windows. Command: `python scripts/bench_fsdp_lm.py {' '.join(sys.argv[1:])}`.")
    lines = [intro, ""]
    for key, data in runs.items():
        lines += [f"**{key}**", "", *table(data), ""]
    print("\n".join(lines))
    print(f"total {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    if args.doc:
        from bench_e2e import write_doc

        plot(runs, os.path.join(ROOT, "docs", "img", "fsdp_lm_loss_vs_time.png"))
        lines += ["![held-out loss vs time](img/fsdp_lm_loss_vs_time.png)"]
        write_doc(os.path.join(ROOT, "docs", "benchmarks.md"), lines, START, END)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="1gbit", help="comma-separated: unshaped, 10gbit, 1gbit, ...")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=0,
                    help="an emulated cluster: --world ranks on this many hosts (shaped links between them, loopback inside); "
                         "the measured tx column is then each node's cross-node bytes")
    ap.add_argument("--methods", default=";".join(DEFAULT_METHODS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--points", type=int, default=10, help="held-out evaluations per run")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and batch order (0: the tables' runs)")
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--dim", type=int, default=160)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=4096, help="MLP width of each block (wide: communication-bound)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step (8 x 64: past the unigram plateau fp32 sits on at 4 x 32)")
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="loopback, 12 steps, a small model")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--doc", action="store_true", help="write the tables into docs/benchmarks.md")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.nodes and (args.nodes < 2 or args.world % args.nodes or args.world == args.nodes):
        ap.error(f"--nodes {args.nodes} must be >= 2 and divide --world {args.world} into nodes of >= 2 ranks")
    if args.lr is None:
        args.lr = 1e-3 if args.optim == "adamw" else 0.05
    if args.quick:
        args.links, args.steps, args.dim, args.layers, args.ffn, args.points = "unshaped", 12, 64, 2, 256, 3
    if args.rank is not None:
        return rank_main(args)
    rest = ["--world", str(args.world), "--methods", args.methods, "--steps", str(args.steps), "--points",
            str(args.points), "--optim", args.optim, "--lr", str(args.lr), "--dim", str(args.dim), "--layers",
            str(args.layers), "--heads", str(args.heads), "--ffn", str(args.ffn), "--context", str(args.context), "--batch",
            str(args.batch), "--heldout", str(args.heldout), "--seed", str(args.seed), *(["--progress"] if args.progress else [])]
    return driver(args, rest)


if __name__ == "__main__":
    sys.exit(main())
