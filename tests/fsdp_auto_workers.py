"""Multi-rank workers for tests/fsdp/test_fsdp_auto.py: ``codec="auto"`` per FSDP module, and discovery's first step.

Each worker asserts on all-gathered values (``assert_all_ranks``), so a failure fails every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import commpress.comm.costmodel as costmodel
import commpress.fsdp
import commpress.fsdp.auto as auto_mod
from commpress.comm.costmodel import Link
from commpress.fsdp.auto import ModuleChoice

from ddp_workers import assert_all_ranks, batch
from fsdp_workers import full_params, make_fsdp

SLOW = Link.from_gbit(0.01)  # 10 Mbit/s: compressed wins by ~10x on these 16k-parameter layers, whatever the load
FAST = Link.from_gbit(1e6, latency_s=0.0)
#: the modules with a quantisable weight (128 x 128): compressed on a slow link
WIDE = ("h1", "h2", "h3")
FAST_CALIBRATION = {"auto_calibration_numel": 1 << 16}


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _choices(state: commpress.fsdp.FSDPCompressionState) -> dict[str, tuple[str, str]]:
    assert state.auto is not None
    return {m: (c.reduce_scatter, c.all_gather) for m, c in state.auto.choices.items()}


def _same_everywhere(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t)
    return all(torch.equal(g, got[0]) for g in got)


def worker_auto(rank: int, world: int, ckpt: str) -> None:
    """Slow link: compressed where it pays, fewer bytes, ranks agree; fast link: exact == plain FSDP bit for bit;
    the choice survives DCP and state_dict save + load (a fast-link run takes the saved slow-link choices and
    continues bit for bit); a calibration failure on one rank makes every rank exact."""
    # --- slow link
    model = make_fsdp()
    state = commpress.fsdp.register(model, "auto", auto_link=SLOW, **FAST_CALIBRATION)
    chosen = _choices(state)
    assert_all_ranks(all(chosen[m] == ("compressed", "compressed") for m in WIDE), f"slow link chose {chosen}")
    codes = torch.tensor(state.auto.state([m.name for m in state.modules]))  # type: ignore[union-attr]
    assert_all_ranks(_same_everywhere(codes), f"ranks chose differently: {chosen}")
    s = state.stats()
    assert_all_ranks(s["auto_h1_reduce_scatter"] == 2 and s["auto_h1_all_gather"] == 2
                     and s["auto_h1_reduce_scatter_compressed_predicted_s"] < s["auto_h1_reduce_scatter_dense_predicted_s"]
                     and s["auto_link_gbit"] == SLOW.gbit and s["auto_fallback"] == 0, f"stats: {s}")
    report = state.auto_report()
    assert_all_ranks(len(report) == len(state.modules) and report[1]["predicted_s"]["reduce_scatter"], f"{report}")
    assert_all_ranks("auto" in state.config() and state.config()["auto"]["choices"]["h1"] == ["compressed", "compressed"],
                     "config lacks the choices")
    opt = _sgd(model)
    losses = [_step(model, opt, rank, step) for step in range(3)]
    s = state.stats()
    assert_all_ranks(s["bytes_sent"] < 0.5 * s["dense_bytes"], f"reduce-scatter bytes {s['bytes_sent']} vs {s['dense_bytes']}")
    assert_all_ranks(s["allgather_bytes_sent"] < 0.5 * s["allgather_dense_bytes"], "all-gather bytes not cut")
    assert_all_ranks(all(torch.isfinite(torch.tensor(losses))), f"losses {losses}")
    # --- save (DCP and the per-rank state_dict) and the uninterrupted continuation
    model_sd, optim_sd = get_state_dict(model, opt)  # the user's SGD keeps its momentum buffers (QSGD: unchanged)
    dcp.save({"model": model_sd, "optim": optim_sd, "commpress": state.dcp()}, checkpoint_id=ckpt)
    plain_sd = state.state_dict()
    for step in range(3, 5):
        _step(model, opt, rank, step)
    after = full_params(model)
    # --- fast link: every module exact, bit for bit plain FSDP
    ref, fast = make_fsdp(), make_fsdp()
    fstate = commpress.fsdp.register(fast, "auto", auto_link=FAST, **FAST_CALIBRATION)
    assert_all_ranks(all(c == ("dense", "dense") for c in _choices(fstate).values()), f"fast link chose {_choices(fstate)}")
    ref_opt, fast_opt = _sgd(ref), _sgd(fast)
    for step in range(4):
        a, b = _step(ref, ref_opt, rank, step), _step(fast, fast_opt, rank, step)
        assert_all_ranks(a == b, f"step {step}: loss {b} != plain FSDP's {a}")
    assert_all_ranks(torch.equal(full_params(ref), full_params(fast)), "fast-link auto differs from plain FSDP")
    # --- the saved choices win over a new calibration: DCP ...
    resumed = make_fsdp(seed=1)
    rstate = commpress.fsdp.register(resumed, "auto", auto_link=FAST, **FAST_CALIBRATION)
    ropt = _sgd(resumed)
    model_sd, optim_sd = get_state_dict(resumed, ropt)
    sd = {"model": model_sd, "optim": optim_sd, "commpress": rstate.dcp()}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(resumed, ropt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_all_ranks(_choices(rstate) == chosen and rstate.auto.loaded, f"DCP load chose {_choices(rstate)}")  # type: ignore[union-attr]
    for step in range(3, 5):
        _step(resumed, ropt, rank, step)
    assert_all_ranks(torch.equal(full_params(resumed), after), "DCP-resumed auto run differs from the uninterrupted one")
    # ... and the per-rank state_dict
    again = commpress.fsdp.register(make_fsdp(), "auto", auto_link=FAST, **FAST_CALIBRATION)
    again.load_state_dict(plain_sd)
    assert_all_ranks(_choices(again) == chosen and again.stats()["auto_loaded"] == 1, "state_dict load lost the choices")
    # a checkpoint of another codec is refused by name, both ways
    other = commpress.fsdp.register(make_fsdp(), "qsgd", bits=2)
    for target, saved, match in ((again, other.state_dict(), "not written by codec='auto'"),
                                 (other, plain_sd, "written by codec='auto'")):
        try:
            target.load_state_dict(saved)
        except ValueError as exc:
            assert_all_ranks(match in str(exc), f"unclear error: {exc}")
        else:
            assert_all_ranks(False, f"loaded a mismatched checkpoint ({match})")
    # --- a calibration that fails on one rank: every rank exact, with a reason
    real = costmodel.calibrate_device

    def broken(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise RuntimeError("no timer on this rank")
        return real(*args, **kwargs)

    costmodel.calibrate_device = broken  # type: ignore[assignment]
    try:
        failed = commpress.fsdp.register(make_fsdp(), "auto", auto_link=SLOW, **FAST_CALIBRATION)
    finally:
        costmodel.calibrate_device = real
    assert failed.auto is not None
    assert_all_ranks(all(c == ("dense", "dense") for c in _choices(failed).values())
                     and failed.stats()["auto_fallback"] == 1 and "calibration failed" in failed.auto.fallback,
                     f"fallback: {_choices(failed)} {failed.auto.fallback!r}")
    # a link calibration that raises (every rank: it is a collective) falls back too, ranks in step
    real_link = auto_mod.calibrate_link

    def no_link(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the link cannot be timed")

    auto_mod.calibrate_link = no_link  # type: ignore[assignment]
    try:
        unlinked = commpress.fsdp.register(make_fsdp(), "auto", **FAST_CALIBRATION)
    finally:
        auto_mod.calibrate_link = real_link
    assert unlinked.auto is not None
    assert_all_ranks(all(c == ("dense", "dense") for c in _choices(unlinked).values())
                     and "link calibration failed" in unlinked.auto.fallback, f"link fallback: {unlinked.auto.fallback!r}")
    # every module forced to one option runs as that option's fixed-codec registration, bit for bit
    for option, codec, kw in (("bf16", "bf16", {"param_codec": "bf16"}),
                              ("compressed", "qsgd", {"bits": 2, "param_codec": {"forward": "int8", "backward": "reuse"}})):
        forced, twin = make_fsdp(), make_fsdp()
        fstate = commpress.fsdp.register(forced, "auto", auto_link=FAST, **FAST_CALIBRATION)
        assert fstate.auto is not None
        fstate.auto.choices = {m.name: ModuleChoice(m.name, option, option) for m in fstate.modules}
        fstate._apply_auto()
        commpress.fsdp.register(twin, codec, **kw)
        forced_opt, twin_opt = _sgd(forced), _sgd(twin)
        for step in range(3):
            _step(forced, forced_opt, rank, step)
            _step(twin, twin_opt, rank, step)
        assert_all_ranks(torch.equal(full_params(forced), full_params(twin)), f"auto forced to {option} differs from {codec}")
        assert_all_ranks(fstate.stats()["bytes_sent"] > 0 and fstate.stats()["allgather_bytes_sent"] > 0, "nothing counted")
    Path(ckpt, f"done{rank}").write_text("ok")


def worker_discovery_first_step(rank: int, world: int) -> None:
    """Registered without ``optimizer=``, top-k and sign with the user's SGD momentum (and AdamW, whose
    warm-up must cover step 0) run bit for bit the run registered with ``optimizer=``: an optimizer
    built before the first backward is found at the first reduce-scatter; one built after it is
    adopted after its first step, the local velocities started from that step's local gradients."""
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    for codec, params, make_opt, when, steps in (
        ("topk", {"ratio": 0.1}, _sgd, "after its step", 5), ("sign", {}, _sgd, "after its step", 5),
        ("topk", {"ratio": 0.1}, _sgd, "first reduce-scatter", 5),
        ("sign", {}, adamw, "first reduce-scatter", 53),
    ):
        passed, found = make_fsdp(), make_fsdp()
        passed_opt = make_opt(passed)
        found_opt = make_opt(found) if when == "first reduce-scatter" else None
        commpress.fsdp.register(passed, codec, optimizer=passed_opt, **params)
        state = commpress.fsdp.register(found, codec, **params)
        assert_all_ranks(state.keeping_first_gradients and state.discovery is not None, "not keeping first gradients")
        for step in range(steps):
            if found_opt is None:  # built after the first backward: nothing to find at the first reduce-scatter
                x, y = batch(rank, step)
                F.cross_entropy(found(x), y).backward()
                assert_all_ranks(state.optimizer is None, f"{codec}: adopted before an optimizer existed")
                found_opt = make_opt(found)
                found_opt.step()
                a, b = _step(passed, passed_opt, rank, step), 0.0
            else:
                a, b = _step(passed, passed_opt, rank, step), _step(found, found_opt, rank, step)
                assert_all_ranks(a == b, f"{codec} step {step}: loss {b} != {a} (optimizer= passed)")
            if step == 0:
                assert_all_ranks(state.optimizer is found_opt and not state.keeping_first_gradients
                                 and not state._first_gradients, f"{codec}: not adopted, or gradients still kept")
        assert_all_ranks(torch.equal(full_params(passed), full_params(found)),
                         f"{codec}, {when}: discovered run differs from the run with optimizer=")
