"""Multi-rank workers for tests/fsdp/test_fsdp_dcp.py: ``FSDPCompressionState`` in ``torch.distributed.checkpoint``.

``worker_save`` trains, saves model + optimizer + commpress with ``dcp.save`` and keeps going;
``worker_resume`` (fresh processes) loads it and must end on the same parameters bit for bit;
``worker_other_world`` loads it at another world size. Each worker asserts on all-gathered
values (``assert_all_ranks``), so a failure fails every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import commpress.fsdp
from commpress.errors import CodecError
from commpress.fsdp.dcp import _decode_header, _encode_header

from ddp_workers import assert_all_ranks, batch
from fsdp_workers import full_params, make_fsdp

SAVED_STEPS = 3  # K: steps before dcp.save
MORE_STEPS = 3  # N: steps after it
CODEC: dict[str, Any] = {"codec": "topk", "ratio": 0.1}  # biased: residuals, and the user's SGD momentum moved in
#: tag -> (codec, how model and optimizer go to DCP): the case above with ``model.state_dict()`` /
#: ``opt.state_dict()``, and with int8 residuals (codes and scales in the DCP form) through torch's
#: ``get_state_dict`` / ``set_state_dict`` (FQN-keyed optimizer state, its fake first step included),
#: and AdamW past its 2 dense warm-up steps (1-bit Adam's compressed momentum: local velocities) with
#: ``residual_dtype="auto"`` (int8 residuals and int8 velocity codes at 2 ranks)
CASES: dict[str, tuple[dict[str, Any], str]] = {"float32": (CODEC, "plain"),
                                                "int8": ({**CODEC, "residual_dtype": "int8"}, "torch"),
                                                "adamw": ({**CODEC, "adamw": True, "warmup_steps": 2, "residual_dtype": "auto"}, "torch")}


def _setup(seed: int = 0, codec: dict[str, Any] = CODEC) -> tuple[nn.Module, torch.optim.Optimizer,
                                                                   commpress.fsdp.FSDPCompressionState]:
    model = make_fsdp(seed)  # every Linear fully_shard-ed, then the root
    kw = dict(codec)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if kw.pop("adamw", False)
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    state = commpress.fsdp.register(model, kw.pop("codec"), optimizer=opt, **kw)
    return model, opt, state


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _checkpoint(model: nn.Module, opt: torch.optim.Optimizer, state: Any, api: str) -> dict[str, Any]:
    """What the user hands to ``dcp.save`` / ``dcp.load``."""
    if api == "torch":
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "commpress": state.dcp()}
    return {"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp()}


def _residual_norms(state: commpress.fsdp.FSDPCompressionState) -> dict[str, float]:
    return {k: float(v.double().norm()) for k, v in sorted(state.residuals().items())}


def worker_save(rank: int, world: int, ckpt: str, out: str) -> None:
    """Each case: K steps, ``dcp.save``, N more (the uninterrupted run's residuals and final parameters to ``out``)."""
    for tag, (codec, api) in CASES.items():
        _save_case(rank, str(Path(ckpt, tag)), str(Path(out, f"expected_{tag}_{rank}.pt")), codec, api)


def _save_case(rank: int, ckpt: str, out: str, codec: dict[str, Any], api: str) -> None:
    model, opt, state = _setup(codec=codec)
    for step in range(SAVED_STEPS):
        _step(model, opt, rank, step)
    norms = _residual_norms(state)
    assert_all_ranks(bool(norms) and all(v > 0 for v in norms.values()), f"no residuals to save: {norms}")
    assert_all_ranks(bool(state.velocities()), "no velocity in commpress (the SGD momentum moved in, or AdamW's compressed momentum)")
    dcp.save(_checkpoint(model, opt, state, api), checkpoint_id=ckpt)
    saved = {"residuals": {k: v.clone() for k, v in state.residuals().items()},
             "velocity": {k: v.clone() for k, v in state.velocities().items()}, "step": state.step}
    for step in range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS):
        _step(model, opt, rank, step)
    saved["local"] = [p.detach().to_local().clone() for p in model.parameters()]  # type: ignore[operator]
    saved["full"] = full_params(model)
    torch.save(saved, out)


