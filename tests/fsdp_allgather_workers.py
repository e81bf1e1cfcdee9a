"""Multi-process workers for the compressed parameter all-gather (``param_codec=``), gloo on CPU.

Launched by ``ddp_workers.launch``; every check goes through ``assert_all_ranks`` so a failure
fails every rank instead of leaving the others in a collective.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import commpress
import commpress.fsdp
from commpress.errors import ConfigurationError
from commpress.spec import blockint

from ddp_workers import Net, assert_all_ranks, batch
from fsdp_workers import full_params

STEPS = 6
#: |loss(int8 all-gather) - loss(FSDP)| per step allowed (losses ~2.3; measured ~1e-4)
LOSS_TOL = {"int8": 5e-3, "int4": 5e-2}


def make(seed: int = 0, mp: MixedPrecisionPolicy | None = None) -> Net:
    """The DDP tests' Net, every Linear sharded, then the root (LayerNorm on the root)."""
    torch.manual_seed(seed)
    model = Net()
    kw: dict[str, Any] = {} if mp is None else {"mp_policy": mp}
    for layer in (model.inp, model.h1, model.h2, model.h3, model.out):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def run(model: nn.Module, rank: int, steps: int = STEPS, lr: float = 0.05) -> list[float]:
    """Plain SGD steps; the mean loss over ranks per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _gathered_weight(model: Net, x: torch.Tensor) -> torch.Tensor:
    """``h1.weight`` as the forward saw it (the gathered, unsharded copy)."""
    seen: list[torch.Tensor] = []
    handle = model.h1.register_forward_pre_hook(lambda m, args: seen.append(m.weight.detach().clone()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


def check_none_is_fsdp(rank: int, world: int, report: dict[str, Any]) -> None:
    """param_codec None installs nothing; "none" is FSDP's all-gather bit for bit, with bytes counted."""
    ref = make()
    ref_losses = run(ref, rank)
    plain = make()
    state = commpress.fsdp.register(plain, "none")
    group = plain.h1._get_fsdp_state()._fsdp_param_groups[0]  # type: ignore[operator]
    assert_all_ranks(type(group._all_gather_comm).__name__ == "DefaultAllGather", "param_codec=None replaced FSDP's all-gather")
    assert_all_ranks(run(plain, rank) == ref_losses and torch.equal(full_params(plain), full_params(ref)),
                     "param_codec=None changed training")
    assert_all_ranks(not any(k.startswith("allgather") for k in state.stats()), "allgather keys without param_codec")
    counted = make()
    state = commpress.fsdp.register(counted, "none", param_codec="none")
    assert_all_ranks(run(counted, rank) == ref_losses and torch.equal(full_params(counted), full_params(ref)),
                     "param_codec='none' is not FSDP's all-gather bit for bit")
    s = state.stats()
    assert_all_ranks(s["allgather_bytes_sent"] == s["allgather_dense_bytes"] > 0, f"none: bytes {s}")
    assert_all_ranks(s["allgather_forward_calls"] > 0 and s["allgather_backward_calls"] > 0, f"directions {s}")
    report["none"] = {k: v for k, v in s.items() if k.startswith("allgather") and not k.endswith("_s")}
    report["fsdp_losses"] = ref_losses


