"""Rank programs of the hierarchical DDP tests (tests/ddp/test_hierarchical.py): 4 gloo ranks as 2 nodes x 2.

One launch runs every scenario (a spawn of 4 ranks costs seconds on 2 cores); rank 0 writes a
JSON report the test reads. Every cross-rank assertion is made on all-gathered values, so all
ranks fail together.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress.ddp

from ddp_workers import assert_all_ranks, assert_same_across_ranks, flat_params, make_ddp

L = 2  # ranks per node

#: (label, codec, options) trained hierarchical and flat, compared in bytes and loss
CODECS: list[tuple[str, str, dict[str, Any]]] = [
    ("topk", "topk", {"ratio": 0.01}),
    ("sign", "sign", {}),
    ("sign-twophase", "sign", {"algorithm": "twophase"}),
    ("qsgd", "qsgd", {"bits": 4}),
    ("randomk", "randomk", {"ratio": 0.05}),
    ("fp16", "fp16", {}),
]

_TEACHER = torch.Generator().manual_seed(7)
_W = torch.randn(32, 10, generator=_TEACHER)


def learnable_batch(rank: int, step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch labelled by a fixed linear teacher (so the loss can fall), 8 batches per rank cycled."""
    g = torch.Generator().manual_seed(1000 * rank + step % 8)
    x = torch.randn(n, 32, generator=g)
    return x, (x @ _W).argmax(dim=1)


