"""Multi-rank workers for ``codec="auto"`` (launched by tests/test_auto.py through ddp_workers.launch)."""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

import commpress
import commpress.ddp
from commpress.comm.costmodel import OPTIONS, Link

from ddp_workers import (
    assert_all_ranks,
    assert_same_across_ranks,
    flat_params,
    make_ddp,
    train_step,
)

FAST = Link(1e-6, 1e-12)  # ~8000 Gbit/s: dense is always cheapest
SLOW = Link(1e-3, 8.0 / 1e6)  # 1 Mbit/s: compressing pays for every bucket with a compressed tensor


def _choices(state: commpress.ddp.CompressionState) -> list[int]:
    stats = state.stats()
    return [int(v) for k, v in sorted(stats.items()) if k.endswith("_choice")]


def _same_everywhere(values: list[int], what: str) -> None:
    mine = torch.tensor(values, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(e, everyone[0]) for e in everyone), f"{what}: ranks chose differently {everyone}"


def worker_calibrated(rank: int, world: int, steps: int) -> None:
    """Real calibration on loopback: same choices and bit-identical parameters on every rank."""
    ddp = make_ddp()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(ddp, "auto", optimizer=opt, auto_interval=3)
    assert state.auto is not None and state.auto.calibrated
    # the hook owns SGD's momentum: at 2 ranks top-k sends the fewest bytes
    assert state.codec.name == "topk" and state.auto.interval == 3, (state.codec, state.auto.interval)
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"auto step {step}")
    choices = _choices(state)
    assert len(choices) >= 4, f"expected >= 4 buckets in stats, got {choices}"
    _same_everywhere(choices, "auto choices")
    link = state.auto.link
    assert link is not None
    _same_everywhere([int(link.alpha * 1e12), int(link.beta * 1e18)], "calibrated link")
    stats = state.stats()
    assert stats["auto_link_gbit"] > 0 and stats["auto_encode_ns"] > 0
    report = state.auto.report()
    assert all(r["option"] in OPTIONS and r["reason"] for r in report)
    assert any(r["measured_s"] for r in report), "no bucket was measured"
    if rank == 0 and os.environ.get("AUTO_DEBUG"):
        print(stats, report)


def worker_forced(rank: int, world: int) -> None:
    """An injected slow link compresses; switched to a fast one, buckets go dense and flush residuals."""
    ddp = make_ddp()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(ddp, "auto", optimizer=opt, auto_codec="topk", ratio=0.05,
                                   auto_link=SLOW, auto_interval=4, auto_margin=0.1)
    assert state.auto is not None and state.auto.link == SLOW
    compressed = [n for n, p in state.plans.items() if p.compressed]
    for step in range(4):
        train_step(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"slow link step {step}")
    report = state.auto.report()
    with_compressed = [r for r in report if r["option"] == "compressed"]
    assert with_compressed, f"a slow link should compress some bucket: {report}"
    # every bucket holding a compressed parameter compresses; the others stay dense or fp16
    stats = state.stats()
    assert stats["auto_compressed_buckets"] == len(with_compressed)
    held = {n: state.residual(n) for n in compressed}
    assert all(r is not None and float(r.abs().sum()) > 0 for r in held.values()), "top-k keeps residuals"
    # the network turns fast: at the next decision (step 8) every bucket switches to dense
    state.auto.set_link(FAST)
    for step in range(4, 9):
        train_step(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"fast link step {step}")
    report = state.auto.report()
    assert all(r["option"] == "dense" for r in report), f"a fast link should go dense: {report}"
    assert state.stats()["auto_switches"] >= len(with_compressed)
    for n in compressed:  # step 8 was dense: it flushed every residual into the all-reduce
        r = state.residual(n)
        assert_all_ranks(r is not None and float(r.abs().sum()) == 0.0, f"residual of {n} not flushed")
    # staying dense: no oscillation at the next decisions
    for step in range(9, 17):
        train_step(ddp, opt, rank, step)
    assert all(r["option"] == "dense" for r in state.auto.report())
    _same_everywhere(_choices(state), "forced choices")
    # every bucket exact and flushed since step 8: the optimizer applies SGD momentum again, from
    # the velocities averaged over ranks (identical buffers everywhere), and the hook keeps none
    assert_all_ranks(state.momentum_in_optimizer and not state.velocity, "momentum not handed back to the optimizer")
    assert all(g["momentum"] == 0.9 for g in opt.param_groups), opt.param_groups
    buffers = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in ddp.parameters()])
    _same_everywhere([zlib.crc32(buffers.numpy().tobytes())], "handed-back momentum buffers")
    saved = state.state_dict()["velocity"]  # a checkpoint now holds the buffers as the velocities
    assert set(saved) == set(state.momentum_rules) and torch.equal(
        torch.cat([saved[n].reshape(-1) for n, _ in ddp.module.named_parameters()]), buffers)
    # the network slows down again: at the next decision (step 19) buckets compress and the hook
    # takes the momentum back before they do
    state.auto.set_link(SLOW)
    for step in range(17, 23):
        train_step(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"slow again, step {step}")
        if step == 19:
            assert_all_ranks(not state.momentum_in_optimizer and len(state.velocity) == len(state.momentum_rules),
                             "the hook did not take the momentum back")
            assert all(g["momentum"] == 0 for g in opt.param_groups)
    assert state.stats()["auto_compressed_buckets"] >= 1 and state.stats()["momentum_handovers"] == 2
    assert_all_ranks(bool(torch.isfinite(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])).all()),
                     "non-finite parameters")


