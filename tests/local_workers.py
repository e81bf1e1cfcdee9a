"""Multi-rank workers for tests/local/test_local.py: LocalSGD and DiLoCo on 2 gloo ranks."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commpress.local
from commpress.errors import ConfigurationError

from ddp_workers import Net, assert_all_ranks, assert_same_across_ranks, batch, digest, flat_params


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, poison: bool = False) -> None:
    x, y = batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    if poison:
        next(model.parameters()).grad.fill_(float("nan"))  # type: ignore[union-attr]
    opt.step()


def same_across_ranks(model: torch.nn.Module) -> bool:
    mine = torch.tensor([digest(model)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(bool(e == everyone[0]) for e in everyone)


def worker_equals_data_parallel(rank: int, world: int) -> None:
    """H=1, identity codec, outer SGD lr=1 momentum 0 == data-parallel SGD on the same batches."""
    ref = make_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with commpress.local.DiLoCo(model, opt, sync_every=1, codec="none", outer_lr=1.0, outer_momentum=0.0,
                                nesterov=False) as diloco:
        for step in range(6):
            x, y = batch(rank, step)
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            for p in ref.parameters():  # plain data parallel: average the gradients
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            ref_opt.step()
            inner_step(model, opt, rank, step)
            assert_all_ranks(torch.allclose(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6),
                             f"DiLoCo(H=1) differs from data-parallel SGD at step {step}")
            assert_same_across_ranks(model, f"step {step}")
    assert diloco.stats()["syncs"] == 6


def worker_localsgd_every_h(rank: int, world: int, h: int) -> None:
    """LocalSGD averages exactly at steps H, 2H, ... (the mean of the replicas, bit-exact), not between."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shadow = make_net()  # the same replica without LocalSGD: the average is done by hand
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=0.05, momentum=0.9)
    with commpress.local.LocalSGD(model, opt, sync_every=h) as local:
        for step in range(1, 2 * h + 2):
            inner_step(model, opt, rank, step)
            inner_step(shadow, shadow_opt, rank, step)
            if step % h == 0:
                flat = torch.cat([p.detach().reshape(-1) for p in shadow.parameters()])
                flat.div_(world)
                dist.all_reduce(flat)
                off = 0
                with torch.no_grad():
                    for p in shadow.parameters():
                        p.copy_(flat[off : off + p.numel()].view(p.shape))
                        off += p.numel()
            assert_all_ranks(torch.equal(flat_params(model), flat_params(shadow)), f"step {step}: not the hand average")
            synced = same_across_ranks(model)
            assert_all_ranks(synced == (step % h == 0), f"step {step}: ranks identical={synced}, H={h}")
    assert local.stats()["syncs"] == (2 * h + 1) // h
    inner_step(model, opt, rank, 99)  # outside the context: no hook, no sync
    assert local.step == 2 * h + 1


def _diloco(model: torch.nn.Module, opt: torch.optim.Optimizer, codec: str, opts: dict[str, Any]) -> commpress.local.DiLoCo:
    return commpress.local.DiLoCo(model, opt, sync_every=3, codec=codec, min_numel=64, **opts)


def worker_resume_save(rank: int, world: int, out: str, cases: list[tuple[str, dict[str, Any]]], split: int, total: int) -> None:
    """Per case: an uninterrupted run (digest written), and a run that saves everything after ``split`` steps."""
    for codec, opts in cases:
        _resume_save(rank, str(Path(out, codec)), codec, opts, split, total)


def worker_resume_load(rank: int, world: int, out: str, cases: list[tuple[str, dict[str, Any]]], split: int, total: int) -> None:
    """Per case, in fresh processes: a fresh model, optimizer and DiLoCo load the files and continue."""
    for codec, opts in cases:
        _resume_load(rank, str(Path(out, codec)), codec, opts, split, total)


def _resume_save(rank: int, out: str, codec: str, opts: dict[str, Any], split: int, total: int) -> None:
    Path(out).mkdir(exist_ok=True)
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _diloco(model, opt, codec, opts):
        for step in range(total):
            inner_step(model, opt, rank, step)
    Path(out, f"full{rank}").write_text(str(digest(model)))
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _diloco(model, opt, codec, opts) as diloco:
        for step in range(split):
            inner_step(model, opt, rank, step)
    diloco.save(str(Path(out, f"diloco{rank}")))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, Path(out, f"user{rank}"))


def _resume_load(rank: int, out: str, codec: str, opts: dict[str, Any], split: int, total: int) -> None:
    model = make_net(seed=123)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = _diloco(model, opt, codec, opts)
    user = torch.load(Path(out, f"user{rank}"), weights_only=True)
    model.load_state_dict(user["model"])
    opt.load_state_dict(user["opt"])
    state = commpress.checkpoint.load_state(str(Path(out, f"diloco{rank}")))
    # hostile or mismatched states are refused by name, and change nothing
    before = diloco.state_dict()
    for bad, match in _bad_states(state):
        with pytest.raises(ValueError, match=match):
            diloco.load_state_dict(bad)
    assert torch.equal(diloco.state_dict()["global"], before["global"]) and diloco.step == 0
    diloco.load(str(Path(out, f"diloco{rank}")))
    with diloco:
        for step in range(split, total):
            inner_step(model, opt, rank, step)
    Path(out, f"resumed{rank}").write_text(str(digest(model)))