def step_once(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    """One training step on this rank's batch; its loss."""
    opt.zero_grad(set_to_none=True)
    x, y = learnable_batch(rank, step)
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def mean_loss(ddp: DDP) -> float:
    """Loss of the (identical) model on a fixed held-out set, the same on every rank."""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(256, 32, generator=g)
    with torch.no_grad():
        return float(F.cross_entropy(ddp.module(x), (x @ _W).argmax(dim=1)))


def residuals(fb: Any) -> dict[str, torch.Tensor]:
    """The residuals an ErrorFeedback holds, by key (None: none)."""
    return {} if fb is None else {k: fb.residual(k) for k in fb.keys()}


def _sgd(ddp: DDP) -> torch.optim.Optimizer:
    return torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def case_none_equals_dense(rank: int, steps: int) -> dict[str, Any]:
    """Codec none on 2 x 2: equal to DDP without a hook at fp32 rounding, bit-identical across ranks."""
    hier, plain = make_ddp(), make_ddp()
    state = commpress.ddp.register(hier, "none", local_world_size=L)
    assert state.algorithm == "hierarchical" and state.inner_algorithm == "allreduce", state
    opt_h, opt_p = torch.optim.SGD(hier.parameters(), lr=0.05), torch.optim.SGD(plain.parameters(), lr=0.05)
    worst = 0.0
    for step in range(steps):
        step_once(hier, opt_h, rank, step)
        step_once(plain, opt_p, rank, step)
        assert_same_across_ranks(hier, f"none step {step}")
        a, b = flat_params(hier), flat_params(plain)
        worst = max(worst, float((a - b).abs().max()))
        assert_all_ranks(torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"none step {step}: hierarchical != dense DDP")
    s = state.stats()
    return {"max_abs_diff": worst, "inter_bytes_sent": s["inter_bytes_sent"], "intra_bytes_sent": s["intra_bytes_sent"],
            "bytes_sent": s["bytes_sent"], "dense_bytes": s["dense_bytes"], "hierarchical": s["hierarchical"],
            "inter_compression_ratio": s["inter_compression_ratio"]}


def _train(codec: str, opts: dict[str, Any], rank: int, steps: int, hierarchical: bool) -> dict[str, Any]:
    ddp = make_ddp()
    opt = _sgd(ddp)
    state = commpress.ddp.register(ddp, codec, optimizer=opt, warmup_steps=0,
                                   **({"local_world_size": L} if hierarchical else {}), **opts)
    before = mean_loss(ddp)
    for step in range(steps):
        step_once(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"{codec} {opts} hierarchical={hierarchical} step {step}")
    s = state.stats()
    residual = sum(e.numel() for e in residuals(state.feedback).values())
    return {"loss_before": before, "loss_after": mean_loss(ddp), "bytes_sent": s["bytes_sent"] / steps,
            "bytes_wire": s["bytes_wire"] / steps, "inter_bytes_sent": s["inter_bytes_sent"] / steps,
            "inter_bytes_wire": s["inter_bytes_wire"] / steps, "residual_elements": residual,
            "algorithm": state.algorithm, "inner": state.inner_algorithm}


def case_codecs(rank: int, steps: int) -> dict[str, Any]:
    """Each codec hierarchical and flat: identical ranks, loss, bytes per step."""
    return {label: {"hier": _train(codec, opts, rank, steps, True), "flat": _train(codec, opts, rank, steps, False)}
            for label, codec, opts in CODECS}


def case_frames_inside(rank: int, steps: int) -> dict[str, Any]:
    """Step 3 gathering the nodes' frames equals gathering the dense share, bit for bit, with fewer bytes in the node."""
    out: dict[str, Any] = {}
    for label, codec, opts in (("topk", "topk", {"ratio": 0.01}), ("sign", "sign", {}), ("qsgd", "qsgd", {"bits": 4})):
        runs = []
        for frames in (True, False):
            ddp = make_ddp()
            opt = _sgd(ddp)
            state = commpress.ddp.register(ddp, codec, optimizer=opt, warmup_steps=0, local_world_size=L, **opts)
            state.algorithm_impl.gather_frames = frames
            for step in range(steps):
                step_once(ddp, opt, rank, step)
            runs.append((flat_params(ddp), state.stats()))
        (p_frames, s_frames), (p_dense, s_dense) = runs
        assert_all_ranks(torch.equal(p_frames, p_dense), f"{label}: frames in the node != the dense share")
        assert_same_across_ranks(ddp, f"{label} frames")
        out[label] = {"intra_frames": s_frames["intra_bytes_sent"] / steps, "intra_dense": s_dense["intra_bytes_sent"] / steps,
                      "inter_frames": s_frames["inter_bytes_sent"] / steps, "inter_dense": s_dense["inter_bytes_sent"] / steps}
    return out


def case_resume(rank: int, half: int) -> dict[str, Any]:
    """Checkpoint at ``half``, resume on a fresh DDP model and state: bit-exact with the uninterrupted run."""
    out: dict[str, Any] = {}
    for label, codec, opts in (("topk", "topk", {"ratio": 0.01}), ("sign-twophase", "sign", {"algorithm": "twophase"})):
        ddp = make_ddp()
        opt = _sgd(ddp)
        state = commpress.ddp.register(ddp, codec, optimizer=opt, warmup_steps=0, local_world_size=L, **opts)
        saved = b""
        for step in range(2 * half):
            if step == half:
                buf = io.BytesIO()
                torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict(), "commpress": state.state_dict()}, buf)
                saved = buf.getvalue()
            step_once(ddp, opt, rank, step)
        full = flat_params(ddp)
        ckpt = torch.load(io.BytesIO(saved), weights_only=True)
        ddp2 = make_ddp()
        opt2 = _sgd(ddp2)
        state2 = commpress.ddp.register(ddp2, codec, optimizer=opt2, warmup_steps=0, local_world_size=L, **opts)
        ddp2.module.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["optim"])
        state2.load_state_dict(ckpt["commpress"])
        for step in range(half, 2 * half):
            step_once(ddp2, opt2, rank, step)
            assert_same_across_ranks(ddp2, f"{label} resumed step {step}")
        assert_all_ranks(torch.equal(full, flat_params(ddp2)), f"{label}: resumed run differs from the uninterrupted one")
        out[label] = {"residual_keys": sorted(residuals(state2.feedback)), "server_keys": sorted(residuals(state2.server_feedback))}
    return out


