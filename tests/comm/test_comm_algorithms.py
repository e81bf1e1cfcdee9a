"""Each collective algorithm run directly on a 2-rank gloo group (not only through the adapters)."""

from __future__ import annotations

import pytest

from commpress import comm
from commpress.errors import CodecError

import comm_workers as cw
import ddp_workers as w


def test_all_reduce_algorithms_average_count_their_wire_plan_and_agree_across_ranks() -> None:
    w.launch(cw.worker_algorithms, 2, timeout=240)


def test_reduce_scatter_algorithms_end_in_the_shard_and_count_their_wire_plan() -> None:
    w.launch(cw.worker_reduce_scatter, 2, timeout=240)


def test_shard_algorithms_are_not_all_reduce_choices() -> None:
    codec = comm.resolve_codec("topk", {"ratio": 0.1}, "test")
    with pytest.raises(CodecError, match="shard"):
        comm.check_algorithm("reducescatter", codec, 2)
    assert comm.check_algorithm("allgather", codec, 2) == "allgather"