def worker_resume(rank: int, world: int, ckpt: str, out: str) -> None:
    """Fresh processes, each case: ``dcp.load`` into a differently initialised model, N steps == the uninterrupted run;
    then a sign state refuses the top-k checkpoint."""
    for tag, (codec, api) in CASES.items():
        _resume_case(rank, world, str(Path(ckpt, tag)), str(Path(out, f"expected_{tag}_{rank}.pt")), codec, api, tag)
    _, _, other = _setup(codec={"codec": "sign"})  # the same layout, another codec: commpress's own error
    try:
        dcp.load({"commpress": other.dcp()}, checkpoint_id=str(Path(ckpt, "float32")))
    except CodecError as exc:
        assert_all_ranks("codec mismatch" in str(exc) and "TopK" in str(exc), f"unclear error: {exc}")
    else:
        assert_all_ranks(False, "a top-k checkpoint loaded into a sign state")
    assert_all_ranks(other.step == 0 and not other.residuals(), "a refused load changed the state")
    form = other.dcp().state_dict()  # a header naming another rank (a copied or edited checkpoint)
    mine = form[other.dcp().key]
    header = _decode_header(mine["header"])
    mine["header"] = _encode_header({**header, "rank": 1 - rank})
    try:
        other.dcp().load_state_dict(form)
    except ValueError as exc:
        assert_all_ranks(f"rank mismatch: checkpoint has {1 - rank}, this state {rank}" in str(exc), f"unclear: {exc}")
    else:
        assert_all_ranks(False, "another rank's header was accepted")


def _resume_case(rank: int, world: int, ckpt: str, out: str, codec: dict[str, Any], api: str, tag: str) -> None:
    expected = torch.load(out, weights_only=True)
    keys = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert_all_ranks({f"commpress.rank{r}_of_{world}.header" for r in range(world)} <= keys,
                     f"commpress entries not namespaced per rank: {sorted(k for k in keys if 'commpress' in k)}")
    model, opt, state = _setup(seed=1, codec=codec)  # other initial parameters: the load must bring them
    assert_all_ranks(not state.residuals(), "a fresh state already holds residuals")
    sd = _checkpoint(model, opt, state, api)
    dcp.load(sd, checkpoint_id=ckpt)
    if api == "torch":
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    got = state.residuals()
    assert_all_ranks(sorted(got) == sorted(expected["residuals"]) and all(
        torch.equal(got[k], v) for k, v in expected["residuals"].items()), f"{tag}: residuals did not come back")
    assert_all_ranks(_residual_norms(state) == {k: float(v.double().norm()) for k, v in
                                                sorted(expected["residuals"].items())}, f"{tag}: residual norms differ")
    assert_all_ranks(all(v > 0 for v in _residual_norms(state).values()), f"{tag}: loaded residuals are zero")
    velocity = state.velocities()
    assert_all_ranks(sorted(velocity) == sorted(expected["velocity"]) and all(
        torch.equal(velocity[k], v) for k, v in expected["velocity"].items()), f"{tag}: velocities did not come back")
    assert_all_ranks(state.step == expected["step"], f"{tag}: step {state.step}, saved {expected['step']}")
    for step in range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS):
        _step(model, opt, rank, step)
    local = [p.detach().to_local() for p in model.parameters()]  # type: ignore[operator]
    assert_all_ranks(all(torch.equal(a, b) for a, b in zip(local, expected["local"])),
                     f"{tag}, rank {rank}: resumed shards differ from the uninterrupted run")
    assert_all_ranks(torch.equal(full_params(model), expected["full"]), f"{tag}: resumed parameters differ")


def worker_other_world(rank: int, world: int, ckpt: str) -> None:
    """A checkpoint from another world size: DCP's planner names the missing ``rank{r}_of_{n}`` entry, every rank."""
    model, opt, state = _setup()
    try:
        dcp.load({"commpress": state.dcp()}, checkpoint_id=str(Path(ckpt, "float32")))
    except CheckpointException as exc:
        assert_all_ranks(f"Missing key in checkpoint state_dict: commpress.rank{rank}_of_{world}." in str(exc),
                         f"unclear error: {exc}")
    else:
        assert_all_ranks(False, f"a checkpoint of another world size loaded at {world} ranks")