def case_nonfinite(rank: int) -> dict[str, Any]:
    """An Inf in rank 3's gradient at step 2 voids the step on every rank (GradScaler) and leaves residuals as they were."""
    ddp = make_ddp()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = commpress.ddp.register(ddp, "topk", ratio=0.01, warmup_steps=0, local_world_size=L, optimizer=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    saved: dict[str, torch.Tensor] = {}
    params = torch.empty(0)
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        x, y = learnable_batch(rank, step)
        if step == 2 and rank == 3:
            x = x * float("inf")
        if step == 2:
            saved = {k: v.clone() for k, v in residuals(state.feedback).items()}
            params = flat_params(ddp)
        scaler.scale(F.cross_entropy(ddp(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        assert_same_across_ranks(ddp, f"nonfinite step {step}")
        if step == 2:
            after = residuals(state.feedback)
            assert_all_ranks(torch.equal(params, flat_params(ddp)), "the poisoned step moved the parameters")
            assert_all_ranks(bool(saved) and sorted(after) == sorted(saved) and all(torch.equal(after[k], saved[k]) for k in saved),
                             "the voided step changed residuals")
    return {"nonfinite_slots": state.stats()["nonfinite_slots"]}


def case_warmup(rank: int) -> dict[str, Any]:
    """Warm-up steps through a codec (8-bit QSGD, the default) cross the nodes hierarchical too: 1/L of flat's share."""
    out: dict[str, Any] = {}
    for label, kwargs in (("hier", {"local_world_size": L}), ("flat", {})):
        ddp = make_ddp()
        opt = _sgd(ddp)
        state = commpress.ddp.register(ddp, "topk", optimizer=opt, ratio=0.01, warmup_steps=3, **kwargs)
        for step in range(3):  # warm-up only
            step_once(ddp, opt, rank, step)
            assert_same_across_ranks(ddp, f"{label} warm-up step {step}")
        s = state.stats()
        out[label] = {"bytes_sent": s["bytes_sent"] / 3, "inter_bytes_sent": s["inter_bytes_sent"] / 3,
                      "intra_bytes_sent": s["intra_bytes_sent"] / 3, "warmup_codec": repr(state.warmup_codec)}
    return out


def _same_values(values: list[float], what: str) -> None:
    mine = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    assert_all_ranks(all(torch.equal(e, everyone[0]) for e in everyone), f"{what} differ across ranks: {everyone}")


def case_auto(rank: int) -> dict[str, Any]:
    """codec='auto' on 2 x 2: a slow network compresses through the hierarchy, a fast one goes flat
    dense and flushes the share residuals; calibrated links and choices the same on every rank."""
    from auto_workers import FAST, SLOW

    ddp = make_ddp()
    opt = _sgd(ddp)
    state = commpress.ddp.register(ddp, "auto", optimizer=opt, auto_codec="topk", ratio=0.05, auto_link=SLOW,
                                   auto_interval=4, local_world_size=L, warmup_steps=0)
    assert state.algorithm == "hierarchical" and state.auto is not None and state.auto.links is not None
    for step in range(4):
        step_once(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"auto, slow network, step {step}")
    slow = state.stats()
    kept = sum(float(r.abs().sum()) for r in residuals(state.feedback).values())
    state.auto.set_link(FAST)  # the network turns fast: at the next decision (step 8) every bucket goes dense
    for step in range(4, 9):
        step_once(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"auto, fast network, step {step}")
    fast = state.stats()
    left = sum(float(r.abs().sum()) for r in residuals(state.feedback).values())
    options = [r["option"] for r in state.auto.report()]
    # calibrated on the node groups: the same links (and choices) on every rank
    ddp2 = make_ddp()
    opt2 = _sgd(ddp2)
    calibrated = commpress.ddp.register(ddp2, "auto", optimizer=opt2, local_world_size=L)
    for step in range(3):
        step_once(ddp2, opt2, rank, step)
        assert_same_across_ranks(ddp2, f"auto, calibrated, step {step}")
    links = calibrated.auto.links if calibrated.auto is not None else None
    assert links is not None
    c = calibrated.stats()
    _same_values([links.intra.alpha, links.intra.beta, links.inter.alpha, links.inter.beta, links.flat.beta,
                  *[v for k, v in sorted(c.items()) if k.endswith("_choice")]], "calibrated links and choices")
    return {"slow_compressed_buckets": slow["auto_compressed_buckets"], "slow_inter_bytes": slow["inter_bytes_sent"],
            "slow_intra_gbit": slow["auto_intra_gbit"], "slow_inter_gbit": slow["auto_inter_gbit"],
            "residual_kept": kept, "residual_left": left, "fast_options": options,
            "fast_switches": fast["auto_switches"], "calibrated_hierarchical": c["hierarchical"],
            "calibrated_intra_gbit": c["auto_intra_gbit"], "calibrated_inter_gbit": c["auto_inter_gbit"],
            "calibrated_candidate": calibrated.codec.name}


def worker_all(rank: int, world: int, outdir: str, steps: int) -> None:
    """Every scenario, in order; rank 0 writes ``hierarchical.json``."""
    report = {
        "none": case_none_equals_dense(rank, steps),
        "codecs": case_codecs(rank, steps),
        "frames": case_frames_inside(rank, steps),
        "resume": case_resume(rank, steps // 2),
        "nonfinite": case_nonfinite(rank),
        "topology": case_topology(rank),
        "flush": case_flush(rank, world),
        "auto": case_auto(rank),
        "warmup": case_warmup(rank),
    }
    if rank == 0:
        Path(outdir, "hierarchical.json").write_text(json.dumps(report, indent=1))


def case_flush(rank: int, world: int) -> dict[str, Any]:
    """Error feedback loses nothing through warm-up and the guard's dense steps (worker and server residuals).

    The loss ``sum(W * C_r)`` has a constant gradient ``C_r`` per rank, so after any mix of
    dense warm-up, compressed steps and dense steps that flush the residuals, plain SGD must
    have moved ``W`` by exactly ``-lr * steps * mean_r(C_r)``: only if every residual is added
    back with the right weight (a hierarchical worker residual L times, a server one world times).
    """
    from commpress.optim import DivergenceGuard

    consts = [torch.randn(64, 64, generator=torch.Generator().manual_seed(500 + r)) for r in range(world)]
    target_step = torch.stack(consts).mean(0)
    out: dict[str, Any] = {}
    for label, codec, opts in (("topk", "topk", {"ratio": 0.01}), ("sign-twophase", "sign", {"algorithm": "twophase"})):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64, bias=False)
        ddp = DDP(model)
        w0 = model.weight.detach().clone()
        guard = DivergenceGuard(interval=4, threshold=1e-6, dense_steps=1)
        state = commpress.ddp.register(ddp, codec, optimizer=None, local_world_size=L, warmup_steps=2,
                                       warmup_codec="dense", divergence_guard=guard, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        steps = 8  # 0-1 warm-up, 2-4 compressed (4 measured: fires), 5 dense, 6-7 compressed
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            (ddp(torch.eye(64)) * consts[rank].t()).sum().backward()  # d/dW sum(W^T C^T) = C
            opt.step()
            assert_same_across_ranks(ddp, f"flush {label}")
        # the last two steps compressed: add back what their residuals hold, as a dense step would
        left = {k: fb.residual(k) for fb in (state.feedback, state.server_feedback) if fb is not None for k in fb.keys()}
        buf = torch.zeros(64 * 64)
        plan = state.bucket_plan([model.weight], 64 * 64)
        state.flush_residuals(plan, buf)
        total = torch.zeros_like(buf)
        dist.all_reduce(total.add_(buf))
        expected = w0 - 0.1 * (steps * target_step - total.view(64, 64) / world)
        err = float((model.weight.detach() - expected).abs().max())
        assert_all_ranks(err < 1e-5, f"flush {label}: error feedback lost {err:.3g} through the dense steps")
        out[label] = {"max_err": err, "guard_fired": state.guard.fired, "residual_keys": len(left)}
    return out


def case_topology(rank: int) -> dict[str, str]:
    """Layouts that cannot be (clear errors on every rank, no hang), and torchrun's variables detected."""
    import os

    out: dict[str, str] = {}
    for label, kwargs in (("L=3", {"local_world_size": 3}), ("L=0", {"local_world_size": 0}),
                          ("by-name", {"algorithm": "hierarchical"}),
                          ("disagree", {"local_world_size": 2} if rank < 2 else {})):
        ddp = make_ddp()
        try:
            commpress.ddp.register(ddp, "topk", ratio=0.01, **kwargs)
            out[label] = ""
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = f"{type(exc).__name__}: {exc}"
    # torchrun's variables: a homogeneous 2 x 2 layout, then nodes of 3 and 1 ranks
    for label, node in (("env-2x2", rank // 2), ("env-3+1", 0 if rank < 3 else 1)):
        os.environ.update(LOCAL_WORLD_SIZE=str(2 if label == "env-2x2" else (3 if rank < 3 else 1)), GROUP_RANK=str(node))
        state = commpress.ddp.register(make_ddp(), "topk", ratio=0.01)
        out[label] = json.dumps({**state.topology.config(), "algorithm": state.algorithm, "reason": state.topology.reason})
    del os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]
    return out


# ----- faults (run by misuse_workers.launch: each rank reports its error) -----------------------------
def case_fault(rank: int, level: str) -> None:
    """Rank 1 fails at step 3 in the intra-node level (before its reduce-scatter) or the inter-node one (bytes it cannot decode)."""
    from misuse_workers import _corrupt_received

    ddp = make_ddp()
    commpress.ddp.register(ddp, "topk", ratio=0.1, local_world_size=L, warmup_steps=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    armed = [False]
    if level == "inter":
        armed = _corrupt_received(1)
    elif rank == 1:
        original = dist.all_to_all_single

        def failing(*args: Any, **kwargs: Any) -> Any:
            if armed[0]:
                raise ValueError("injected failure inside the node")
            return original(*args, **kwargs)

        dist.all_to_all_single = failing  # type: ignore[assignment]
    for step in range(10):
        armed[0] = armed[0] or step == 3
        step_once(ddp, opt, rank, step)


__all__ = ["CODECS", "case_fault", "worker_all"]
