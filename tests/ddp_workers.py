"""Multi-process helpers for the DDP hook tests: a launcher with a hard timeout and the workers.

Workers run in processes started by ``torch.multiprocessing.spawn`` (gloo on CPU, one thread
each) and assert themselves: a failed assertion on a rank surfaces in the parent as a
``ProcessRaisedException`` carrying the child's traceback. Every assertion that could differ
between ranks is made on all-gathered values, so all ranks fail together instead of leaving
the others blocked in a collective. Run as a script (``python -m torch.distributed.run
--nproc-per-node 2 tests/ddp_workers.py``) it is the torchrun smoke test.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
import commpress.ddp
from commpress.comm import all_gather_single

BUCKET_CAP_MB = 0.05  # ~13k float32 per bucket: the Net below makes 4 buckets after the rebuild
COLLECTIVE_TIMEOUT_S = 90  # a hang inside gloo raises instead of blocking the suite

# (codec, options) run by the matrix at 2 and 4 ranks.
MATRIX_CASES: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"ratio": 0.01}),
    ("randomk", {"ratio": 0.01, "scaled": False, "warmup_steps": 0}),  # compressing from step 0
    ("randomk", {"ratio": 0.05, "error_feedback": False}),
    ("sign", {"block_size": 256}),
    ("sign", {}),
    ("qsgd", {"bits": 4}),
    ("qsgd", {"bits": 8, "error_feedback": True}),
    ("topk", {"ratio": 0.05, "algorithm": "twophase"}),
    ("sign", {"block_size": 64, "algorithm": "allgather"}),
    ("topk", {"ratio": 0.01, "warmup_steps": 5}),
]


# ----- launching -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    faulthandler.enable(all_threads=True)  # a native crash (SIGSEGV/SIGABRT) prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        fn(rank, world, *args)
        _quiesce()
    finally:
        dist.destroy_process_group()


def _quiesce() -> None:
    """Free every DDP model, then synchronise, before ``destroy_process_group``.

    A DDP reducer still alive when the process group is destroyed makes torch 2.13 abort at
    exit now and then ("terminate called without an active exception", SIGABRT), with or
    without a comm hook (measured: 4 of 8 plain-DDP torchrun runs); freeing them first fixes it.
    """
    gc.collect()
    dist.barrier()


def launch(fn: Callable[..., None], world: int, *args: Any, timeout: float = 200.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; fail after ``timeout``."""
    ctx = mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=False)
    assert ctx is not None
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s (hang?)")


# ----- models and data ---------------------------------------------------------------------------
class Net(nn.Module):
    """An MLP with a LayerNorm and an optional side branch; 4 DDP buckets at BUCKET_CAP_MB."""

    def __init__(self, d_in: int = 32, width: int = 128, d_out: int = 10, branch: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.h1 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.h2 = nn.Linear(width, width)
        self.h3 = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)
        self.branch = nn.Linear(width, width) if branch else None

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.norm(torch.relu(self.h1(h)))
        if use_branch and self.branch is not None:
            h = h + torch.tanh(self.branch(h))
        h = torch.relu(self.h2(h))
        h = torch.relu(self.h3(h))
        return self.out(h)


def batch(rank: int, step: int, n: int = 16, d_in: int = 32, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * rank + step)
    x = torch.randn(n, d_in, generator=g).to(dtype)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def make_ddp(dtype: torch.dtype = torch.float32, branch: bool = False, **ddp_kwargs: Any) -> DDP:
    torch.manual_seed(0)
    model = Net(branch=branch).to(dtype)
    return DDP(model, bucket_cap_mb=BUCKET_CAP_MB, **ddp_kwargs)


# ----- cross-rank checks ---------------------------------------------------------------------------
def digest(model: nn.Module) -> int:
    """A hash of every parameter's bytes (bit-level, NaN-safe)."""
    h = torch.zeros((), dtype=torch.int64)
    for p in model.parameters():
        b = p.detach().reshape(-1).contiguous().view(torch.uint8).to(torch.int64)
        w = torch.arange(b.numel(), dtype=torch.int64) % 65521 + 1
        h = h * 1_000_003 + (b * w).sum()
    return int(h)


def assert_same_across_ranks(model: nn.Module, what: str) -> None:
    mine = torch.tensor([digest(model)], dtype=torch.int64)
    everyone = torch.empty(dist.get_world_size(), dtype=torch.int64)
    all_gather_single(everyone, mine)
    assert bool((everyone == everyone[0]).all()), f"{what}: parameters differ across ranks {everyone.tolist()}"


