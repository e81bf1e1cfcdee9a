"""Multi-rank workers for tests/local/test_local.py: LocalSGD and DiLoCo on 2 gloo ranks."""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

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
    return commpress.local.DiLoCo(model, opt, codec=codec, **{"sync_every": 3, "min_numel": 64, **opts})


ResumeCase = tuple[str, str, dict[str, Any], int, int]


def worker_resume_save(rank: int, world: int, out: str, cases: list[ResumeCase]) -> None:
    """Per case: an uninterrupted run (digest written), and a run that saves everything after ``split`` steps."""
    for name, codec, opts, split, total in cases:
        _resume_save(rank, str(Path(out, name)), codec, opts, split, total)


def worker_resume_load(rank: int, world: int, out: str, cases: list[ResumeCase]) -> None:
    """Per case, in fresh processes: a fresh model, optimizer and DiLoCo load the files and continue."""
    for name, codec, opts, split, total in cases:
        _resume_load(rank, str(Path(out, name)), codec, opts, split, total)


def _resume_save(rank: int, out: str, codec: str, opts: dict[str, Any], split: int, total: int) -> None:
    """``opts["flush"]``: both runs call ``flush()`` after ``split`` steps (merging a sync in flight early)."""
    Path(out).mkdir(exist_ok=True)
    opts = dict(opts)
    flush = opts.pop("flush", False)
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _diloco(model, opt, codec, opts) as diloco:
        for step in range(total):
            if flush and step == split:
                diloco.flush()
            inner_step(model, opt, rank, step)
    Path(out, f"full{rank}").write_text(str(digest(model)))
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _diloco(model, opt, codec, opts) as diloco:
        for step in range(split):
            inner_step(model, opt, rank, step)
    if flush:
        diloco.flush()
        assert diloco.state_dict()["flushed"] is not None, "the case must flush a sync that is still in flight"
    diloco.save(str(Path(out, f"diloco{rank}")))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, Path(out, f"user{rank}"))


def _resume_load(rank: int, out: str, codec: str, opts: dict[str, Any], split: int, total: int) -> None:
    opts = {k: v for k, v in opts.items() if k != "flush"}
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
    other["config"]["sync_every"] += 1
    out.append((other, "config.sync_every"))
    if state["pending"] is not None:  # a sync in flight: its averaged pseudo-gradient is saved, and checked
        gone = copy.deepcopy(state)
        gone["pending"] = None
        out.append((gone, "pending: a checkpoint at inner step"))
        wrong = copy.deepcopy(state)
        wrong["pending"]["fragment"] += 1
        out.append((wrong, "pending.fragment must be"))
        short = copy.deepcopy(state)
        short["pending"]["delta"] = short["pending"]["delta"][1:]
        out.append((short, "pending.delta has"))
    if state.get("flushed") is not None:  # a sync merged early by flush(): the checkpoint says which
        unflushed = copy.deepcopy(state)
        unflushed["flushed"] = None
        out.append((unflushed, "pending: a checkpoint at inner step"))
        other = copy.deepcopy(state)
        other["flushed"] += 1
        out.append((other, "flushed: at inner step"))
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
        commpress.local.DiLoCo(model, opt, outer_momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="ratio|k"):
        commpress.local.DiLoCo(model, opt, codec="topk", ratio=2.0)
    with pytest.raises(ConfigurationError, match="must be a multiple of fragments=3"):
        commpress.local.DiLoCo(model, opt, sync_every=16, fragments=3)
    with pytest.raises(ConfigurationError, match=r"fragments must be an int in \[1, 12\]"):
        commpress.local.DiLoCo(model, opt, sync_every=13, fragments=13)
    with pytest.raises(ConfigurationError, match=r"overlap must be an int in \[0, sync_every/fragments=4\]"):
        commpress.local.DiLoCo(model, opt, sync_every=16, fragments=4, overlap=5)
    with pytest.raises(ConfigurationError, match=r"merge_alpha must be a number in \[0, 1\)"):
        commpress.local.DiLoCo(model, opt, overlap=1, merge_alpha=1.0)
    with pytest.raises(ConfigurationError, match="not both"):
        commpress.local.DiLoCo(model, opt, process_group=dist.group.WORLD, replica_group=dist.group.WORLD)
    with pytest.raises(Exception, match="sync_timeout must be a number of seconds"):
        commpress.local.DiLoCo(model, opt, sync_timeout=0)


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
                time.sleep(timeout + 1.5)  # past the live rank's sync_timeout, then gone
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


