"""Multi-process workers for the FSDP2 reduce-scatter tests (gloo on CPU, launched by ddp_workers).

Each worker asserts on all-gathered values (``assert_all_ranks``), so a failure fails every
rank instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import commpress
import commpress.fsdp
import commpress.fsdp.residuals as rstore
from commpress.errors import ConfigurationError

from ddp_workers import Net, assert_all_ranks, batch

# (codec, options): every fixed-size codec.
MATRIX_CASES: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"ratio": 0.01}),  # residual_dtype="auto" (the default): int8 at 2 ranks, int4 at 4
    ("topk", {"ratio": 0.01, "residual_dtype": torch.float32}),
    ("topk", {"ratio": 0.01, "residual_dtype": torch.bfloat16}),
    ("randomk", {"ratio": 0.05, "warmup_steps": 0}),  # value-blind: 50 dense warm-up steps by default, as DDP
    ("randomk", {"ratio": 0.05, "scaled": True}),
    ("sign", {"block_size": 256}),
    ("qsgd", {"bits": 4}),
]


def make_fsdp(seed: int = 0, *, reshard_after_forward: bool = True) -> Net:
    """The DDP tests' Net with every Linear sharded, then the root (LayerNorm on the root).

    ``reshard_after_forward=False`` keeps the Linears' parameters gathered after forward, so a
    backward pass issues reduce-scatters only (no FSDP all-gather between them).
    """
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.inp, model.h1, model.h2, model.h3, model.out):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def full_params(model: nn.Module) -> torch.Tensor:
    """Every parameter gathered whole (a collective: call on every rank)."""
    return torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])  # type: ignore[operator]


def train(
    model: nn.Module, rank: int, steps: range, *, poison: int = -1, lr: float = 0.05,
    on_step: Callable[[int], None] | None = None,
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in steps:
        if on_step is not None:
            on_step(step)
        x, y = batch(rank, step)
        if step == poison and rank == 0:
            x = x * float("inf")
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if step == poison:  # GradScaler's role: skip a step whose gradients are not finite
            grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]  # type: ignore[attr-defined]
            assert_all_ranks(not all(bool(torch.isfinite(g).all()) for g in grads), "poisoned step not NaN")
            continue
        opt.step()


def worker_matrix(rank: int, world: int, steps: int, outdir: str) -> None:
    """``none`` == FSDP bit for bit; every codec trains with finite, rank-consistent results."""
    reference = make_fsdp()
    train(reference, rank, range(steps))
    ref = full_params(reference)
    report: dict[str, Any] = {}
    for codec, opts in MATRIX_CASES:
        model = make_fsdp()
        state = commpress.fsdp.register(model, codec, **opts)
        train(model, rank, range(steps))
        got = full_params(model)
        label = codec + json.dumps({k: str(v) for k, v in opts.items()}, sort_keys=True)
        assert_all_ranks(bool(torch.isfinite(got).all()), f"{label}: non-finite parameters")
        if codec == "none":
            assert_all_ranks(torch.equal(got, ref), "codec none differs from FSDP's own reduce-scatter")
        else:
            assert_all_ranks(not torch.equal(got, ref), f"{label}: compression changed nothing")
            # close to uncompressed training after a few steps (lr 0.05): a wrong shard is far
            # (scaled random-k multiplies the variance by 1/ratio: a looser bound)
            drift = float((got - ref).norm() / (ref - full_params(make_fsdp())).norm().clamp_min(1e-12))
            limit = 5.0 if opts.get("scaled") else 1.0
            assert_all_ranks(drift < limit, f"{label}: drift {drift:.3f} of the dense update")
        s = state.stats()
        expected = _expected_residual_bytes(state)
        assert_all_ranks(s["residual_bytes"] == expected, f"{label}: residual bytes {s['residual_bytes']} != {expected}")
        assert_all_ranks(s["steps"] == steps, f"{label}: {s['steps']} steps counted")
        report[label] = {k: s[k] for k in ("compression_ratio", "residual_bytes", "bytes_sent_per_step")}
    if rank == 0:
        (Path(outdir) / f"fsdp_matrix_{world}.json").write_text(json.dumps(report, indent=1))


def _expected_residual_bytes(state: commpress.fsdp.FSDPCompressionState) -> int:
    """(n-1) chunks of every compressed parameter, in the residual kind (block scales included); 0 without feedback."""
    if not state.uses_feedback:
        return 0
    kind = state.residual_kind  # residual_dtype="auto" (the default) resolved at this world size
    sizes = {"codes": torch.empty(0, dtype=rstore.CODE_DTYPES[kind]).element_size(), "scales": 4}
    per_chunk = sum(
        math.prod(shape) * sizes[what]
        for m in state.modules for p in m.params if p.compressed
        for what, shape in rstore.stored_shapes(kind, p.chunk_numel).items()
    )
    return (state.world_size - 1) * per_chunk


class ScalarRecorder:
    """A writer for ``state.log_to``: keeps every ``add_scalar`` call."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.rows.append((tag, value, global_step))


