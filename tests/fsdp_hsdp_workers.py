"""Rank program of tests/fsdp/test_fsdp_hsdp.py: FSDP2 sharded inside each node, 4 gloo ranks as 2 nodes x 2.

One launch runs every scenario (a spawn of 4 ranks costs seconds on 2 cores); rank 0 writes a
JSON report the test reads. Cross-rank checks are made on all-gathered values, so every rank
sees the same verdict.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hierarchical_workers import learnable_batch as batch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import commpress.fsdp
from commpress.errors import ConfigurationError

from ddp_workers import Net
from fsdp_workers import full_params, make_fsdp

L = 2  # ranks per node
STEPS = 12


def make_hsdp(mesh: Any, seed: int = 0) -> Net:
    """The tests' Net with every Linear, then the root, sharded on ``mesh`` (the node's ranks)."""
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.inp, model.h1, model.h2, model.h3, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, i: int, poison: bool = False) -> float:
    x, y = batch(rank, i)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    (loss * float("inf") if poison else loss).backward()
    opt.step()
    return float(loss.detach())


def same_everywhere(t: torch.Tensor) -> bool:
    """True when every rank holds ``t`` bit for bit."""
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t)
    return all(torch.equal(g, got[0]) for g in got)


def mean_loss(model: nn.Module, rank: int) -> float:
    """Loss on held-out batches, averaged over ranks."""
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(batch(rank, 1000 + i)[0]), batch(rank, 1000 + i)[1])) for i in range(4)]
    t = torch.tensor(sum(losses) / len(losses))
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def case_none_equals_fsdp(rank: int, mesh: Any) -> dict[str, Any]:
    """``none`` sharded in the node == FSDP over all 4 ranks (fp32 rounding: sums in another order)."""
    ref = make_fsdp()
    model = make_hsdp(mesh)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commpress.fsdp.register(model, "none")
    for i in range(4):
        step(ref, ref_opt, rank, i)
        step(model, opt, rank, i)
    s = state.stats()
    return {"diff": float((full_params(ref) - full_params(model)).abs().max()), "hierarchical": s["hierarchical"],
            "nodes": s["nodes"], "inter_per_step": s["inter_bytes_sent_per_step"], "shard_bytes": s["shard_bytes"],
            "allgather": state.allgather is not None}


def _train(rank: int, mesh: Any, codec: str, opts: dict[str, Any], optim: str) -> tuple[Any, ...]:
    model = make_hsdp(mesh) if mesh is not None else make_fsdp()
    opt: torch.optim.Optimizer = (torch.optim.AdamW(model.parameters(), lr=3e-3) if optim == "adamw"
                                  else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    state = commpress.fsdp.register(model, codec, optimizer=opt, **copy.deepcopy(opts))
    for i in range(STEPS):
        step(model, opt, rank, i)
    return model, opt, state


def case_codecs(rank: int, mesh: Any) -> dict[str, Any]:
    """Each codec trained sharded in the node and flat: same parameters everywhere, bytes, memory, loss."""
    out: dict[str, Any] = {}
    base, _, _ = _train(rank, mesh, "none", {}, "adamw")
    out["dense_loss"] = mean_loss(base, rank)
    for label, codec, opts, optim in (
        ("topk-adamw", "topk", {"ratio": 0.05, "warmup_steps": 2}, "adamw"),
        ("sign-sgd", "sign", {"warmup_steps": 2}, "sgd"),
        ("qsgd-sgd", "qsgd", {}, "sgd"),
        ("randomk-sgd", "randomk", {"ratio": 0.25}, "sgd"),
    ):
        model, _, state = _train(rank, mesh, codec, opts, optim)
        s = state.stats()
        flat_model, _, flat_state = _train(rank, None, codec, {**opts, "param_codec": "none"}, optim)
        fs = flat_state.stats()
        params = full_params(model)
        out[label] = {
            "same_everywhere": same_everywhere(params), "finite": bool(torch.isfinite(params).all()),
            "inter_per_step": s["inter_bytes_sent_per_step"], "intra_per_step": s["intra_bytes_sent_per_step"],
            "flat_per_step": fs["bytes_sent_per_step"], "shard_bytes": s["shard_bytes"],
            "residual_bytes": s["residual_bytes"], "velocity_bytes": s["velocity_bytes"],
            "residual_kind": state.residual_kind, "adam": state.adam is not None, "handover": state.handover is not None,
            "loss": mean_loss(model, rank), "flat_loss": mean_loss(flat_model, rank),
            "allgather": state.allgather is not None, "ratio": s["inter_compression_ratio"],
        }
    return out


RESUME_OPTS = {"ratio": 0.05, "warmup_steps": 2}


def _half_run(rank: int, mesh: Any) -> tuple[torch.Tensor, nn.Module, torch.optim.Optimizer, Any]:
    """The uninterrupted run's final parameters, and a second run stopped at half its steps (model, optimizer, state)."""
    whole, _, _ = _train(rank, mesh, "topk", RESUME_OPTS, "sgd")
    first = make_hsdp(mesh)
    opt = torch.optim.SGD(first.parameters(), lr=0.05, momentum=0.9)
    state = commpress.fsdp.register(first, "topk", optimizer=opt, **RESUME_OPTS)
    for i in range(STEPS // 2):
        step(first, opt, rank, i)
    return full_params(whole), first, opt, state


def case_resume(rank: int, mesh: Any) -> dict[str, Any]:
    """4 steps, save model shards + optimizer + commpress state, resume in fresh objects: == 8 uninterrupted."""
    opts = RESUME_OPTS
    expected, first, opt, state = _half_run(rank, mesh)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    shards = {k: v.to_local().clone() for k, v in first.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    second = make_hsdp(mesh, seed=1)
    for k, v in second.state_dict().items():
        v.to_local().copy_(shards[k])
    opt2 = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
    resumed = commpress.fsdp.register(second, "topk", optimizer=opt2, **opts)
    opt2.load_state_dict(opt_state)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for i in range(STEPS // 2, STEPS):
        step(second, opt2, rank, i)
    return {"equal": bool(torch.equal(full_params(second), expected)),
            "velocities": sorted(resumed.velocities()), "residuals": sorted(resumed.residuals())}


def case_dcp(rank: int, mesh: Any, ckpt: str) -> dict[str, Any]:
    """The same resume through ``torch.distributed.checkpoint``: model, optimizer and ``state.dcp()`` in one save."""
    opts = RESUME_OPTS
    expected, first, opt, state = _half_run(rank, mesh)
    dcp.save({"model": first.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp()}, checkpoint_id=ckpt)
    second = make_hsdp(mesh, seed=1)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
    resumed = commpress.fsdp.register(second, "topk", optimizer=opt2, **opts)
    sd = {"model": second.state_dict(), "optim": opt2.state_dict(), "commpress": resumed.dcp()}
    dcp.load(sd, checkpoint_id=ckpt)
    second.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    loaded = sorted(resumed.residuals()) == sorted(state.residuals()) and all(
        torch.equal(resumed.residuals()[k], v) for k, v in state.residuals().items())
    for i in range(STEPS // 2, STEPS):
        step(second, opt2, rank, i)
    flags = torch.tensor([float(loaded), float(torch.equal(full_params(second), expected))])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"residuals_loaded": bool(flags[0]), "equal": bool(flags[1])}


def case_nonfinite(rank: int, mesh: Any) -> dict[str, Any]:
    """An Inf on rank 3 (node 1) voids the step on every rank: NaN gradients everywhere, residuals untouched."""
    model = make_hsdp(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commpress.fsdp.register(model, "topk", ratio=0.05, optimizer=None)
    for i in range(3):
        step(model, opt, rank, i)
    before = {k: v.clone() for k, v in state.residuals().items()}
    x, y = batch(rank, 3)
    opt.zero_grad(set_to_none=True)
    (F.cross_entropy(model(x), y) * (float("inf") if rank == 3 else 1.0)).backward()
    grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    after = state.residuals()
    nan_rows = [bool(torch.isnan(model.get_parameter(n).grad.to_local()).all())  # type: ignore[union-attr]
                for n in ("h1.weight", "h2.weight")]
    flags = torch.tensor([float(all(nan_rows)), float(sorted(before) == sorted(after)
                          and all(torch.equal(before[k], after[k]) for k in before))])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"nan_everywhere": bool(flags[0]), "residuals_kept": bool(flags[1]), "any_nan": bool(torch.isnan(grads).any()),
            "nonfinite_slots": state.stats()["nonfinite_slots"]}


def case_layouts(rank: int) -> dict[str, Any]:
    """node_mesh on one node is the whole world; a 2-D mesh and a non-node sub-mesh are clear errors."""
    out: dict[str, Any] = {}
    whole = commpress.fsdp.node_mesh("cpu", local_world_size=4)
    out["one_node_size"] = whole.size()
    mesh2d = init_device_mesh("cpu", (2, L), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=mesh2d)
    try:
        commpress.fsdp.register(model, "topk", ratio=0.05)
    except ConfigurationError as exc:
        out["mesh2d_error"] = str(exc)
    interleaved = init_device_mesh("cpu", (L, 2), mesh_dim_names=("a", "b"))["a"]  # ranks {0, 2} / {1, 3}
    model = make_hsdp(interleaved)
    try:
        commpress.fsdp.register(model, "topk", ratio=0.05)
    except ConfigurationError as exc:
        out["interleaved_error"] = str(exc)
    torch.manual_seed(0)
    tied = nn.Sequential(nn.Embedding(64, 48), nn.Linear(48, 64))  # the output projection: the table's shape
    fully_shard(tied, mesh=commpress.fsdp.node_mesh("cpu", local_world_size=L))
    sign = commpress.fsdp.register(tied, "sign", optimizer=None)
    out["sign_compressed"] = {p.name: p.compressed for m in sign.modules for p in m.params}
    return out


def case_auto(rank: int, mesh: Any) -> dict[str, Any]:
    """codec='auto' sharded in the node: a slow network compresses every module's cross-node all-reduce, a fast
    one keeps it dense (then equal to codec 'none' bit for bit); calibrated, the same choices everywhere."""
    from commpress.comm.costmodel import Link

    out: dict[str, Any] = {}
    ref = make_hsdp(mesh)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    commpress.fsdp.register(ref, "none")
    for label, kwargs in (("slow", {"auto_link": Link(1e-3, 8.0 / 1e6)}), ("fast", {"auto_link": Link(1e-6, 1e-12)}),
                          ("calibrated", {})):
        model = make_hsdp(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = commpress.fsdp.register(model, "auto", **kwargs)
        for i in range(4):
            step(model, opt, rank, i)
            if label == "fast":
                step(ref, ref_opt, rank, i)
        s = state.stats()
        params = full_params(model)
        choices = torch.tensor([v for k, v in sorted(s.items()) if k.endswith("_reduce_scatter")], dtype=torch.float64)
        out[label] = {"same_everywhere": same_everywhere(params), "choices_everywhere": same_everywhere(choices),
                      "finite": bool(torch.isfinite(params).all()), "allgather": state.allgather is not None,
                      "compressed_modules": s["auto_reduce_scatter_compressed_modules"],
                      "dense_modules": s["auto_reduce_scatter_dense_modules"], "modules": len(state.modules),
                      "compressible": sum(any(p.compressed for p in m.params) for m in state.modules),
                      "inter_per_step": s["inter_bytes_sent_per_step"], "fallback": s["auto_fallback"],
                      "gbit": s.get("auto_link_gbit", -1.0)}
        if label == "fast":
            out[label]["equal_to_none"] = bool(torch.equal(params, full_params(ref)))
    return out


def worker_all(rank: int, world: int, out: str) -> None:
    mesh = commpress.fsdp.node_mesh("cpu", local_world_size=L)
    report = {
        "mesh_ranks": mesh.mesh.tolist(),
        "none": case_none_equals_fsdp(rank, mesh),
        "codecs": case_codecs(rank, mesh),
        "resume": case_resume(rank, mesh),
        "dcp": case_dcp(rank, mesh, str(Path(out).parent / "dcp")),
        "nonfinite": case_nonfinite(rank, mesh),
        "layouts": case_layouts(rank),
        "auto": case_auto(rank, mesh),
    }
    meshes = [None] * world
    dist.all_gather_object(meshes, report["mesh_ranks"])
    report["all_meshes"] = meshes
    if rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))


def worker_three_nodes(rank: int, world: int, out: str) -> None:
    """3 nodes x 2: QSGD (no residuals) crosses the nodes by the two-phase all-reduce, QSGD with error
    feedback by the all-gather; both leave every rank with the same parameters."""
    mesh = commpress.fsdp.node_mesh("cpu", local_world_size=L)
    report: dict[str, Any] = {}
    # the all-gather run keeps residuals of an unbiased codec only to force its path: its bytes count, not its loss
    for label, codec, opts in (("dense", "none", {}), ("twophase", "qsgd", {"bits": 2}),
                               ("allgather", "qsgd", {"bits": 2, "error_feedback": True, "divergence_guard": False})):
        model, _, state = _train(rank, mesh, codec, opts, "sgd")
        s = state.stats()
        params = full_params(model)
        report[label] = {"same_everywhere": same_everywhere(params), "finite": bool(torch.isfinite(params).all()),
                         "nodes": s["nodes"], "inter_wire_per_step": s["inter_bytes_wire"] / STEPS,
                         "loss": mean_loss(model, rank)}
    if rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))