def _bad_states(state: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    out = []
    nan = copy.deepcopy(state)
    nan["global"][3] = math.nan
    out.append((nan, "global contains NaN"))
    short = copy.deepcopy(state)
    short["global"] = short["global"][:-1]
    out.append((short, "global has"))
    other = copy.deepcopy(state)
    other["config"]["sync_every"] = 4
    out.append((other, "config.sync_every"))
    missing = copy.deepcopy(state)
    del missing["outer_optimizer"]
    out.append((missing, "missing"))
    steps = copy.deepcopy(state)
    steps["step"] = -1
    out.append((steps, "step must be"))
    groups = copy.deepcopy(state)
    groups["outer_optimizer"]["param_groups"][0]["lr"] = math.inf
    out.append((groups, "outer_optimizer"))
    return out


def worker_nonfinite_skips(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]]) -> None:
    """A NaN on rank 1 before sync 2 skips that outer step on every rank; training goes on from the global copy."""
    for codec, opts in cases:
        _nonfinite_skips(rank, codec, opts)


def _nonfinite_skips(rank: int, codec: str, opts: dict[str, Any]) -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with commpress.local.DiLoCo(model, opt, sync_every=2, codec=codec, min_numel=64, **opts) as diloco:
        for step in range(4):
            inner_step(model, opt, rank, step)
        before = diloco.state_dict()
        inner_step(model, opt, rank, 4)
        inner_step(model, opt, rank, 5, poison=rank == 1)  # sync 2 runs inside this step
        after = diloco.state_dict()
        assert_all_ranks(torch.equal(flat_params(model), before["global"]), "parameters are not the pre-sync global copy")
        assert_all_ranks(torch.equal(after["global"], before["global"]), "the global copy moved")
        for key, value in before["outer_optimizer"]["state"].items():
            assert torch.equal(after["outer_optimizer"]["state"][key]["momentum_buffer"], value["momentum_buffer"])
        for side in ("worker", "server"):
            if before["feedback"][side] is not None:
                b, a = before["feedback"][side]["residuals"], after["feedback"][side]["residuals"]
                assert_all_ranks(set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b), f"{side} residuals changed")
        assert_all_ranks(diloco.stats()["skipped_syncs"] == 1 and diloco.stats()["syncs"] == 3, f"stats {diloco.stats()}")
        assert_same_across_ranks(model, "after the skipped sync")
        # the poisoned replica's inner optimizer holds NaN momentum: the user resets it (as after any NaN step)
        opt.state.clear()
        for step in range(6, 8):
            inner_step(model, opt, rank, step)
        assert_all_ranks(bool(torch.isfinite(flat_params(model)).all()), "training did not resume")
        assert_all_ranks(diloco.stats()["skipped_syncs"] == 1, "a healthy sync was skipped")
        assert_same_across_ranks(model, "after the next sync")


def worker_ranks_disagree(rank: int, world: int) -> None:
    """Ranks built with different arguments fail at construction, on every rank, naming the difference."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ConfigurationError, match="configured differently"):
        commpress.local.DiLoCo(model, opt, sync_every=4 + rank, verify_timeout=20)
    with pytest.raises(ConfigurationError, match="configured differently"):
        commpress.local.DiLoCo(model, opt, codec="topk", ratio=0.01 * (rank + 1), verify_timeout=20)
    with pytest.raises(ValueError, match="unknown codec"):
        commpress.local.DiLoCo(model, opt, codec="zstd")
    with pytest.raises(ConfigurationError, match="outer_momentum > 0"):
        commpress.local.DiLoCo(model, opt, outer_momentum=0.0)
    with pytest.raises(ValueError, match="ratio|k"):
        commpress.local.DiLoCo(model, opt, codec="topk", ratio=2.0)


def worker_peer_lost(rank: int, world: int, out: str, case: str, overlap: int) -> None:
    """A rank that exits (``exit``: rank 1, ``exit0``: rank 0, the store's host) or hangs (``hang``) between syncs.

    The live rank must raise RankFailedError naming the lost rank within ``sync_timeout`` (+ slack);
    it writes what it saw to ``out`` and leaves with ``os._exit`` (its gloo collective stays pending).
    """
    import os
    import time

    from commpress.errors import RankFailedError

    lost = 0 if case == "exit0" else 1
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    timeout = 3.0 if case == "hang" else 10.0
    diloco = commpress.local.DiLoCo(model, opt, sync_every=2, codec="topk", ratio=0.1, min_numel=64,
                                    fragments=2 if overlap else 1, overlap=overlap, sync_timeout=timeout)
    with diloco:
        for step in range(3):  # syncs at steps 1, 2 (overlap) or 2 (not)
            inner_step(model, opt, rank, step)
        if rank == lost:
            if case == "hang":
                time.sleep(timeout + 4)
            os._exit(0)
        start = time.monotonic()
        try:
            for step in range(3, 8):
                inner_step(model, opt, rank, step)
        except RankFailedError as exc:
            elapsed, message = time.monotonic() - start, str(exc)
            try:
                inner_step(model, opt, rank, 9)
                again = "no error"
            except RankFailedError as exc2:
                again = str(exc2)
            Path(out).write_text(json.dumps({"elapsed": elapsed, "message": message, "again": again,
                                             "rank": exc.rank, "timeout": timeout}))
        os._exit(0)