def _digest_tensors(ts: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1) for t in ts]).contiguous().view(torch.int32).to(torch.int64)
    return (flat * (torch.arange(flat.numel()) % 65521 + 1)).sum().reshape(1)


def agree(ts: list[torch.Tensor]) -> bool:
    """The tensors are bit-identical on every rank."""
    mine = _digest_tensors(ts)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(bool(e == everyone[0]) for e in everyone)


#: (sync_every, fragments, overlap, merge_alpha): today's DiLoCo; fragments; fragments with a full overlap;
#: three fragments, overlap 1, mixing half the local progress
STREAMING_CASES = [(4, 1, 0, 0.0), (4, 2, 0, 0.0), (4, 2, 2, 0.0), (6, 3, 1, 0.5)]


def worker_streaming_matches_reference(rank: int, world: int, cases: list[tuple[int, int, int, float]]) -> None:
    """Streaming DiLoCo (dense outer) == a hand-written reference, bit for bit after every inner step."""
    for h, k, tau, alpha in cases:
        _streaming_reference(rank, world, h, k, tau, alpha)


def _streaming_reference(rank: int, world: int, h: int, k: int, tau: int, alpha: float) -> None:
    what = f"H={h} fragments={k} overlap={tau} alpha={alpha}"
    model, ref = make_net(), make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_params = list(ref.parameters())
    glob = [p.detach().clone() for p in ref_params]
    outer = torch.optim.SGD(glob, lr=0.5, momentum=0.8, nesterov=True)
    interval = h // k
    diloco = commpress.local.DiLoCo(model, opt, sync_every=h, codec="none", fragments=k, overlap=tau, merge_alpha=alpha,
                                    outer_lr=0.5, outer_momentum=0.8, nesterov=True)  # the reference's outer momentum
    bounds = diloco.bounds
    assert len(bounds) == k + 1 and bounds[0] == 0 and bounds[-1] == len(ref_params)
    pending: tuple[int, int, list[torch.Tensor]] | None = None  # (fragment, launched, averaged delta)
    with diloco:
        for step in range(1, 4 * h + 2):
            inner_step(model, opt, rank, step)
            inner_step(ref, ref_opt, rank, step)
            merged = None
            for phase in (0, 1):
                if pending is not None and step == pending[1] + tau:
                    f, _, avg = pending
                    lo, hi = bounds[f], bounds[f + 1]
                    for i, g in enumerate(glob):
                        g.grad = avg[i - lo] if lo <= i < hi else None
                    outer.step()
                    with torch.no_grad():
                        for p, g in zip(ref_params[lo:hi], glob[lo:hi]):
                            p.copy_(g) if alpha == 0 else p.lerp_(g, 1 - alpha)
                    pending, merged = None, f
                if phase == 0 and step % interval == 0:
                    f = (step // interval - 1) % k
                    lo, hi = bounds[f], bounds[f + 1]
                    delta = torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(glob[lo:hi], ref_params[lo:hi])])
                    delta.div_(world)
                    dist.all_reduce(delta)
                    views, off = [], 0
                    for g in glob[lo:hi]:
                        views.append(delta[off : off + g.numel()].view(g.shape))
                        off += g.numel()
                    pending = (f, step, views)
            assert_all_ranks(torch.equal(flat_params(model), flat_params(ref)), f"{what}: step {step} differs from the reference")
            assert_all_ranks(all(torch.equal(a, b) for a, b in zip(diloco.global_params, glob)),
                             f"{what}: step {step}: the global copy differs from the reference")
            if merged is not None:  # every merge: the global copy, and the merged fragment (alpha 0), agree
                lo, hi = bounds[merged], bounds[merged + 1]
                assert_all_ranks(agree(diloco.global_params), f"{what}: step {step}: global copies differ")
                if alpha == 0:
                    assert_all_ranks(agree(list(model.parameters())[lo:hi]), f"{what}: step {step}: fragment {merged} differs")
    assert diloco.stats()["syncs"] == (4 * h + 1) // interval, diloco.stats()


