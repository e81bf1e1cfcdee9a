"""Preemption (:mod:`commpress.preemption`): SIGTERM on one rank stops every rank after the same step.

The end-to-end test runs real processes (their exit codes are the point): a run whose rank 1
gets SIGTERM, then fresh processes that train uninterrupted and then restart from what every
rank saved; the restart must end bit for bit where the uninterrupted run did. The unit tests run in this process, without a
process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import distributed as dist

import commpress
from commpress.checkpoint import load_state, save_state
from commpress.preemption import EXIT_CODE, PreemptionHandler, stop_step

WORKERS = Path(__file__).resolve().parent / "preemption_workers.py"
ROOT = WORKERS.parent.parent
TOTAL, SIGNAL_AT, WORLD = 12, 5, 2


def _run_ranks(phase: str, tmp: Path, outdir: Path, kind: str = "ddp", world: int = WORLD) -> list[subprocess.Popen[bytes]]:
    init = tmp / f"init-{phase}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return [
        subprocess.Popen(
            [sys.executable, str(WORKERS), phase, str(rank), str(world), str(init), str(outdir), str(TOTAL), "1", str(SIGNAL_AT), kind],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float = 120.0) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, out.decode(errors="replace")))
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "world"), [("ddp", 4), ("fsdp", 2)])
def test_sigterm_on_one_rank_saves_every_rank_at_one_step_and_resumes_bit_exact(tmp_path: Path, kind: str, world: int) -> None:
    """DDP at 4 ranks (per-rank files) and FSDP2 at 2 (one ``torch.distributed.checkpoint`` with ``state.dcp()``)."""
    results = _wait(_run_ranks("preempt", tmp_path, tmp_path, kind, world), timeout=180.0)
    for rank, (code, out) in enumerate(results):
        assert code == EXIT_CODE, f"rank {rank} exited with {code}, expected {EXIT_CODE}:\n{out}"
    saved = [json.loads((tmp_path / f"saved-rank{rank}.json").read_text()) for rank in range(world)]
    # rank 1 is signalled before step 5 and posts at the end of it (5 + 1 steps done): stop after 8
    expected = stop_step(SIGNAL_AT + 1)
    assert [s["step"] for s in saved] == [expected] * world, saved
    assert [s["signalled"] for s in saved] == [None, int(signal.SIGTERM)] + [None] * (world - 2), saved
    # fresh processes: the uninterrupted reference, then the restart from the saved files
    for code, out in _wait(_run_ranks("resume", tmp_path, tmp_path, kind, world), timeout=180.0):
        assert code == 0, out
    finals = [torch.load(tmp_path / f"final-full-rank{r}.pt", weights_only=True) for r in range(world)]
    assert all(torch.equal(finals[0], f) for f in finals[1:]), "the uninterrupted run's ranks differ"
    for rank in range(world):
        resumed = torch.load(tmp_path / f"final-resume-rank{rank}.pt", weights_only=True)
        assert torch.equal(resumed, finals[rank]), f"rank {rank}: the resumed run differs from the uninterrupted one"


def test_stop_step_leaves_every_rank_a_check_before_the_stop() -> None:
    assert stop_step(6) == 8
    for k in (1, 2, 3, 5):
        for s in range(20):
            stop = stop_step(s, k)
            assert stop >= s + 2
            # every peer (at s - 1 or s when the key appears) reads it at a check before the stop
            assert any(c % k == 0 for c in range(s + 1, stop)), (s, k, stop)


@pytest.fixture
def no_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")


def test_signal_handler_only_sets_a_flag(no_process_group: None) -> None:
    calls: list[int] = []
    handler = commpress.install_preemption_handler(None, calls.append, optimizer=None, exit_code=None)
    try:
        assert not handler.step_done() and handler.step == 1
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
        assert handler.signalled == signal.SIGTERM
        assert calls == [] and handler.stop_step is None and not handler.stopped  # nothing ran yet
        assert handler.step_done()  # one rank: stop at the end of this step
        assert calls == [2] and handler.stopped and handler.step_done() and calls == [2]
    finally:
        handler.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_second_signal_during_save_does_not_corrupt_the_file(tmp_path: Path, no_process_group: None) -> None:
    path = str(tmp_path / "state.cpst")
    save_state(path, {"step": 0, "residual": torch.zeros(1000)})
    wanted = {"step": 7, "residual": torch.arange(100_000, dtype=torch.float32)}
    calls: list[int] = []

    def save(step: int) -> None:
        calls.append(step)
        os.kill(os.getpid(), signal.SIGTERM)  # the grace period's second SIGTERM, mid-save
        save_state(path, wanted)
        os.kill(os.getpid(), signal.SIGTERM)

    handler = PreemptionHandler(save, exit_code=None, start_step=6)
    try:
        handler._on_signal(signal.SIGTERM, None)
        assert handler.step_done()
    finally:
        handler.close()
    assert calls == [7]
    got = load_state(path)
    assert got["step"] == 7 and torch.equal(got["residual"], wanted["residual"])
    assert [p.name for p in tmp_path.iterdir()] == ["state.cpst"]  # no temporary file left


def test_ranks_agree_through_the_store_with_check_every(no_process_group: None) -> None:
    """Two handlers on one store, in two threads stepping in lock-step: the signalled one posts, both stop together."""
    store = dist.HashStore()
    saved: dict[int, int] = {}
    handlers = []
    for rank in range(2):
        h = PreemptionHandler(lambda step, r=rank: saved.setdefault(r, step), signals=(), exit_code=None,
                              check_every=3, store=store, save_timeout=10)
        h.world, h.rank, h._key = 2, rank, "commpress/preempt/test"
        handlers.append(h)
    lockstep = threading.Barrier(2, timeout=10)

    def ranks_loop(h: PreemptionHandler) -> None:
        for step in range(20):
            lockstep.wait()  # the step's all-reduce
            if h.rank == 1 and step == 4:
                h._on_signal(signal.SIGTERM, None)
            if h.step_done():
                return

    threads = [threading.Thread(target=ranks_loop, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert saved == {0: stop_step(5, 3), 1: stop_step(5, 3)} == {0: 7, 1: 7}
    assert [h.stop_step for h in handlers] == [7, 7]


def test_without_a_known_optimizer_it_counts_the_first_optimizer_to_step(no_process_group: None) -> None:
    """A state registered without ``optimizer=`` knows none yet: the first optimizer that steps is counted."""
    w = torch.nn.Parameter(torch.ones(2))
    a, b = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1)
    handler = commpress.install_preemption_handler(None, lambda step: None, exit_code=None)
    try:
        for opt in (a, b, a, b, a):
            w.grad = torch.ones(2)
            opt.step()
        assert handler.step == 3  # a's steps only
    finally:
        handler.close()
    w.grad = torch.ones(2)
    a.step()
    assert handler.step == 3  # closed: the global hook is gone
    with pytest.raises(ValueError, match="optimizer must be"):
        PreemptionHandler(lambda step: None, optimizer="the-first")
