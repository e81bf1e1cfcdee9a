"""Multi-rank workers for tests/fsdp/test_fsdp_dcp.py: ``FSDPCompressionState`` in ``torch.distributed.checkpoint``.

``worker_save`` trains, saves model + optimizer + commpress with ``dcp.save`` and keeps going;
``worker_resume`` (fresh processes) loads it and must end on the same parameters bit for bit;
``worker_other_world`` loads it at another world size. ``worker_resize_save`` /
``worker_resize_load`` save a state at one world size (a file per rank and DCP) and load it at
another. Each worker asserts on all-gathered values (``assert_all_ranks``), so a failure fails
every rank.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
#: ``opt.state_dict()``, and with ternary residuals and velocities (codes and scales in the DCP form) through
#: torch's ``get_state_dict`` / ``set_state_dict`` (FQN-keyed optimizer state, its fake first step included),
#: and AdamW past its 2 dense warm-up steps (1-bit Adam's compressed momentum: local velocities) with
#: ``residual_dtype="auto"`` (int8 residuals and int8 velocity codes at 2 ranks)
CASES: dict[str, tuple[dict[str, Any], str]] = {"float32": (CODEC, "plain"),
                                                "ternary": ({**CODEC, "residual_dtype": "ternary"}, "torch"),
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


def _checkpoint(model: nn.Module, opt: torch.optim.Optimizer, state: Any, api: str,
                checkpoint_id: str | None = None) -> dict[str, Any]:
    """What the user hands to ``dcp.save`` / ``dcp.load`` (``checkpoint_id``: the load names its checkpoint)."""
    stateful = state.dcp() if checkpoint_id is None else state.dcp(checkpoint_id=checkpoint_id)
    if api == "torch":
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "commpress": stateful}
    return {"model": model.state_dict(), "optim": opt.state_dict(), "commpress": stateful}


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
    sd = _checkpoint(model, opt, state, api, ckpt if tag == "adamw" else None)  # named or not: the same world size
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
    """A checkpoint from another world size: a bare ``state.dcp()`` gets DCP's planner error naming the missing
    ``rank{r}_of_{n}`` entry on every rank; ``state.dcp(checkpoint_id=...)`` loads what is global, with one warning."""
    model, opt, state = _setup()
    ckpt = str(Path(ckpt, "float32"))
    try:
        dcp.load({"commpress": state.dcp()}, checkpoint_id=ckpt)
    except CheckpointException as exc:
        assert_all_ranks(f"Missing key in checkpoint state_dict: commpress.rank{rank}_of_{world}." in str(exc),
                         f"unclear error: {exc}")
    else:
        assert_all_ranks(False, f"a checkpoint of another world size loaded at {world} ranks")
    with _warnings() as said:
        sd = _checkpoint(model, opt, state, "plain", ckpt)
        dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert_all_ranks(len(said) == 1 and f"written by 2 ranks (DCP entry of rank {rank}) loaded at {world} ranks" in said[0],
                     f"warnings: {said}")
    assert_all_ranks(state.step == SAVED_STEPS and not state.residuals() and not state.velocities(), repr(state))
    _step(model, opt, rank, SAVED_STEPS)  # FSDP skips its reduce-scatter on 1 rank: commpress's step stays
    assert_all_ranks(bool(torch.isfinite(full_params(model)).all()), "no step after it")


# ----- another world size: a file per rank and DCP ----------------------------------------------------
RESIZE_CODEC: dict[str, Any] = {**CODEC, "residual_dtype": "auto"}  # int8 / int8 at 2 ranks, int8 / int4 at 3
RESIZE_STEPS = 3


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(v.double().square().sum()) for v in tensors.values()) ** 0.5


@contextmanager
def _warnings() -> Iterator[list[str]]:
    """The warnings logged on the ``commpress`` logger inside the block."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    handler = Keep()
    logging.getLogger("commpress").addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger("commpress").removeHandler(handler)


def _global(state: commpress.fsdp.FSDPCompressionState) -> dict[str, Any]:
    """What a resize keeps (the same on every rank)."""
    return {"step": state.step, "seed": state.seed, "guard": state.guard.state(), "calls": [m.calls for m in state.modules],
            "codec": state.codec.config()}