def check_quantized(rank: int, world: int, name: str, report: dict[str, Any]) -> None:
    """int8/int4: loss tracks FSDP, ranks agree, gathered weights within the bound, masters exact fp32."""
    ref_losses = report["fsdp_losses"]
    model = make()
    state = commpress.fsdp.register(model, "none", param_codec=name)
    # the gathered copy: exactly the codec's decode of each rank's shard, within the stated bound
    exact = model.h1.weight.full_tensor().detach().clone()  # type: ignore[operator]
    x, _ = batch(rank, 99)
    seen = _gathered_weight(model, x)
    codec = commpress.codecs.get(name)
    flat = exact.reshape(-1)
    pieces = flat.chunk(world)
    want = torch.cat([codec.decode(codec.encode(p)) for p in pieces]).view_as(exact)
    assert_all_ranks(torch.equal(seen, want), f"{name}: gathered h1.weight is not decode(encode(shard))")
    bound = torch.cat([
        blockint.error_bound(codec.encode(p).sections["scales"], 256, p.numel(), codec.bits, p.dtype,  # type: ignore[attr-defined]
                             codec.decode(codec.encode(p)))
        for p in pieces])
    err = (seen.double() - exact.double()).reshape(-1).abs()
    assert_all_ranks(bool((err <= bound).all()) and float(err.max()) > 0, f"{name}: error beyond the bound")
    assert_all_ranks(same_on_all_ranks(seen), f"{name}: ranks gathered different weights")
    # master shards: float32, and the SGD update lands on the exact shard (p - lr * g)
    model = make()
    commpress.fsdp.register(model, "none", param_codec=name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = [p.to_local().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    xb, yb = batch(rank, 0)
    F.cross_entropy(model(xb), yb).backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]
    opt.step()
    opt.zero_grad(set_to_none=True)
    after = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
    assert_all_ranks(all(a.dtype == torch.float32 for a in after), f"{name}: master shards are not float32")
    assert_all_ranks(all(torch.equal(a, b.add(g, alpha=-0.05)) for a, b, g in zip(after, before, grads)),
                     f"{name}: master shards are not the exact SGD update")
    # training tracks FSDP's (fresh model, same steps)
    model = make()
    state = commpress.fsdp.register(model, "none", param_codec=name)
    losses = run(model, rank)
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    assert_all_ranks(max(diffs) < LOSS_TOL[name], f"{name}: losses {losses} vs FSDP {ref_losses}")
    assert_all_ranks(same_on_all_ranks(full_params(model)), f"{name}: ranks' parameters differ")
    s = state.stats()
    assert_all_ranks(s["allgather_compression_ratio"] > (3.0 if name == "int8" else 5.0), f"{name}: ratio {s}")
    report[name] = {"max_loss_diff": max(diffs), **{k: v for k, v in s.items() if k.startswith("allgather") and not k.endswith("_s")}}


def check_bf16_and_directions(rank: int, world: int, report: dict[str, Any]) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16) composes; forward/backward codecs chosen apart."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = make(mp=mp)
    ref_losses = run(ref, rank)
    model = make(mp=mp)
    state = commpress.fsdp.register(model, "none", param_codec="int8")
    x, _ = batch(rank, 99)
    exact = model.h1.weight.full_tensor().detach().to(torch.bfloat16)  # type: ignore[operator]
    seen = _gathered_weight(model, x)
    assert_all_ranks(seen.dtype == torch.bfloat16, f"bf16: gathered {seen.dtype}")
    codec = commpress.codecs.get("int8")
    want = torch.cat([codec.decode(codec.encode(p)) for p in exact.reshape(-1).chunk(world)]).view_as(exact)
    assert_all_ranks(torch.equal(seen, want), "bf16: gathered weight is not decode(encode(bf16 shard))")
    losses = run(model, rank)
    assert_all_ranks(max(abs(a - b) for a, b in zip(losses, ref_losses)) < LOSS_TOL["int8"],
                     f"bf16 int8: {losses} vs {ref_losses}")
    assert_all_ranks(same_on_all_ranks(full_params(model)), "bf16: ranks differ")
    assert_all_ranks(all(p.to_local().dtype == torch.float32 for p in model.parameters()), "bf16: masters")  # type: ignore[attr-defined]
    s = state.stats()
    report["bf16-int8"] = {k: v for k, v in s.items() if k.startswith("allgather") and not k.endswith("_s")}
    # forward int8, backward FSDP's own: the backward calls move dense bytes
    model = make()
    state = commpress.fsdp.register(model, "none", param_codec={"forward": "int8", "backward": "none"})
    run(model, rank, steps=1)
    s = state.stats()
    assert_all_ranks(s["allgather_forward_calls"] > 0 and s["allgather_backward_calls"] > 0, f"directions {s}")
    assert_all_ranks(s["allgather_bytes_sent"] < s["allgather_dense_bytes"], f"forward not compressed {s}")
    report["fwd-int8-bwd-none"] = {k: v for k, v in s.items() if k.startswith("allgather") and not k.endswith("_s")}


