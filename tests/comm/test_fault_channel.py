"""The fault channel's watcher threads end before the interpreter does, whatever order the ranks exit in."""

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