def worker_resize_save(rank: int, world: int, out: str) -> None:
    """Train, then save a file per rank and a DCP checkpoint; another rank's state at this world size is refused."""
    model, opt, state = _setup(codec=RESIZE_CODEC)
    for step in range(RESIZE_STEPS):
        _step(model, opt, rank, step)
    assert_all_ranks(state.residual_kind == "int8" and state.velocity_kind == "int8", f"{state.residual_dtype}")
    assert_all_ranks(bool(state.residuals()) and bool(state.velocities()) and state.guard.ratio > 0, "nothing per rank")
    per_rank = {"residuals": state.residuals(), "velocities": state.velocities()}
    Path(out, f"per-rank{rank}.json").write_text(json.dumps({k: [len(v), _norm(v)] for k, v in per_rank.items()}))
    state.save(str(Path(out, f"commpress-rank{rank}.cpst")))
    dcp.save(_checkpoint(model, opt, state, "plain"), checkpoint_id=str(Path(out, "dcp")))
    full = full_params(model)
    if rank == 0:
        Path(out, "saved.json").write_text(json.dumps({**_global(state), "residual_dtype": str(state.residual_dtype)}))
        torch.save(full, Path(out, "full.pt"))
    dist.barrier()
    for bad in (Path(out, f"commpress-rank{1 - rank}.cpst"), None):  # the same world size: a mix-up, not a resize
        try:
            if bad is None:
                state.load_state_dict({**state.state_dict(), "rank": 1 - rank})
            else:
                state.load(str(bad))
        except ValueError as exc:
            assert_all_ranks(f"rank mismatch: checkpoint has {1 - rank}, this state {rank}" in str(exc), str(exc))
        else:
            assert_all_ranks(False, "another rank's state loaded at the same world size")


def worker_resize_load(rank: int, world: int, out: str) -> None:
    """Load at another world size, from the files and from DCP: what is global kept, per-rank state dropped with one
    warning, kinds recomputed for this world size, then training goes on with every rank's state alike."""
    saved = json.loads(Path(out, "saved.json").read_text())
    source = rank if rank < 2 else 0  # a rank the old run did not have reads rank 0's
    for how in ("file", "dcp"):
        model, opt, state = _setup(seed=1, codec=RESIZE_CODEC)
        with _warnings() as said:
            if how == "file":
                state.load(str(Path(out, f"commpress-rank{source}.cpst")))
            else:
                ckpt = str(Path(out, "dcp"))
                sd = _checkpoint(model, opt, state, "plain", ckpt)
                dcp.load(sd, checkpoint_id=ckpt)
                model.load_state_dict(sd["model"])
                opt.load_state_dict(sd["optim"])
                assert_all_ranks(torch.equal(full_params(model), torch.load(Path(out, "full.pt"), weights_only=True)),
                                 "DCP did not reshard the model")
        label = "file" if how == "file" else "DCP entry"
        assert_all_ranks(len(said) == 1, f"{how}: {len(said)} warnings: {said}")
        warning = said[0]
        assert_all_ranks(f"written by 2 ranks ({label} of rank {source}) loaded at {world} ranks (rank {rank})" in warning,
                         f"{how}: {warning}")
        # the counts and norms of what was dropped: the saved rank's residuals and velocities
        found = re.search(r"state: (\d+) error-feedback residual\(s\) \(norm (\S+)\) and (\d+) velocity\(ies\) "
                          r"\(norm (\S+)\), which start empty", warning)
        dropped = json.loads(Path(out, f"per-rank{source}.json").read_text())
        ok = found is not None and all(
            int(found[i]) == dropped[k][0] and abs(float(found[i + 1]) - dropped[k][1]) <= 1e-3 * dropped[k][1]
            for i, k in ((1, "residuals"), (3, "velocities")))
        assert_all_ranks(ok, f"{how}: {warning} does not name {dropped}")
        assert_all_ranks(_global(state) == {k: saved[k] for k in _global(state)},
                         f"{how}: global state {_global(state)} != saved {saved}")
        assert_all_ranks(not state.residuals() and not state.velocities(), f"{how}: per-rank state kept")
        # residual_dtype="auto" sized for this world size, not the file's
        kinds = {1: ("float32", "float32"), 3: ("int8", "int4")}[world]
        assert_all_ranks((state.residual_kind, state.velocity_kind) == kinds, f"{how}: kinds {state.residual_kind}, "
                         f"{state.velocity_kind}; saved {saved['residual_dtype']}")
        for step in range(RESIZE_STEPS, RESIZE_STEPS + 2):
            _step(model, opt, rank, step)
        states: list[Any] = [None] * world
        dist.all_gather_object(states, _global(state))
        assert_all_ranks(all(s == states[0] for s in states) and states[0]["step"] == RESIZE_STEPS + 2,
                         f"{how}: ranks differ after training on: {states}")
        assert_all_ranks(bool(torch.isfinite(full_params(model)).all()), f"{how}: non-finite parameters")
        assert_all_ranks(world == 1 or bool(state.residuals()), f"{how}: no residuals after compressed steps")