class Equal4(torch.nn.Module):
    """Four equal 64x64 layers: fragments of 1, 2 or 4 layers are exact fractions of the model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 3 else torch.relu(layer(x))
        return x


def worker_overlap_stats(rank: int, world: int, out: str) -> None:
    """Peak bytes in flight are 1/fragments of the unfragmented sync's (exact); waits and transfers are measured."""
    seen: dict[str, dict[str, float]] = {}
    for k, tau in ((1, 0), (2, 0), (2, 2), (4, 1)):
        model = Equal4()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with commpress.local.DiLoCo(model, opt, sync_every=4, fragments=k, overlap=tau) as diloco:
            for step in range(12):
                x, y = batch(rank, step, d_in=64)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            pending = diloco._pending is not None  # overlap: the last sync is still in flight here
            scheduled = diloco.stats()
        diloco.finish()  # merges it, syncs the fragments' steps no sync took, loads the global copy
        assert_all_ranks(all(torch.equal(p, g) for p, g in zip(model.parameters(), diloco.global_params)),
                         f"fragments {k}, overlap {tau}: the model is not the global copy after finish()")
        assert_all_ranks(same_across_ranks(model), f"fragments {k}, overlap {tau}: ranks differ after finish()")
        assert_all_ranks(diloco._pending is None and (pending or tau == 0), f"fragments {k}, overlap {tau}: pending {pending}")
        seen[f"{k},{tau}"] = {**scheduled, "syncs_after_finish": diloco.stats()["syncs"]}
    if rank == 0:
        Path(out).write_text(json.dumps(seen))


def _replicas_mean(model: torch.nn.Module) -> list[torch.Tensor]:
    """The average over the ranks of ``model``'s parameters (each rank's own replica)."""
    mean = [p.detach().clone() for p in model.parameters()]
    for t in mean:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return mean


def worker_finish_syncs_the_tail(rank: int, world: int) -> None:
    """A run shorter than sync_every: finish() syncs those steps, so the model is the replicas' average
    (dense outer gradient, outer SGD lr 1 without momentum), not the initial parameters; LocalSGD alike."""
    plain = {"sync_every": 8, "codec": "none", "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
    model = Net()
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with commpress.local.DiLoCo(model, opt, **plain) as diloco:
        for step in range(5):
            inner_step(model, opt, rank, step)
    assert_all_ranks(diloco.stats()["syncs"] == 0, "no sync is due in 5 steps of sync_every=8")
    mean = _replicas_mean(model)
    diloco.finish()
    s = diloco.stats()
    assert_all_ranks(s["syncs"] == 1 and s["final_syncs"] == 1, f"finish() ran {s['syncs']} syncs, not 1 final one")
    assert_all_ranks(same_across_ranks(model), "ranks differ after finish()")
    assert_all_ranks(all(torch.allclose(p, m, atol=1e-6) for p, m in zip(model.parameters(), mean)),
                     "after finish() the model is not the average of the replicas' 5 local steps")
    assert_all_ranks(not any(torch.equal(p, s) for p, s in zip(model.parameters(), start)),
                     "finish() dropped the 5 local steps: the model is the initial one")
    # a checkpoint written after finish() loads (the schedule's own sync count still fits the step)
    other = Net()
    again = commpress.local.DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.05), **plain)
    again.load_state_dict(diloco.state_dict())
    assert_all_ranks(all(torch.equal(a, b) for a, b in zip(again.global_params, diloco.global_params)),
                     "the checkpoint written after finish() did not restore the finished global copy")
    # LocalSGD the same: 5 steps of sync_every=8, finish() averages them
    local_model = Net()
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.05, momentum=0.9)
    with commpress.local.LocalSGD(local_model, local_opt, sync_every=8) as local:
        for step in range(5):
            inner_step(local_model, local_opt, rank, step)
    mean = _replicas_mean(local_model)
    local.finish()
    assert_all_ranks(local.stats()["syncs"] == 1 and local.stats()["final_syncs"] == 1, f"LocalSGD {local.stats()}")
    assert_all_ranks(same_across_ranks(local_model), "LocalSGD: ranks differ after finish()")
    assert_all_ranks(all(torch.allclose(p, m, atol=1e-6) for p, m in zip(local_model.parameters(), mean)),
                     "LocalSGD: after finish() the model is not the replicas' average")