def worker_momentum_handover(rank: int, world: int) -> None:
    """Every bucket dense: after one step SGD's own momentum runs, and training is SGD's; a
    checkpoint taken then resumes into the hook's velocity and continues identically (also with
    gradient accumulation: DDP's ``no_sync`` micro-steps)."""
    for optim, accumulate in (({"momentum": 0.9}, 1), ({"momentum": 0.9, "nesterov": True}, 1), ({"momentum": 0.9}, 2)):
        ref = make_ddp()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, **optim)
        ddp = make_ddp()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, **optim)
        state = commpress.ddp.register(ddp, "auto", optimizer=opt, auto_link=FAST, auto_interval=2)
        for step in range(6):
            train_step(ref, ref_opt, rank, step, accumulate=accumulate)
            train_step(ddp, opt, rank, step, accumulate=accumulate)
            assert_all_ranks(state.momentum_in_optimizer, f"{optim}: momentum not in the optimizer after step {step}")
        diff = float((flat_params(ref) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{optim}: handed-back momentum differs from SGD's by {diff}")
        assert state.stats()["momentum_handovers"] == 1
        # resume in a fresh process's order: model, optimizer, register, then the two checkpoints
        saved, saved_opt = state.state_dict(), opt.state_dict()
        resumed = make_ddp()
        resumed.module.load_state_dict(ddp.module.state_dict())
        resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05, **optim)
        resumed_state = commpress.ddp.register(resumed, "auto", optimizer=resumed_opt, auto_link=FAST, auto_interval=2)
        resumed_opt.load_state_dict(saved_opt)
        resumed_state.load_state_dict(saved)
        assert not resumed_state.momentum_in_optimizer and all(g["momentum"] == 0 for g in resumed_opt.param_groups)
        for step in range(6, 10):
            train_step(ddp, opt, rank, step, accumulate=accumulate)
            train_step(resumed, resumed_opt, rank, step, accumulate=accumulate)
        diff = float((flat_params(resumed) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5 and resumed_state.momentum_in_optimizer, f"{optim}: resumed run differs by {diff}")
        # loaded into a live state whose optimizer holds the momentum: the hook takes it, no buffer is left
        state.load_state_dict(state.state_dict())
        assert not state.momentum_in_optimizer and all(g["momentum"] == 0 for g in opt.param_groups)
        assert not any("momentum_buffer" in opt.state[p] for p in ddp.parameters())
        for step in range(10, 12):
            train_step(ddp, opt, rank, step, accumulate=accumulate)
            train_step(resumed, resumed_opt, rank, step, accumulate=accumulate)
        diff = float((flat_params(resumed) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{optim}: reloaded live state differs by {diff}")


def worker_fp16_send_buffer(rank: int, world: int) -> None:
    """auto's fp16 option averages exactly as a fresh cast would, reusing one send buffer per bucket."""
    from commpress.comm import allreduce as ar

    bucket = torch.empty(1000)
    for step in range(3):
        values = torch.arange(1000, dtype=torch.float32) * (rank + 1) + step
        bucket.copy_(values)
        want = sum(torch.arange(1000, dtype=torch.float32) * (r + 1) + step for r in range(world)) / world
        got = ar.allreduce_mean(bucket, wire_dtype=torch.float16, persistent=True).wait()
        assert got is bucket
        assert torch.allclose(bucket, want.to(torch.float16).float(), rtol=2e-3), f"step {step}"
    kept = [k for k in ar._WIRE_BUFFERS if k[1] == bucket.data_ptr()]
    assert len(kept) == 1, f"expected one reused send buffer for the bucket, got {kept}"
    other = torch.ones(10)  # not persistent: nothing kept for it
    ar.allreduce_mean(other, wire_dtype=torch.float16).wait()
    assert torch.allclose(other, torch.ones(10)) and not [k for k in ar._WIRE_BUFFERS if k[1] == other.data_ptr()]


def worker_both(rank: int, world: int, steps: int) -> None:
    """All scenarios in one launch (spawning ranks costs seconds)."""
    worker_calibrated(rank, world, steps)
    worker_forced(rank, world)
    worker_fp16_send_buffer(rank, world)
    worker_momentum_handover(rank, world)