def assert_all_ranks(ok: bool, what: str) -> None:
    """Fail on every rank when the condition fails on any rank."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    assert int(flag) == 0, f"{what} (failed on {int(flag)} rank(s))"


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def train_step(
    ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int, *, dtype: torch.dtype = torch.float32,
    use_branch: bool = False, accumulate: int = 1, scaler: torch.amp.GradScaler | None = None,
    poison: bool = False,
) -> None:
    opt.zero_grad(set_to_none=True)
    for micro in range(accumulate):
        x, y = batch(rank, step * accumulate + micro, dtype=dtype)
        if poison:
            x = x * float("inf")
        last = micro == accumulate - 1
        ctx = ddp.no_sync() if not last else _nullcontext()
        with ctx:
            loss = F.cross_entropy(ddp(x, use_branch=use_branch).float(), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _codec_label(codec: str, opts: dict[str, Any]) -> str:
    return codec + "(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"


def _write(outdir: str | None, name: str, payload: Any) -> None:
    if outdir is not None:
        Path(outdir, name).write_text(json.dumps(payload, indent=1, sort_keys=True))


# ----- worker: every codec, multi-bucket, identical parameters -----------------------------------
def worker_matrix(rank: int, world: int, steps: int, outdir: str | None) -> None:
    """Every codec in MATRIX_CASES for ``steps`` steps: no hang, bit-identical parameters after
    every step, >= 4 buckets; codec ``none`` equals DDP without a hook exactly."""
    report: dict[str, Any] = {}
    # Reference: DDP without a hook.
    ref = make_ddp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        train_step(ref, opt, rank, step)
    ref_params = flat_params(ref)
    for codec, opts in MATRIX_CASES:
        label = _codec_label(codec, opts)
        t_case = time.perf_counter()
        ddp = make_ddp()
        state = commpress.ddp.register(ddp, codec, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        buffers_before = 0.0
        for step in range(steps):
            buffers_before = state.counters.as_dict()["buffers"]
            train_step(ddp, opt, rank, step)
            assert_same_across_ranks(ddp, f"{label} step {step}")
        buckets_last_step = state.counters.as_dict()["buffers"] - buffers_before
        assert buckets_last_step >= 4, f"{label}: only {buckets_last_step} buckets"
        assert state.step == steps
        assert_all_ranks(bool(torch.isfinite(flat_params(ddp)).all()), f"{label}: non-finite parameters")
        if codec == "none":
            assert torch.equal(flat_params(ddp), ref_params), "codec none differs from DDP without a hook"
        report[label] = {"buckets": buckets_last_step, "wall_s": time.perf_counter() - t_case, **state.stats()}
    if rank == 0:
        _write(outdir, f"matrix_{world}.json", report)


# ----- worker: DDP features, half precision, non-finite gradients --------------------------------
FEATURE_CODECS: list[tuple[str, dict[str, Any]]] = [
    ("topk", {"ratio": 0.02}),
    ("randomk", {"ratio": 0.02, "scaled": False}),
    ("sign", {"block_size": 128}),
    ("qsgd", {"bits": 4}),
]

FEATURES: list[tuple[str, dict[str, Any]]] = [
    ("gradient_as_bucket_view", {"ddp": {"gradient_as_bucket_view": True}}),
    ("find_unused_parameters", {"ddp": {"find_unused_parameters": True}, "branch": True}),
    ("no_sync", {"accumulate": 2}),
    ("bf16_params", {"dtype": torch.bfloat16}),
    ("fp16_params", {"dtype": torch.float16}),
]


def _feature_run(rank: int, feature: dict[str, Any], codec: str | None, opts: dict[str, Any], steps: int) -> DDP:
    dtype = feature.get("dtype", torch.float32)
    ddp = make_ddp(dtype=dtype, branch=feature.get("branch", False), **feature.get("ddp", {}))
    if codec is not None:
        commpress.ddp.register(ddp, codec, **opts)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        # the side branch: used by rank 0 on every third step, by nobody otherwise
        use_branch = feature.get("branch", False) and step % 3 == 0 and rank == 0
        train_step(ddp, opt, rank, step, dtype=dtype, use_branch=use_branch, accumulate=feature.get("accumulate", 1))
        if codec is not None:
            assert_same_across_ranks(ddp, f"{feature} {codec} step {step}")
    return ddp


def worker_features(rank: int, world: int, steps: int) -> None:
    """gradient_as_bucket_view, find_unused_parameters, no_sync, fp16/bf16 parameters: codec
    ``none`` equals DDP without a hook exactly, compressed codecs keep ranks identical."""
    for name, feature in FEATURES:
        ref = flat_params(_feature_run(rank, feature, None, {}, steps))
        mine = flat_params(_feature_run(rank, feature, "none", {}, steps))
        assert torch.equal(ref, mine), f"{name}: codec none differs from DDP without a hook"
        for codec, opts in FEATURE_CODECS:
            ddp = _feature_run(rank, feature, codec, opts, steps)
            assert_all_ranks(bool(torch.isfinite(flat_params(ddp)).all()), f"{name} {codec}: non-finite")


NONFINITE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("topk", {"ratio": 0.02}),
    ("randomk", {"ratio": 0.02, "scaled": False}),
    ("sign", {"block_size": 128}),
    ("qsgd", {"bits": 4}),
    ("sign", {"block_size": 128, "algorithm": "allgather"}),
]


def _residuals(state: commpress.ddp.CompressionState) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for tag, fb in (("w", state.feedback), ("s", state.server_feedback)):
        if fb is not None:
            for k in fb.keys():
                r = fb.residual(k)
                assert r is not None
                out[f"{tag}:{k}"] = r.clone()
    return out


def worker_nonfinite(rank: int, world: int, bad_step: int, steps: int) -> None:
    """Rank 1 alone gets an Inf input at ``bad_step``: no hang, every rank sees NaN, GradScaler
    skips the step on every rank, residuals are as before the step, training then resumes."""
    for codec, opts in NONFINITE_CASES:
        label = _codec_label(codec, opts)
        ddp = make_ddp()
        state = commpress.ddp.register(ddp, codec, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(steps):
            before = flat_params(ddp)
            res_before = _residuals(state)
            scale_before = scaler.get_scale()
            poison = step == bad_step and rank == 1
            train_step(ddp, opt, rank, step, scaler=scaler, poison=poison)
            assert_same_across_ranks(ddp, f"{label} step {step}")
            if step == bad_step:
                grads_nan = all(not bool(torch.isfinite(p.grad).all()) for p in ddp.parameters() if p.grad is not None)
                assert_all_ranks(grads_nan, f"{label}: every gradient slot must be NaN on every rank")
                assert_all_ranks(torch.equal(before, flat_params(ddp)), f"{label}: the step was not skipped")
                assert_all_ranks(scaler.get_scale() < scale_before, f"{label}: GradScaler did not back off")
                res_after = _residuals(state)
                same = res_after.keys() == res_before.keys() and all(
                    torch.equal(res_after[k], res_before[k]) for k in res_before
                )
                assert_all_ranks(same, f"{label}: residuals changed on a voided step")
            else:
                assert_all_ranks(not torch.equal(before, flat_params(ddp)), f"{label}: step {step} did not update")
        if codec != "none":
            st = state.stats()
            counts = torch.tensor([st["nonfinite_local"], st["nonfinite_slots"]], dtype=torch.int64)
            everyone = torch.empty(2 * world, dtype=torch.int64)
            all_gather_single(everyone, counts)
            local, voided = everyone[0::2].tolist(), everyone[1::2].tolist()
            assert local[0] == 0 and local[1] > 0 and voided[0] == voided[1] > 0, f"{label}: {local} {voided}"


def worker_features_and_nonfinite(rank: int, world: int, steps: int) -> None:
    worker_features(rank, world, steps)
    worker_nonfinite(rank, world, bad_step=3, steps=6)
    worker_bad_load(rank, world)


def worker_bad_load(rank: int, world: int) -> None:
    """load_state_dict rejects an impossible world size, another rank, codec and shapes with clear errors."""
    ddp = make_ddp()
    state = commpress.ddp.register(ddp, "topk", ratio=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    train_step(ddp, opt, rank, 0)
    good = state.state_dict()
    cases = [
        ("world_size", 0, "world_size must be a positive int"),  # another size loads: tests/test_elastic.py
        ("rank", (rank + 1) % world, "rank mismatch"),
        ("codec", {"name": "topk", "ratio": 0.02, "k": None}, "codec mismatch"),
        ("shapes", {**good["shapes"], "h1.weight": [3, 3]}, "compressed parameters differ"),
        # hostile checkpoints (#12 item 6): a codec that is not a config, an absurd step
        ("codec", "topk", "codec must be a codec's config() mapping"),
        ("codec", 7, "codec must be a codec's config() mapping"),
        ("step", 2**70, "step must be an int in [0, 2**62)"),
        ("feedback", {**good["feedback"], "residuals": {
            k: torch.full_like(v, 1e30) for k, v in good["feedback"]["residuals"].items()}}, "plausible magnitude"),
    ]
    for field, value, message in cases:
        bad = dict(good)
        bad[field] = value
        try:
            state.load_state_dict(bad)
        except ValueError as exc:
            assert message in str(exc), f"{field}: unexpected message {exc}"
        else:
            raise AssertionError(f"load_state_dict accepted a bad {field}")
    bad_res = dict(good)
    fb = dict(good["feedback"])
    fb["residuals"] = {**fb["residuals"], "h1.weight": torch.zeros(2, 2)}
    bad_res["feedback"] = fb
    try:
        state.load_state_dict(bad_res)
    except ValueError as exc:
        assert "h1.weight" in str(exc)
    else:
        raise AssertionError("load_state_dict accepted a residual of the wrong shape")
    assert state.step == 1  # nothing was applied by the failed loads
    state.load_state_dict(good)
    # Ranks registering different configurations fail together at registration, not in a hang.
    try:
        commpress.ddp.register(make_ddp(), "topk", ratio=0.01 if rank == 0 else 0.02)
    except commpress.CodecError as exc:
        assert "configured differently" in str(exc), exc
    else:
        raise AssertionError("mismatched configurations were accepted")


# ----- worker: checkpoint and resume in fresh processes -----------------------------------------------
CKPT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("topk", {"ratio": 0.01}),
    ("topk", {"ratio": 0.01, "momentum": 0.9}),
    ("randomk", {"ratio": 0.02, "scaled": False}),
    ("sign", {"block_size": 128}),
    ("qsgd", {"bits": 4}),
]


def worker_checkpoint(rank: int, world: int, phase: str, outdir: str, half: int) -> None:
    """``phase="full"``: run 2*half steps, checkpoint at ``half``; ``"resume"``: fresh model,
    DDP and hook state loaded from the checkpoint, run the second half; compare exactly."""
    for i, (codec, opts) in enumerate(CKPT_CASES):
        ddp = make_ddp()
        state = commpress.ddp.register(ddp, codec, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.0 if "momentum" in opts else 0.9)
        path = Path(outdir, f"ckpt_{i}_rank{rank}.pt")
        final = Path(outdir, f"final_{i}_rank{rank}.pt")
        start = 0
        if phase == "resume":
            ckpt = torch.load(path, weights_only=True)
            ddp.module.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optim"])
            state.load_state_dict(ckpt["commpress"])
            start = half
        for step in range(start, 2 * half):
            if phase == "full" and step == half:
                torch.save(
                    {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "commpress": state.state_dict()},
                    path,
                )
            train_step(ddp, opt, rank, step)
            assert_same_across_ranks(ddp, f"{codec} {phase} step {step}")
        # the byte counters travel with the checkpoint: stats() after a resume equals the uninterrupted run's
        # (buckets and frame headers may differ: a fresh DDP buckets its first step differently)
        counted = ("steps", "counted_steps", "dense_bytes", "dense_bytes_per_step")
        stats = torch.tensor([float(state.stats()[k]) for k in counted], dtype=torch.float64)
        if phase == "full":
            torch.save({"params": flat_params(ddp), "stats": stats}, final)
        else:
            expected = torch.load(final, weights_only=True)
            assert_all_ranks(torch.equal(expected["params"], flat_params(ddp)), f"{codec}: resumed run differs from the uninterrupted one")
            assert_all_ranks(torch.equal(expected["stats"], stats), f"{codec}: stats() after resume {stats} != {expected['stats']}")


# ----- torchrun entry point -----------------------------------------------------------------------
def main() -> int:
    """torchrun smoke test: register on every codec family, 10 steps, identical parameters."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    _torchrun_smoke(dist.get_rank(), dist.get_world_size())
    _quiesce()
    dist.destroy_process_group()
    return 0