def worker_nonfinite(rank: int, world: int) -> None:
    """An Inf on rank 0 makes that step's gradients NaN on every rank; residuals untouched.
    And ``log_to``: the reduce-scatter writes the flattened stats every 2 steps, on rank 0 only."""
    model = make_fsdp()
    state = commpress.fsdp.register(model, "topk", ratio=0.05)
    writer = ScalarRecorder()
    state.log_to(writer, every=2)
    train(model, rank, range(3))
    before = {k: v.clone() for k, v in state.residuals().items()}
    train(model, rank, range(3, 4), poison=3)
    after = state.residuals()
    same = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert_all_ranks(same, "a voided step changed the residuals")
    assert_all_ranks(state.stats()["nonfinite_slots"] > 0, "no slot counted as non-finite")
    train(model, rank, range(4, 6))
    assert_all_ranks(bool(torch.isfinite(full_params(model)).all()), "training did not recover")
    written = {(tag, step): value for tag, value, step in writer.rows}
    if rank == 0:
        steps = sorted({step for _, _, step in writer.rows})
        ok = steps == [2, 4, 6] and all(written[("commpress/steps", s)] == s for s in steps)
        ok = ok and written[("commpress/compression_ratio", 6)] > 5 and written[("commpress/residual_bytes", 6)] > 0
        ok = ok and written[("commpress/nonfinite_slots", 6)] > 0 and ("commpress/guard_ratio", 6) in written
        assert_all_ranks(ok, f"log_to wrote {sorted(written)[:8]}... at steps {steps}")
    else:
        assert_all_ranks(not writer.rows, f"rank {rank} wrote {len(writer.rows)} scalars")


def worker_checkpoint(rank: int, world: int, codec: str, opts: dict[str, Any]) -> None:
    """Stop after 3 steps, save model shards and the commpress state, resume in fresh objects:
    the final parameters equal an uninterrupted 6-step run bit for bit."""
    whole = make_fsdp()
    commpress.fsdp.register(whole, codec, **opts)
    train(whole, rank, range(6))
    expected = full_params(whole)

    first = make_fsdp()
    state = commpress.fsdp.register(first, codec, **opts)
    train(first, rank, range(3))
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    shards = {k: v.to_local().clone() for k, v in first.state_dict().items()}
    second = make_fsdp(seed=1)  # different initialisation: everything must come from the checkpoint
    for k, v in second.state_dict().items():
        v.to_local().copy_(shards[k])
    resumed = commpress.fsdp.register(second, codec, **opts)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    train(second, rank, range(3, 6))
    assert_all_ranks(torch.equal(full_params(second), expected), f"{codec}: resumed run differs")
    bad = resumed.state_dict()
    bad["rank"] = (rank + 1) % world
    try:
        resumed.load_state_dict(bad)
    except ValueError as exc:
        assert_all_ranks("rank mismatch" in str(exc), f"unclear error: {exc}")
    else:
        assert_all_ranks(False, "loading another rank's state did not raise")
    _implausible_residuals_refused(resumed)