def check_reuse(rank: int, world: int, report: dict[str, Any]) -> None:
    """``"backward": "reuse"``: bit for bit int8 in both directions, no backward bytes, nothing kept after a step.

    The backward's int8 all-gather of an unchanged shard gathers exactly the forward's bytes, so
    decoding the kept forward frames must train identically; a no_grad forward keeps nothing, and
    modules FSDP does not reshard after forward (the root here) keep nothing either.
    """
    ref = make()
    ref_state = commpress.fsdp.register(ref, "none", param_codec="int8")
    run(ref, rank)
    model = make()
    state = commpress.fsdp.register(model, "none", param_codec={"forward": "int8", "backward": "reuse"})
    run(model, rank)
    assert_all_ranks(torch.equal(full_params(model), full_params(ref)), "reuse is not int8/int8 bit for bit")
    s, r = state.stats(), ref_state.stats()
    assert_all_ranks(s["allgather_backward_calls"] == r["allgather_backward_calls"] > 0, f"backward calls {s} {r}")
    assert_all_ranks(s["allgather_backward_bytes_sent"] == 0 < r["allgather_backward_bytes_sent"], f"backward bytes {s}")
    assert_all_ranks(s["allgather_bytes_sent"] == s["allgather_forward_bytes_sent"] == r["allgather_forward_bytes_sent"],
                     f"reuse sent {s['allgather_bytes_sent']}, int8's forward {r['allgather_forward_bytes_sent']}")
    assert state.allgather is not None
    assert_all_ranks(0 < s["allgather_kept_peak_bytes"] < s["allgather_bytes_sent"], f"kept peak {s}")
    assert_all_ranks(all(p.kept is None for p in state.allgather.plans.values()), "frames kept after the step")
    with torch.no_grad():
        model(batch(rank, 0)[0])
    assert_all_ranks(all(p.kept is None for p in state.allgather.plans.values()), "a no_grad forward kept frames")
    report["reuse"] = {k: v for k, v in s.items() if k.startswith("allgather") and not k.endswith("_s")}


def check_refusals(rank: int, world: int) -> None:
    """FSDP's raw uint8 all-gather refused clearly; ranks set up differently fail.

    FSDP all-gathers uint8 when a tensor subclass brings ``fsdp_pre_all_gather`` (float8
    training) with inputs of several dtypes (it refuses plain parameters of mixed dtypes itself:
    "FSDP expects uniform original parameter dtype"), so the comm is called here as FSDP would.
    """
    model = make()
    state = commpress.fsdp.register(model, "none", param_codec="int8")
    assert state.allgather is not None
    plan = state.allgather.plans["h1"]
    nbytes = plan.shard_numel * 4
    group = model.h1._get_fsdp_state()._fsdp_param_groups[0].mesh_info.shard_process_group  # type: ignore[operator]
    comm = model.h1._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm  # type: ignore[operator]
    out = torch.zeros(world * nbytes, dtype=torch.uint8)
    try:
        comm(out, out[rank * nbytes : (rank + 1) * nbytes], group)
    except ConfigurationError as exc:
        assert_all_ranks("uint8" in str(exc) and "one floating dtype" in str(exc) and "param_codec=None" in str(exc), f"unclear: {exc}")
    else:
        assert_all_ranks(False, "a uint8 all-gather was not refused")
    try:
        commpress.fsdp.register(make(), "none", param_codec="int8" if rank == 0 else "int4")
    except ConfigurationError as exc:
        assert_all_ranks("configured differently" in str(exc), f"unclear error: {exc}")
    else:
        assert_all_ranks(False, "different param codecs were not detected")
    dist.barrier()


def worker_all(rank: int, world: int, outdir: str) -> None:
    """Every scenario in one launch; rank 0 writes the report."""
    report: dict[str, Any] = {}
    check_none_is_fsdp(rank, world, report)
    for name in ("int8", "int4"):
        check_quantized(rank, world, name, report)
    check_bf16_and_directions(rank, world, report)
    check_reuse(rank, world, report)
    check_refusals(rank, world)
    if rank == 0:
        (Path(outdir) / "allgather.json").write_text(json.dumps(report, indent=1))