def worker_replicas(rank: int, world: int, codec: str, h: int) -> None:
    """4 ranks as 2 replicas of 2 (DDP inside each, DiLoCo across): replicas agree after every sync, not between."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = replicas[rank // 2]
    model = make_net()
    ddp = DDP(model, process_group=mine)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with commpress.local.DiLoCo(model, opt, sync_every=h, codec=codec, min_numel=64, replica_group=mine) as diloco:
        assert dist.get_world_size(diloco.process_group) == 2  # one rank per replica: ranks {0, 2} and {1, 3}
        assert dist.get_process_group_ranks(diloco.process_group) == [rank % 2, rank % 2 + 2]
        for step in range(1, 3 * h + 1):
            x, y = batch(rank, step)  # every rank its own data; DDP averages inside the replica
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            assert_all_ranks(agree_within(model, mine), f"step {step}: a replica's ranks differ")
            synced = agree(list(model.parameters()))
            assert_all_ranks(synced == (step % h == 0), f"step {step}: all ranks identical={synced}, H={h}")
    assert diloco.stats()["syncs"] == 3
    del ddp


def _train_replicas(rank: int, inside: str, h: int, steps: int, trainer_cls: Any = None,
                    **diloco: Any) -> tuple[list[torch.Tensor], list[bool], Any]:
    """4 ranks as 2 replicas of 2 (``inside``: "ddp" or "fsdp", sharded over the replica), DiLoCo
    (or ``trainer_cls``, e.g. LocalSGD) across.

    Returns the full model after ``steps`` steps (gathered inside the replica), whether all four
    ranks held the same full model after each step, and the trainer.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))["shard"]  # ranks {0, 1} / {2, 3}
    model = make_net()
    forward: torch.nn.Module = model
    if inside == "fsdp":
        for layer in (model.inp, model.h1, model.h2, model.h3, model.out):
            fully_shard(layer, mesh=inner)
        fully_shard(model, mesh=inner)
    else:
        forward = DDP(model, process_group=inner.get_group())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def full() -> list[torch.Tensor]:  # the replica's whole model (a collective inside the replica for FSDP)
        return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]

    same = []
    make = trainer_cls or functools.partial(commpress.local.DiLoCo, min_numel=64)
    with make(model, opt, sync_every=h, replica_group=inner.get_group(), **diloco) as trainer:
        for step in range(1, steps + 1):
            x, y = batch(rank, step)  # every rank its own data; DDP / FSDP average inside the replica
            opt.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            opt.step()
            same.append(agree(full()))
    return full(), same, trainer


