"""A failure on one FSDP rank is every rank's error within seconds (the DDP twin: tests/test_misuse.py).

FSDP's reduce-scatter runs inside the group's :class:`~commpress.comm.faults.FaultChannel`
(``FSDPCompressionState.reduce``): a rank that cannot decode what it received posts the failure,
and the ranks already waiting in the next module's all_to_all raise the same
``RankFailedError`` instead of waiting for the failing rank to exit or the process group's timeout.

The rank program keeps parameters gathered after forward (``reshard_after_forward=False``): with
FSDP's default the other ranks' next collective is FSDP's own backward all-gather, which the
channel cannot end (measured: they wait until the failing rank exits, the channel's documented
limit for collectives commpress did not issue).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fsdp_workers as fw
import misuse_workers as mw


@pytest.mark.parametrize(
    ("world", "codec", "opts"),
    [(2, "topk", {"ratio": 0.05}), (3, "sign", {"block_size": 256})],
)
def test_a_rank_that_cannot_decode_fails_every_fsdp_rank_within_seconds(
    world: int, codec: str, opts: dict[str, Any], tmp_path: Path
) -> None:
    # Rank 1 gets zeroed bytes at step 3 and stays alive 20 s after its error (a slow exit):
    # without the fault channel the others would wait in their next all_to_all until it exits
    # ("connection reset", 20 s later) or, had it stayed, for the process group's timeout (120 s).
    reports = mw.launch(fw.case_corrupt, world, tmp_path, 1, codec, opts, pg_timeout_s=120, bound_s=100,
                        linger={1: 20})
    assert set(reports) == set(range(world)), reports
    for rank in range(world):
        error = reports[rank]["error"]
        assert "RankFailedError: commpress: rank 1 failed at module 'out', reduce-scatter 3: " in error, reports
        assert "WireError: frame from rank 0: bad header" in error, reports
        assert abs(reports[rank]["at"] - reports[1]["at"]) < 10, reports