def case_nan_shard(rank: int, victim: int) -> None:
    """Rank ``victim``'s shard of ``h1.weight`` turns NaN before step 2 (a rank program for
    :func:`misuse_workers.launch`): its encode refuses it, and every rank raises within seconds."""
    model = make()
    commpress.fsdp.register(model, "none", param_codec="int8")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        if step == 2 and rank == victim:
            with torch.no_grad():
                model.h1.weight.to_local()[0, 0] = float("nan")  # type: ignore[operator]
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()


# ----- the default (param_codec= not given) ---------------------------------------------------------
def _comm_names(model: nn.Module) -> set[str]:
    """The class names of the all-gather comms FSDP holds for ``model``'s FSDP modules."""
    from torch.distributed.fsdp import FSDPModule

    return {type(m._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm).__name__  # type: ignore[operator]
            for m in model.modules() if isinstance(m, FSDPModule)}


class _Lines(logging.Handler):
    """Keeps every message logged to ``commpress``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged(fn: Any) -> tuple[Any, list[str]]:
    log = logging.getLogger("commpress")
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return fn(), handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def check_compressing_default(rank: int, world: int, steps: int = 3) -> None:
    """``register(model, "topk")``: int8 forward + reuse backward, bit for bit the explicit setting, logged."""
    model = make()
    state, lines = _logged(lambda: commpress.fsdp.register(model, "topk", ratio=0.05))
    assert_all_ranks(_comm_names(model) == {"CompressedAllGather"}, f"topk default installed {_comm_names(model)}")
    assert state.allgather is not None
    int8 = commpress.codecs.get("int8")
    assert_all_ranks(state.allgather.codecs == {"forward": int8, "backward": int8} and state.allgather.reuse,
                     f"topk default: {state.allgather.config()}")
    cfg = state.config()
    assert_all_ranks(cfg["param_codec_defaulted"] and cfg["param_codec"]["reuse"], f"config {cfg.get('param_codec')}")
    why = "param_codec defaulted to int8/reuse because codec 'topk' compresses; pass param_codec='none' for gradient-only"
    assert_all_ranks(state.param_codec_why == why, f"why: {state.param_codec_why!r}")
    assert_all_ranks(any(why in line for line in lines) == (rank == 0), f"rank {rank} logged {lines}")
    run(model, rank, steps)
    s = state.stats()
    assert_all_ranks(s["param_codec_defaulted"] == 1.0 and 0 < s["allgather_bytes_sent"] < s["allgather_dense_bytes"] / 3,
                     f"topk default all-gather bytes {s}")
    # the Linears reshard after forward: their backward decodes the kept frames (0 bytes); the root
    # (FSDP does not reshard it after forward) is gathered once per step, int8, nothing kept
    assert_all_ranks(s["allgather_backward_bytes_sent"] == 0 < s["allgather_backward_calls"], f"backward {s}")
    root = state.allgather.plans["<root>"]
    assert_all_ranks(root.calls == {"forward": steps, "backward": 0} and not any(root.compressed),
                     f"root all-gathers {root.calls}, compressed {root.compressed} (LayerNorm: exact)")
    bias = state.allgather.plans["h1"]
    assert_all_ranks(bias.compressed == [True, False], f"h1 weight/bias compressed {bias.compressed}")
    explicit = make()
    commpress.fsdp.register(explicit, "topk", ratio=0.05, param_codec={"forward": "int8", "backward": "reuse"})
    run(explicit, rank, steps)
    assert_all_ranks(torch.equal(full_params(model), full_params(explicit)), "the default is not int8/reuse bit for bit")


def check_exact_codecs_keep_fsdp(rank: int, world: int, steps: int = 3) -> None:
    """``none`` and the casts keep FSDP's all-gather (``none``: plain FSDP bit for bit); ``"none"``/None opt out."""
    ref = make()
    run(ref, rank, steps)
    for codec in ("none", "bf16", "fp16"):
        model = make()
        state = commpress.fsdp.register(model, codec)
        assert_all_ranks(_comm_names(model) == {"DefaultAllGather"} and state.allgather is None,
                         f"{codec}: all-gather {_comm_names(model)}")
        assert_all_ranks(state.param_codec_defaulted and "does not compress" in state.param_codec_why,
                         f"{codec}: {state.param_codec_why}")
        run(model, rank, steps)
        s = state.stats()
        assert_all_ranks(s["param_codec_defaulted"] == 1.0 and not any(k.startswith("allgather") for k in s),
                         f"{codec}: stats {sorted(s)}")
        if codec == "none":
            assert_all_ranks(torch.equal(full_params(model), full_params(ref)), "none: not FSDP bit for bit")
    # gradient-only: param_codec="none" is FSDP's all-gather (counted), None leaves FSDP's own
    plain = make()
    commpress.fsdp.register(plain, "topk", ratio=0.05, param_codec=None)
    assert_all_ranks(_comm_names(plain) == {"DefaultAllGather"}, f"param_codec=None installed {_comm_names(plain)}")
    run(plain, rank, steps)
    counted = make()
    state = commpress.fsdp.register(counted, "topk", ratio=0.05, param_codec="none")
    assert_all_ranks(not state.param_codec_defaulted and not state.config()["param_codec_defaulted"], "given, not defaulted")
    run(counted, rank, steps)
    s = state.stats()
    assert_all_ranks(s["allgather_bytes_sent"] == s["allgather_dense_bytes"] > 0, f"param_codec='none' bytes {s}")
    assert_all_ranks(torch.equal(full_params(counted), full_params(plain)), "param_codec='none' is not gradient-only")
    default = make()
    commpress.fsdp.register(default, "topk", ratio=0.05)
    run(default, rank, steps)
    assert_all_ranks(not torch.equal(full_params(default), full_params(plain)), "the default changed nothing")