def _fsdp_inside_resumes_exactly(rank: int) -> None:
    """FSDP2 inside replicas of 2: DiLoCo's state_dict with the model's and AdamW's (saved with a sync in
    flight) resumes into a fresh model bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))["shard"]

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = make_net(seed)
        for layer in (model.inp, model.h1, model.h2, model.h3, model.out):
            fully_shard(layer, mesh=inner)
        fully_shard(model, mesh=inner)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, commpress.local.DiLoCo(model, opt, sync_every=4, min_numel=64, replica_group=inner.get_group())

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x, y = batch(rank, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    model, opt, diloco = build(0)
    with diloco:
        train(model, opt, range(10))
    uninterrupted = [p.full_tensor() for p in model.parameters()]
    model, opt, diloco = build(0)
    with diloco:
        train(model, opt, range(4))  # the sync launched at step 4 is in flight (overlap 1): saved as pending
    state, user = diloco.state_dict(), copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert state["pending"] is not None
    model, opt, diloco = build(7)  # another initialisation: everything comes from the saved states
    model.load_state_dict(user["model"])
    opt.load_state_dict(user["opt"])
    diloco.load_state_dict(state)
    with diloco:
        train(model, opt, range(4, 10))
    assert_all_ranks(all(torch.equal(a, p.full_tensor()) for a, p in zip(uninterrupted, model.parameters())),
                     "FSDP inside: the resumed run is not the uninterrupted one")


def worker_fsdp_replicas(rank: int, world: int, h: int) -> None:
    """FSDP2 inside each replica: every rank syncs its own shard (half the bytes DDP inside sends); the
    replicas agree after every sync and not between; with the averaging outer step (identity codec,
    outer SGD lr 1, no momentum) the model is DDP inside's to float rounding."""
    steps = 3 * h
    _, same, trainer = _train_replicas(rank, "fsdp", h, steps)  # the default outer codec (QSGD 4-bit)
    assert_all_ranks(same == [step % h == 0 for step in range(1, steps + 1)],
                     f"FSDP inside: replicas identical after steps {same}, H={h}")
    assert dist.get_process_group_ranks(trainer.process_group) == [rank % 2, rank % 2 + 2]
    _, same, _ = _train_replicas(rank, "fsdp", h, steps, commpress.local.LocalSGD)
    assert_all_ranks(same == [step % h == 0 for step in range(1, steps + 1)],
                     f"LocalSGD, FSDP inside: replicas identical after steps {same}, H={h}")
    whole = sum(p.numel() for p in make_net().parameters())
    assert_all_ranks(trainer.numel < whole and isinstance(next(iter(trainer.model.parameters())), DTensor),
                     f"FSDP inside: the trainer syncs {trainer.numel} of {whole} elements, not its shard")
    plain = {"codec": "none", "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
    fsdp, _, a = _train_replicas(rank, "fsdp", h, steps, **plain)
    ddp, _, b = _train_replicas(rank, "ddp", h, steps, **plain)
    assert_all_ranks(all(torch.allclose(f, d, rtol=1e-4, atol=1e-6) for f, d in zip(fsdp, ddp)),
                     "FSDP inside a replica does not train the model DDP inside does")
    sent = torch.tensor([a.stats()["bytes_sent"], b.stats()["bytes_sent"]], dtype=torch.float64)
    dist.all_reduce(sent)  # a rank sends its shard, half the model: the four ranks half of what DDP inside sends
    assert_all_ranks(abs(2 * sent[0] - sent[1]) <= 0.01 * sent[1], f"bytes sent, FSDP vs DDP inside (all ranks): {sent}")
    _fsdp_inside_resumes_exactly(rank)
    # a shard synced over the wrong ranks is refused, naming the parameter (before any collective)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    for shard_over, group, error in [
        (None, None, "'inp.weight' is sharded over ranks \\[0, 1, 2, 3\\].*pass replica_group="),  # all four
        (mesh["shard"], mesh["replica"].get_group(), "but replica_group holds ranks"),  # the other dimension
        (mesh, None, "2-D device mesh \\(HSDP"),
    ]:
        model = make_net()
        fully_shard(model, **({} if shard_over is None else {"mesh": shard_over}))
        with pytest.raises(ConfigurationError, match=error):
            commpress.local.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), replica_group=group)


def agree_within(model: torch.nn.Module, group: Any) -> bool:
    mine = _digest_tensors(list(model.parameters()))
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return all(bool(e == everyone[0]) for e in everyone)