def _torchrun_smoke(rank: int, world: int) -> None:
    for codec, opts in [("topk", {"ratio": 0.01}), ("randomk", {"ratio": 0.01}), ("sign", {"block_size": 256})]:
        ddp = make_ddp()
        state = commpress.ddp.register(ddp, codec, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(10):
            train_step(ddp, opt, rank, step)
            assert_same_across_ranks(ddp, f"torchrun {codec} step {step}")
        if rank == 0:
            print(f"torchrun ok: {codec} world={world} ratio={state.stats()['compression_ratio']:.1f}")


if __name__ == "__main__":
    sys.exit(main())


def worker_compile(rank: int, world: int, steps: int) -> None:
    """``torch.compile(DDP(model))`` with the top-k and sign hooks: ranks identical, the hook ran every step."""
    for codec, opts in (("topk", {"ratio": 0.05}), ("sign", {})):
        torch.manual_seed(0)
        ddp = DDP(Net())  # DDP's own buckets: dynamo's DDPOptimizer wants the first no larger than the rest
        before = flat_params(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        state = commpress.ddp.register(ddp, codec, optimizer=opt, **opts)
        compiled = torch.compile(ddp)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            x, y = batch(rank, step)
            F.cross_entropy(compiled(x), y).backward()
            opt.step()
        s = state.stats()
        assert_same_across_ranks(ddp, f"compiled DDP with {codec}")
        assert_all_ranks(s["steps"] == steps, f"{codec}: the hook counted {s['steps']} of {steps} compiled steps")
        assert_all_ranks(0 < s["bytes_sent"] < s["dense_bytes"] / 4,
                         f"{codec}: compressed bytes {s['bytes_sent']} vs dense {s['dense_bytes']}")
        assert_all_ranks(bool((flat_params(ddp) != before).any()), f"{codec}: the compiled model did not train")