def check_checkpoint_across_defaults(rank: int, world: int) -> None:
    """A gradient-only checkpoint loads into the new default (and back): the all-gather keeps no state."""
    import io

    for saved_with, loaded_with in (({"param_codec": "none"}, {}), ({}, {"param_codec": None})):
        first = make()
        state = commpress.fsdp.register(first, "topk", ratio=0.05, **saved_with)
        run(first, rank, 3)
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        saved = state.residuals()
        second = make()
        resumed = commpress.fsdp.register(second, "topk", ratio=0.05, **loaded_with)
        buf.seek(0)
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        got = resumed.residuals()
        assert_all_ranks(resumed.step == state.step and sorted(got) == sorted(saved)
                         and all(torch.equal(got[k], v) for k, v in saved.items()), f"{saved_with} -> {loaded_with}")
        losses = run(second, rank, 2)
        assert_all_ranks(all(math.isfinite(v) for v in losses), f"{saved_with} -> {loaded_with}: {losses}")


def worker_defaults(rank: int, world: int) -> None:
    """Every default scenario in one launch (tests/fsdp/test_fsdp_param_default.py)."""
    check_compressing_default(rank, world)
    check_exact_codecs_keep_fsdp(rank, world)
    check_checkpoint_across_defaults(rank, world)


def worker_low_precision_reduce_computes_feedback_in_float32(rank: int, world: int) -> None:
    """Under a bf16 policy that reduces in bf16, top-k's error feedback (Adam mode) encodes float32, as with an fp32 reduce.

    The reduced shard goes back to FSDP in bf16; the bytes on the wire are those of the float32
    reduce (top-k's values in float32), and QSGD (no error feedback) keeps encoding bf16.
    """
    sent = {}
    for codec, reduce_dtype in (("topk", None), ("topk", torch.float32), ("qsgd", None), ("qsgd", torch.float32)):
        model = make(mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = commpress.fsdp.register(model, codec, optimizer=opt, warmup_steps=1, param_codec="none",
                                        **({"ratio": 0.05} if codec == "topk" else {}))
        for step in range(4):
            x, y = batch(rank, step)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            assert_all_ranks(bool(torch.isfinite(loss)), f"{codec}, reduce {reduce_dtype}: loss {loss}")
        sent[codec, reduce_dtype] = state.stats()["bytes_sent"]
    assert_all_ranks(sent["topk", None] == sent["topk", torch.float32], f"top-k bytes: {sent}")
    assert_all_ranks(sent["qsgd", None] < sent["qsgd", torch.float32], f"QSGD bytes: {sent}")
