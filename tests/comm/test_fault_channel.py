"""The threads commpress starts or hands callbacks to end before the interpreter does: fault-channel watchers, and gloo's workers freeing callbacks."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

import comm_workers as cw
import ddp_workers as w


def test_close_stops_the_watcher_without_its_wake_key() -> None:
    w.launch(cw.worker_fault_channel_close, 2, timeout=120)


@pytest.mark.parametrize("linger_s", [0.3, 0.9])
def test_every_rank_exits_cleanly_after_the_store_host_is_gone(linger_s: float) -> None:
    # mp.spawn raises ProcessExitedException naming the signal if any rank dies at exit (SIGABRT/SIGSEGV)
    mp.spawn(cw.exit_after_the_store_host, args=(4, w.free_port(), 12, linger_s), nprocs=4, join=True)


def test_a_destroyed_group_can_be_created_again_on_the_same_port() -> None:
    mp.spawn(cw.init_twice_on_one_port, args=(2, w.free_port()), nprocs=2, join=True)


@pytest.mark.parametrize("register", ["then", "add_done_callback"])
def test_exit_waits_for_the_backend_thread_to_free_a_callback(register: str) -> None:
    mp.spawn(cw.exit_while_a_callback_is_freed, args=(2, w.free_port(), register), nprocs=2, join=True)


def test_counted_callbacks_pass_values_and_errors_through_and_are_uncounted_once_freed() -> None:
    import gc

    import torch

    from commpress.comm import callbacks

    fut: torch.futures.Future[int] = torch.futures.Future()
    doubled = callbacks.then(fut, lambda f: f.value() * 2)

    def fails(f: torch.futures.Future[int]) -> int:
        raise ValueError("decode failed")

    failed = callbacks.then(fut, fails)
    seen: list[int] = []
    callbacks.add_done_callback(fut, lambda f: seen.append(f.value()))
    fut.set_result(21)  # runs the callbacks here, on this thread, inline
    assert doubled.wait() == 42 and seen == [21]
    with pytest.raises(RuntimeError, match="decode failed"):
        failed.wait()
    gc.collect()
    assert callbacks.running() == 0 and callbacks.wait_for_backend_threads(timeout=0.0)