def _implausible_residuals_refused(state: commpress.fsdp.FSDPCompressionState) -> None:
    """A residual of the wrong shape or dtype, non-finite or implausibly large is refused, state untouched."""
    good = state.state_dict()
    if not good["residuals"]:
        return
    key, value = next(iter(good["residuals"].items()))
    wrong_dtype = torch.float64 if value.dtype != torch.float64 else torch.float32
    cases: list[tuple[str, torch.Tensor, str]] = [("residuals", value.reshape(1, -1), "must be a tensor of shape"),
                                                  ("residuals", value.to(wrong_dtype), "has dtype")]
    if value.is_floating_point():  # float32 / bfloat16 residuals: the values themselves
        cases += [("residuals", torch.full_like(value, float("nan")), "NaN or Inf"),
                  ("residuals", torch.full_like(value, 1e30), "1e+30")]
    else:  # int8 / int4 codes (residual_dtype="auto", the default): their float32 block scales carry the values
        scale = good["residual_scales"][key]
        cases += [("residual_scales", torch.full_like(scale, float("nan")), "NaN or Inf"),
                  ("residual_scales", torch.full_like(scale, 1e30), "1e+30"), ("residual_scales", scale[1:], "scales must")]
    for entry, bad, expect in cases:
        hostile = {**good, entry: {**good[entry], key: bad}}
        try:
            state.load_state_dict(hostile)
        except ValueError as exc:
            assert_all_ranks(expect in str(exc) and repr(key) in str(exc), f"unclear error: {exc}")
        else:
            assert_all_ranks(False, f"an implausible residual ({expect}) was loaded")
    after = state.state_dict()
    assert_all_ranks(all(torch.equal(after[entry][k], v) for entry in ("residuals", "residual_scales")
                         for k, v in (good.get(entry) or {}).items()), "a refused load changed state")


def worker_checkpoints(rank: int, world: int) -> None:
    """:func:`worker_checkpoint` for fused (sign), sparse (top-k, bf16 residuals) and unbiased codecs."""
    worker_checkpoint(rank, world, "sign", {"block_size": 256})  # residual_dtype="auto": int8 codes at 2 ranks
    worker_checkpoint(rank, world, "sign", {"block_size": 256, "residual_dtype": torch.float32})
    worker_checkpoint(rank, world, "topk", {"ratio": 0.05, "residual_dtype": torch.bfloat16})
    worker_checkpoint(rank, world, "qsgd", {})


def worker_misconfigured(rank: int, world: int) -> None:
    """Ranks registering different codecs fail with a clear error on every rank."""
    model = make_fsdp()
    try:
        commpress.fsdp.register(model, "sign", block_size=256 if rank == 0 else 128)
    except ConfigurationError as exc:
        assert_all_ranks("configured differently" in str(exc), f"unclear error: {exc}")
    else:
        assert_all_ranks(False, "different configurations were not detected")
    dist.barrier()


def case_corrupt(rank: int, victim: int, codec: str, opts: dict[str, Any]) -> None:
    """Rank ``victim`` receives corrupt bytes in step 3's first reduce-scatter (of 10 steps).

    A rank program for :func:`misuse_workers.launch` (tests/fsdp/test_fsdp_faults.py). The
    parameters stay gathered after forward, so the other ranks' next collective is commpress's
    next reduce-scatter (inside the fault channel), not an FSDP all-gather the channel cannot end.
    """
    from misuse_workers import _corrupt_received

    model = make_fsdp(reshard_after_forward=False)
    # gradient-only: the corrupt frame must be the reduce-scatter's (the default int8 all-gather
    # unpacks frames too: its faults are tests/fsdp/test_fsdp_allgather.py's)
    commpress.fsdp.register(model, codec, param_codec="none", **opts)
    armed = _corrupt_received(victim)

    def on_step(step: int) -> None:
        armed[0] = armed[0] or step == 3

    train(model, rank, range(10), on_step=on_step)


def worker_one_rank_leaves_the_optimizer_alone(rank: int, world: int) -> None:
    """On 1 rank FSDP2 runs no collectives: a registered model trains exactly as plain FSDP2 (momentum kept)."""
    assert world == 1
    finals = []
    for how in ("plain", "passed", "discovered"):
        model = make_fsdp(seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if how != "plain":
            state = commpress.fsdp.register(model, "topk", ratio=0.05,
                                            **({"optimizer": opt} if how == "passed" else {}))
            assert state.optimizer is (opt if how == "passed" else None)
        for step in range(4):
            x, y = batch(rank, step)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert all(g["momentum"] == 0.9 for g in opt.param_groups), how
        finals.append(full_params(model))
    assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], finals[2])