def worker_auto_codec(rank: int, world: int) -> None:
    """``codec="auto"``: a very fast given link picks dense, a very slow one sign (the fewest bytes); every rank
    alike; QSGD 4-bit until the choice; a resumed run keeps the saved choice whatever its own link says; bad
    options are refused."""
    from commpress.comm.costmodel import Link
    from commpress.errors import CodecError

    fast, slow = Link.from_gbit(1e4, latency_s=0.0), Link.from_gbit(1e-4)
    chosen: dict[str, tuple[str, float]] = {}
    states: dict[str, Any] = {}
    for name, link, opts in [("fast", fast, {"sync_every": 8, "overlap": 8}), ("slow", slow, {"sync_every": 8}),
                             ("slow_blocking", slow, {"sync_every": 8, "overlap": 0})]:
        model = make_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with commpress.local.DiLoCo(model, opt, codec="auto", auto_link=link, **opts) as diloco:
            assert diloco.config()["outer_auto"] == "undecided" and diloco.stats()["auto_choice"] == -1
            assert diloco.outer.codec.config() == {"name": "qsgd", "bits": 4, "levels": 7, "bucket_size": 512}
            for step in range(16):
                inner_step(model, opt, rank, step)
                if step == 3:
                    states[f"{name}_undecided"] = diloco.state_dict()
        states[name] = diloco.state_dict()  # before flush(): a checkpoint at step 16 holds the sync in flight
        diloco.flush()
        s = diloco.stats()
        assert s["syncs"] == 2 and s["auto_window_s"] > 0 and s["auto_step_s"] > 0, s
        assert all(f"auto_predicted_{c}_s" in s for c in ("dense", "qsgd8", "qsgd4", "sign")), s
        chosen[name] = (diloco.config()["outer_auto"], s["bytes_sent"])
        assert diloco.outer.codec.config()["name"] == {"dense": "none", "sign": "sign"}.get(chosen[name][0], "qsgd")
        assert same_across_ranks_tensor(torch.cat([g.reshape(-1) for g in diloco.global_params]))
    assert chosen["fast"][0] == "dense", chosen
    assert chosen["slow"][0] == "sign" and chosen["slow_blocking"][0] == "sign", chosen
    assert chosen["fast"][1] > 10 * chosen["slow"][1], chosen  # dense sends fp32, sign ~1 bit per element
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, chosen)
    assert all(e == chosen for e in everyone), everyone
    # resume: the saved choice wins over this run's own (slow) link; an undecided one decides again
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    resumed = commpress.local.DiLoCo(model, opt, sync_every=8, overlap=8, codec="auto", auto_link=slow)
    resumed.load_state_dict(states["fast"])
    assert resumed.config()["outer_auto"] == "dense" and resumed.outer.codec.config()["name"] == "none"
    with resumed:
        for step in range(16, 24):
            inner_step(model, opt, rank, step)
    assert resumed.config()["outer_auto"] == "dense" and resumed.stats()["syncs"] == 3
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    again = commpress.local.DiLoCo(model, opt, sync_every=8, overlap=8, codec="auto", auto_link=slow)
    again.load_state_dict(states["fast_undecided"])
    assert again.config()["outer_auto"] == "undecided"
    with again:
        for step in range(4, 8):
            inner_step(model, opt, rank, step)
    assert again.config()["outer_auto"] == "sign"
    # an auto checkpoint does not load into a fixed codec, nor a fixed one into auto
    model = make_net()
    plain = commpress.local.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=8, overlap=8,
                                   codec="sign")  # the codec auto chose: only outer_auto differs
    with pytest.raises(ValueError, match="outer_auto"):
        plain.load_state_dict(states["slow"])
    with pytest.raises(ValueError, match="outer_auto"):
        again.load_state_dict(plain.state_dict())
    model = make_net()
    with pytest.raises(ConfigurationError, match="codec='auto' chooses"):
        commpress.local.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), codec="auto", bits=4)
    with pytest.raises(CodecError, match="auto_link"):
        commpress.local.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), codec="auto", auto_link="1gbit")


def same_across_ranks_tensor(t: torch.Tensor) -> bool:
    """True when ``t`` is bit-identical on every rank."""
    everyone = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return all(torch.equal(e, t) for e in everyone)
