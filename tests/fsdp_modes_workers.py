"""Multi-rank workers for tests/fsdp/test_fsdp_modes.py: ``optimizer=``, warm-up, the guard and residual memory on FSDP2.

Each worker asserts on all-gathered values (``assert_all_ranks``), so a failure fails every rank.
"""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import commpress.fsdp
from commpress.fsdp import residuals as rstore
from commpress.optim import GROUP_KEY

from ddp_workers import assert_all_ranks, batch
from fsdp_workers import full_params, make_fsdp


def _sgd(params: Any, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, **kw)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def worker_equivalence(rank: int, world: int) -> None:
    """Nothing dropped (top-k ratio 1): the reduce-scatter's SGD momentum is SGD momentum (1e-5);
    AdamW's dense warm-up steps are FSDP + AdamW exactly; the group settings move as on DDP.
    Gradient-only (``param_codec="none"``): the references are plain FSDP's exact all-gathers."""
    # float32 storage: quantised velocities (residual_dtype="auto", the default) round, so not SGD to 1e-5
    every = {"ratio": 1.0, "min_numel": 0, "dense_1d": False, "residual_dtype": torch.float32}  # local velocities
    mixed = {"ratio": 1.0, "residual_dtype": torch.float32}  # 1-D / small parameters dense: velocities on the shard too
    for kw, opts in (({"momentum": 0.9}, every), ({"momentum": 0.9}, mixed), ({"momentum": 0.9, "nesterov": True}, mixed),
                     ({"momentum": 0.8, "dampening": 0.5}, every)):
        ref, model = make_fsdp(), make_fsdp()
        ref_opt, opt = _sgd(ref.parameters(), **kw), _sgd(model.parameters(), **kw)
        state = commpress.fsdp.register(model, "topk", optimizer=opt, param_codec="none", **opts)
        assert_all_ranks(all(g["momentum"] == 0 and g[GROUP_KEY]["momentum"] == kw["momentum"]
                             for g in opt.param_groups), "momentum not moved into the reduce-scatter")
        for step in range(6):
            _step(ref, ref_opt, rank, step)
            _step(model, opt, rank, step)
        diff = float((full_params(ref) - full_params(model)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{kw} {opts}: momentum differs from SGD momentum by {diff}")
        assert_all_ranks(state.stats()["steps"] == 6, "steps not counted")
    ref, model = make_fsdp(), make_fsdp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    state = commpress.fsdp.register(model, "topk", optimizer=opt, ratio=0.01, warmup_steps=4, warmup_codec="dense",
                                    param_codec="none")
    assert_all_ranks(state.adam is not None and state.warmup.steps == 4, "AdamW not adopted")
    quant = make_fsdp()  # the default warm-up: 8-bit QSGD through the all_to_all
    quant_opt = torch.optim.AdamW(quant.parameters(), lr=1e-3, weight_decay=0.01)
    qstate = commpress.fsdp.register(quant, "topk", optimizer=quant_opt, ratio=0.01, warmup_steps=4, param_codec="none")
    for step in range(4):
        _step(ref, ref_opt, rank, step)
        _step(model, opt, rank, step)
        _step(quant, quant_opt, rank, step)
    assert_all_ranks(torch.equal(full_params(ref), full_params(model)), "AdamW warm-up differs from FSDP + AdamW")
    qs = qstate.stats()
    assert_all_ranks(qs["bytes_sent"] < 0.4 * qs["dense_bytes"], f"QSGD warm-up sent {qs['bytes_sent']} of {qs['dense_bytes']}")
    qdiff = float((full_params(quant) - full_params(ref)).abs().max())
    assert_all_ranks(0 < qdiff < 1e-2, f"QSGD warm-up moved {qdiff} away from FSDP + AdamW after 4 steps (lr 1e-3)")
    for step in range(4, 8):  # compressed momentum with frozen variance: finite, moving, rank-consistent
        _step(model, opt, rank, step)
    got = full_params(model)
    assert_all_ranks(bool(torch.isfinite(got).all()) and state.adam.active, "AdamW compressed phase failed")
    fresh = make_fsdp()
    default = commpress.fsdp.register(fresh, "topk", ratio=0.01, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert_all_ranks(default.warmup.steps == 50, "AdamW's default warm-up is not DDP's 50 steps")


def worker_discovery(rank: int, world: int) -> None:
    """Registered without ``optimizer=``: the optimizer stepping the model is adopted after its first
    step, and the run then equals SGD momentum (nothing dropped, 1e-5) as with ``optimizer=``; AdamW
    gets the compressed-momentum mode; ``optimizer=None`` and a subset optimizer are left alone; a
    checkpoint holding velocities needs ``optimizer=`` to resume (clear error). Gradient-only
    (``param_codec="none"``) where the reference is plain FSDP + SGD momentum."""
    every = {"ratio": 1.0, "min_numel": 0, "dense_1d": False, "param_codec": "none", "residual_dtype": torch.float32}
    ref, model = make_fsdp(), make_fsdp()
    state = commpress.fsdp.register(model, "topk", **every)
    ref_opt, opt = _sgd(ref.parameters(), momentum=0.9), _sgd(model.parameters(), momentum=0.9)
    assert_all_ranks(state.optimizer is None and state.discovery is not None and state.discovery.pending,
                     "discovery not pending before the first step")
    for step in range(6):
        _step(ref, ref_opt, rank, step)
        _step(model, opt, rank, step)
        if step == 0:
            assert_all_ranks(state.optimizer is opt and state.handover is not None
                             and opt.param_groups[0]["momentum"] == 0, "SGD not adopted after its first step")
    diff = float((full_params(ref) - full_params(model)).abs().max())
    assert_all_ranks(diff < 1e-5, f"discovered SGD momentum differs from SGD momentum by {diff}")
    saved = state.state_dict()
    assert_all_ranks(bool(saved["velocity"]), "no velocities saved after adoption")
    fresh = make_fsdp()
    pending = commpress.fsdp.register(fresh, "topk", **every)
    try:
        pending.load_state_dict(saved)
    except ValueError as exc:
        assert_all_ranks("optimizer=" in str(exc), f"unclear error: {exc}")
    else:
        assert_all_ranks(False, "velocities loaded into a state that has not adopted an optimizer")
    adam_model = make_fsdp()
    adam_state = commpress.fsdp.register(adam_model, "topk", ratio=0.05)
    adam_opt = torch.optim.AdamW(adam_model.parameters(), lr=1e-3)
    _step(adam_model, adam_opt, rank, 0)
    assert_all_ranks(adam_state.adam is not None and adam_state.warmup.steps == 50, "AdamW not adopted")
    plain = make_fsdp()
    off = commpress.fsdp.register(plain, "sign", optimizer=None)
    plain_opt = _sgd(plain.parameters(), momentum=0.9)
    _step(plain, plain_opt, rank, 0)
    assert_all_ranks(off.discovery is None and off.handover is None and plain_opt.param_groups[0]["momentum"] == 0.9,
                     "optimizer=None adopted the optimizer")
    half = make_fsdp()
    sub = commpress.fsdp.register(half, "sign")
    half_opt = _sgd(list(half.parameters())[::2], momentum=0.9)
    _step(half, half_opt, rank, 0)
    assert_all_ranks(sub.handover is None and not sub.discovery.pending and half_opt.param_groups[0]["momentum"] == 0.9,
                     "a subset optimizer was adopted")
    quiet = make_fsdp()  # QSGD keeps no residuals: nothing to adopt, nothing watched
    assert_all_ranks(commpress.fsdp.register(quiet, "qsgd").discovery is None, "QSGD watches for an optimizer")


def _sgd_m(params: Any) -> torch.optim.Optimizer:
    return _sgd(params, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def worker_memory(rank: int, world: int, out: str) -> None:
    """``residual_dtype="auto"``: compression state (residuals + velocities) <= one gradient shard,
    for random-k 1% with the user's SGD momentum (the gain: no velocity for compressed parameters),
    sign with no optimizer, and top-k 1% / sign with SGD momentum and AdamW (local velocities, stored
    quantised); float32 exceeds it (top-k + SGD keeps a local velocity too). A discovered SGD with
    ``"auto"`` is the ``optimizer=`` run bit for bit (its velocities stored with the same rounding).
    From 6 ranks (8 here) top-k's SGD velocities fit no kind (it takes ternary/int4, measured, not asserted
    to fit), AdamW's and sign's SGD ones fit as ternary/ternary, and a discovered AdamW with top-k, budgeted
    for SGD at registration, narrows its velocities to ternary and is the ``optimizer=`` run bit for bit."""
    report = {}
    auto = {"residual_dtype": "auto"}
    adam = {**auto, "warmup_steps": 2}  # the compressed momentum (local velocities) from step 2
    for label, codec, opts, make_opt in (
        ("randomk1%+sgd/auto", "randomk", {"ratio": 0.01, "scaled": False, "warmup_steps": 0, **auto}, _sgd_m),
        ("sign/auto", "sign", auto, None),
        ("topk1%+sgd/float32", "topk", {"ratio": 0.01, "residual_dtype": torch.float32}, _sgd_m),
        ("topk1%+sgd/default", "topk", {"ratio": 0.01}, _sgd_m),  # residual_dtype="auto" is the default
        ("topk1%+sgd/auto", "topk", {"ratio": 0.01, **auto}, _sgd_m),
        ("sign+sgd/auto", "sign", auto, _sgd_m),
        ("topk1%+adamw/auto", "topk", {"ratio": 0.01, **adam}, _adamw),
        ("sign+adamw/auto", "sign", adam, _adamw),
    ):
        if 2 < world < 6 and label == "sign+sgd/auto":  # top-k + SGD covers the mode there (keeps 4 ranks short)
            continue
        if world > 5 and label in ("topk1%+sgd/float32", "topk1%+sgd/default", "randomk1%+sgd/auto"):
            continue  # 8 ranks: the kinds that change there
        model = make_fsdp()
        opt = (make_opt or _sgd_m)(model.parameters())
        state = commpress.fsdp.register(model, codec, optimizer=opt if make_opt else None, **opts)
        for step in range(4):
            _step(model, opt, rank, step)
        s = state.stats()
        local = "+" in label and "randomk" not in label  # top-k / sign with an optimizer: local velocities
        if local:
            ternary = "adamw" in label or label.startswith("sign")  # where ternary velocities cost nothing
            want = (rstore.auto_kinds(world, True, ternary_velocities=ternary) if "float32" not in label
                    else ("float32", "float32"))
            assert_all_ranks((state.residual_kind, state.velocity_kind) == want and s["velocity_bytes"] > 0,
                             f"{label}: kinds {state.residual_kind}/{state.velocity_kind}, want {want}: {s}")
        assert_all_ranks(bool(torch.isfinite(full_params(model)).all()), f"{label}: non-finite")
        assert_all_ranks(s["residual_bytes"] > 0 and s["compression_state_bytes"] ==
                         s["residual_bytes"] + s["velocity_bytes"], f"{label}: {s}")
        if "float32" not in label and not (world > 5 and label.startswith("topk1%+sgd")):  # "auto", asked for or by default
            assert_all_ranks(s["compression_state_bytes"] <= s["shard_bytes"],
                             f"{label}: {s['compression_state_bytes']} > shard {s['shard_bytes']} at {world} ranks")
        else:  # float32 residuals beyond 2 ranks, and top-k's float32 local velocity at any
            assert_all_ranks(s["compression_state_bytes"] > s["shard_bytes"], f"{label}: float32 fits?")
        report[label] = {"kind": state.residual_kind, "velocity_kind": state.velocity_kind, **{k: s[k] for k in
                         ("residual_bytes", "velocity_bytes", "compression_state_bytes", "shard_bytes")}}
    if world > 5:
        _discovered_adamw_narrows_its_velocities(rank, world)
    if world > 2:
        if rank == 0:
            Path(out, f"memory_{world}.json").write_text(json.dumps(report, indent=1))
        return
    _discovered_randomk_adamw_fits(rank, world)
    passed, found = make_fsdp(), make_fsdp()  # SGD found after its first step == optimizer=, with "auto"
    passed_opt, found_opt = _sgd(passed.parameters(), momentum=0.9), _sgd(found.parameters(), momentum=0.9)
    commpress.fsdp.register(passed, "sign", optimizer=passed_opt, **auto)
    found_state = commpress.fsdp.register(found, "sign", **auto)
    assert_all_ranks(found_state.velocity_kind == rstore.auto_kinds(world, True)[1], "discovery not budgeted for")
    for step in range(4):
        _step(passed, passed_opt, rank, step)
        _step(found, found_opt, rank, step)
    assert_all_ranks(found_state.optimizer is found_opt and torch.equal(full_params(passed), full_params(found)),
                     "a discovered SGD with residual_dtype='auto' differs from optimizer=")
    if rank == 0:
        Path(out, f"memory_{world}.json").write_text(json.dumps(report, indent=1))


def _discovered_randomk_adamw_fits(rank: int, world: int) -> None:
    """Random-k registered without ``optimizer=`` sizes its residuals alone (SGD's gain keeps no velocity); the
    AdamW found at the first reduce-scatter gets the widest velocity kind beside them (ternary at 2 ranks, 1.13
    shards by formula, with a warning), where they were float32 (3 shards)."""
    model = make_fsdp()
    opt = _adamw(model.parameters())
    state = commpress.fsdp.register(model, "randomk", ratio=0.01, scaled=False, residual_dtype="auto", warmup_steps=2)
    for step in range(4):
        _step(model, opt, rank, step)
    s = state.stats()
    kinds = (state.residual_kind, state.velocity_kind)
    bound = rstore.state_bytes(world, *kinds) / 4 * s["shard_bytes"]
    assert_all_ranks(state.adam is not None and kinds == (rstore.auto_kind(world), "ternary")
                     and 0 < s["velocity_bytes"] and s["compression_state_bytes"] <= bound,
                     f"random-k + discovered AdamW: {kinds}, bound {bound}: {s}")


def _discovered_adamw_narrows_its_velocities(rank: int, world: int) -> None:
    """Registered without ``optimizer=``, ``"auto"`` budgets top-k for SGD's velocities (ternary/int4 at 8 ranks);
    the AdamW adopted at the first reduce-scatter stores them ternary, the ``optimizer=`` run bit for bit, and a
    discovered SGD is its ``optimizer=`` run bit for bit too."""
    adam = {"residual_dtype": "auto", "warmup_steps": 2, "ratio": 0.01}
    passed, found = make_fsdp(), make_fsdp()
    passed_opt, found_opt = _adamw(passed.parameters()), _adamw(found.parameters())
    passed_state = commpress.fsdp.register(passed, "topk", optimizer=passed_opt, **adam)
    found_state = commpress.fsdp.register(found, "topk", **adam)
    assert_all_ranks(found_state.velocity_kind == "int4" and passed_state.velocity_kind == "ternary",
                     f"budget {found_state.velocity_kind}, passed {passed_state.velocity_kind}")
    sgd_found, sgd_passed = make_fsdp(), make_fsdp()
    sgd_found_opt, sgd_passed_opt = _sgd_m(sgd_found.parameters()), _sgd_m(sgd_passed.parameters())
    commpress.fsdp.register(sgd_found, "topk", ratio=0.01, residual_dtype="auto")
    commpress.fsdp.register(sgd_passed, "topk", ratio=0.01, residual_dtype="auto", optimizer=sgd_passed_opt)
    for step in range(4):
        for model, opt in ((passed, passed_opt), (found, found_opt), (sgd_found, sgd_found_opt), (sgd_passed, sgd_passed_opt)):
            _step(model, opt, rank, step)
    assert_all_ranks(torch.equal(full_params(sgd_found), full_params(sgd_passed)),
                     f"a discovered SGD at {world} ranks differs from optimizer=")
    assert_all_ranks(found_state.optimizer is found_opt and found_state.velocity_kind == "ternary"
                     and torch.equal(full_params(passed), full_params(found)),
                     f"a discovered AdamW at {world} ranks differs from optimizer= ({found_state.velocity_kind})")
    s = found_state.stats()
    assert_all_ranks(0 < s["compression_state_bytes"] <= s["shard_bytes"], f"discovered AdamW: {s}")


def _resume_case(rank: int, world: int, codec: str, opts: dict[str, Any], make_opt: Any, tag: str) -> None:
    """3 steps, save model shards + optimizer + commpress state, resume in fresh objects: == 7 uninterrupted."""
    whole = make_fsdp()
    whole_opt = make_opt(whole.parameters())
    commpress.fsdp.register(whole, codec, optimizer=whole_opt, **copy.deepcopy(opts))  # a guard object each
    for step in range(7):
        _step(whole, whole_opt, rank, step)
    expected = full_params(whole)

    first = make_fsdp()
    opt = make_opt(first.parameters())
    state = commpress.fsdp.register(first, codec, optimizer=opt, **copy.deepcopy(opts))
    for step in range(3):
        _step(first, opt, rank, step)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    shards = {k: v.to_local().clone() for k, v in first.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    second = make_fsdp(seed=1)
    for k, v in second.state_dict().items():
        v.to_local().copy_(shards[k])
    opt2 = make_opt(second.parameters())
    resumed = commpress.fsdp.register(second, codec, optimizer=opt2, **copy.deepcopy(opts))
    opt2.load_state_dict(opt_state)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(3, 7):
        _step(second, opt2, rank, step)
    assert_all_ranks(torch.equal(full_params(second), expected), f"{tag}: resumed run differs")
    if "divergence_guard" in opts:
        assert_all_ranks(resumed.stats()["guard_fired"] > 0, f"{tag}: the guard never fired")
    bad = resumed.state_dict()
    if bad["velocity"]:
        key = next(iter(bad["velocity"]))
        bad["velocity"] = {**bad["velocity"], key: bad["velocity"][key][:-1]}
        try:
            resumed.load_state_dict(bad)
        except ValueError as exc:
            assert_all_ranks("velocity" in str(exc), f"unclear error: {exc}")
        else:
            assert_all_ranks(False, f"{tag}: a velocity of the wrong size was loaded")
    if bad.get("velocity_codes"):  # quantised local velocities: every corruption a clear error, nothing adopted
        good = resumed.state_dict()
        key = next(iter(good["velocity_codes"]))
        codes, scales = good["velocity_codes"][key], good["velocity_scales"][key]
        nan = scales.clone()
        nan[0] = float("nan")
        for what, change, words in (
            ("truncated codes", {"velocity_codes": {**good["velocity_codes"], key: codes[:-1]}}, "must be a tensor of shape"),
            ("float codes", {"velocity_codes": {**good["velocity_codes"], key: codes.float()}}, "has dtype"),
            ("NaN scale", {"velocity_scales": {**good["velocity_scales"], key: nan}}, "scales"),
            ("missing scale", {"velocity_scales": {k: v for k, v in good["velocity_scales"].items() if k != key}}, "scales"),
            ("unknown key", {"velocity_codes": {**good["velocity_codes"], "nope#0": codes}}, "not one this rank keeps"),
            ("another kind", {"velocity_dtype": "int4"}, "velocity_dtype mismatch"),
            ("float32 in place of codes", {"velocity": {**good["velocity"], key: torch.zeros(4)}}, "velocity"),
        ):
            try:
                resumed.load_state_dict({**good, **change})
            except ValueError as exc:
                assert_all_ranks(words in str(exc) and ("velocit" in str(exc)), f"{tag}, {what}: unclear error: {exc}")
            else:
                assert_all_ranks(False, f"{tag}: {what} was loaded")
        after = resumed.state_dict()
        assert_all_ranks(all(torch.equal(after["velocity_codes"][k], v) for k, v in good["velocity_codes"].items()),
                         f"{tag}: a refused load changed the velocities")


def worker_checkpoints(rank: int, world: int) -> None:
    """Bit-exact resume: sign + SGD (local velocities), top-k 1% + SGD (a local velocity) with int8 residuals
    and int8 velocities and a guard step, AdamW across the end of its warm-up, and sign + AdamW with
    ``residual_dtype="auto"`` (quantised velocities: every corruption of them refused clearly), and top-k + AdamW
    with ternary residuals and velocities."""
    guard = commpress.optim.DivergenceGuard(interval=1, threshold=0.05, dense_steps=1)
    _resume_case(rank, world, "sign", {}, lambda p: _sgd(p, momentum=0.9), "sign+sgd")
    _resume_case(rank, world, "topk", {"ratio": 0.01, "residual_dtype": "int8", "divergence_guard": guard},
                 lambda p: _sgd(p, momentum=0.9, nesterov=True), "topk+sgd+int8+guard")
    _resume_case(rank, world, "topk", {"ratio": 0.05, "warmup_steps": 2},
                 lambda p: torch.optim.AdamW(p, lr=1e-3), "topk+adamw")
    _resume_case(rank, world, "sign", {"warmup_steps": 2, "residual_dtype": "auto"}, _adamw, "sign+adamw+auto")
    _resume_case(rank, world, "topk", {"ratio": 0.05, "warmup_steps": 2, "residual_dtype": "ternary"}, _adamw,
                 "topk+adamw+ternary")


# ----- digits: the user's SGD momentum and AdamW, FSDP-sharded --------------------------------
def _digits(rank: int, world: int, seed: int) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return x[:1400][rank::world], y[:1400][rank::world], x[1400:], y[1400:]


def train_digits_fsdp(rank: int, world: int, codec: str | None, opts: dict[str, Any], optim: dict[str, Any],
                      epochs: int, seed: int) -> float:
    """Held-out accuracy of the digits MLP (tests/optim_workers.py's), every Linear and the root sharded.

    Gradient-only (``param_codec="none"``): the MARGINS of tests/fsdp/test_fsdp_modes.py were measured on the reduce-scatter
    alone (5 seeds); the default int8/reuse all-gather's quality is scripts/bench_fsdp_lm.py's table.
    """
    xtr, ytr, xte, yte = _digits(rank, world, seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = (torch.optim.AdamW(model.parameters(), **optim) if "betas" in optim
           else torch.optim.SGD(model.parameters(), **optim))
    if codec is not None:
        commpress.fsdp.register(model, codec, **{"optimizer": opt, "param_codec": "none", **opts})  # opts may say optimizer=None
    for _ in range(epochs):
        for i in range(0, len(xtr), 35):
            loss = F.cross_entropy(model(xtr[i : i + 35]), ytr[i : i + 35])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        logits = model(xte)
    return float((logits.argmax(1) == yte).float().mean())


DIGITS_CASES: list[tuple[str, str | None, dict[str, Any]]] = [
    ("dense", None, {}), ("topk1%", "topk", {"ratio": 0.01}), ("sign", "sign", {}),
]
#: Quantized residuals (``CASES=residuals``): what int8 / int4 storage costs in accuracy, at 2 ranks.
RESIDUAL_CASES: list[tuple[str, str | None, dict[str, Any]]] = [
    ("dense", None, {}),
    *[(f"{label}-{kind}", codec, {**opts, "residual_dtype": kind})
      for label, codec, opts in (("topk1%", "topk", {"ratio": 0.01}), ("sign", "sign", {})) for kind in ("int8", "int4")],
]
#: Quantized velocities (``CASES=velocities``): float32 residuals and velocities against ``residual_dtype="auto"``
#: (int8 residuals + int8 local velocities at 2 ranks, int4 + int4 at 4; ``WORLD=4``).
VELOCITY_CASES: list[tuple[str, str | None, dict[str, Any]]] = [
    ("dense", None, {}),
    *[(f"{label}-{kind}", codec, {**opts, "residual_dtype": kind})
      for label, codec, opts in (("topk1%", "topk", {"ratio": 0.01}), ("sign", "sign", {})) for kind in ("float32", "auto")],
]
DIGITS_OPTIMS = {"sgd": {"lr": 0.1, "momentum": 0.9}, "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01}}


def worker_digits(rank: int, world: int, out: str, epochs: int, seeds: list[int], which: str = "modes",
                  optims: tuple[str, ...] = ("sgd", "adamw")) -> None:
    """Accuracy per (seed, optimizer, case); written by rank 0 as JSON (``which``: "modes", "residuals", "velocities")."""
    torch.set_num_threads(1)
    results: dict[str, float] = {}
    cases = {"residuals": RESIDUAL_CASES, "velocities": VELOCITY_CASES}.get(which, DIGITS_CASES)
    for seed in seeds:
        for tag in optims:
            optim = DIGITS_OPTIMS[tag]
            for label, codec, opts in cases:
                results[f"{seed}/{tag}/{label}"] = train_digits_fsdp(rank, world, codec, opts, optim, epochs, seed)
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":  # the measurement behind the README's numbers and the test's margins
    import sys

    import ddp_workers as w

    seeds = [int(s) for s in os.environ.get("SEEDS", "0,1,2,3,4").split(",")]
    target = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fsdp_digits.json"
    which = os.environ.get("CASES", "modes")
    optims = tuple(os.environ.get("OPTIMS", "sgd,adamw").split(","))
    w.launch(worker_digits, int(os.environ.get("WORLD", "2")), target, int(os.environ.get("EPOCHS", "12")), seeds, which, optims, timeout=3000)
    print(Path(target).read_text())


def worker_live_variance(rank: int, world: int) -> None:
    """``adam_variance="live"`` (the default): after the warm-up each shard's ``exp_avg_sq`` moves
    with its owner's own local gradient, ``v = b2*v + (1-b2)*g_own**2`` (checked against the
    gradient of an unsharded copy on this rank's batch); ``"frozen"`` leaves it as the warm-up did."""
    from torch.distributed.tensor import DTensor

    for variance in ("live", "frozen"):
        model = make_fsdp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
        state = commpress.fsdp.register(model, "topk", optimizer=opt, ratio=0.05, warmup_steps=2,
                                        warmup_codec="dense", param_codec="none", adam_variance=variance)
        for step in range(3):  # warm-up, then the first compressed step (the mode starts)
            _step(model, opt, rank, step)
        assert_all_ranks(state.adam is not None and state.adam.active, f"{variance}: the Adam mode did not start")
        params = dict(model.named_parameters())
        compressed = [n for n, p in params.items() if id(p) in state.adam.compressed]
        before = {n: opt.state[params[n]]["exp_avg_sq"].to_local().clone() for n in compressed}
        plain = make_fsdp_plain_like(model)
        x, y = batch(rank, 3)
        F.cross_entropy(plain(x), y).backward()
        _step(model, opt, rank, 3)
        worst = 0.0
        for n in compressed:
            v = opt.state[params[n]]["exp_avg_sq"]
            assert isinstance(v, DTensor)
            local = v.to_local()
            rows = -(-params[n].shape[0] // world)
            g = dict(plain.named_parameters())[n].grad[rank * rows : rank * rows + local.shape[0]]
            want = before[n] * 0.99 + 0.01 * g * g if variance == "live" else before[n]
            worst = max(worst, float((local - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        assert_all_ranks(compressed and worst < 1e-5, f"{variance}: exp_avg_sq off by {worst} (relative)")


def make_fsdp_plain_like(model: nn.Module) -> nn.Module:
    """An unsharded Net holding ``model``'s current parameters (a collective: every rank)."""
    from ddp_workers import Net

    plain = Net()
    with torch.no_grad():
        for (_, q), (_, p) in zip(plain.named_parameters(), model.named_parameters()):
            q.copy_(p.full_tensor())  # type: ignore[operator]
    return plain
