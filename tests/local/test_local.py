"""commpress.local: LocalSGD and DiLoCo (2 gloo ranks each, workers in tests/local_workers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import commpress.local
from commpress.errors import ConfigurationError

import ddp_workers as w
import local_workers as lw


def test_h1_identity_codec_equals_data_parallel_sgd() -> None:
    w.launch(lw.worker_equals_data_parallel, 2, timeout=120)


def test_localsgd_averages_exactly_every_h_steps() -> None:
    w.launch(lw.worker_localsgd_every_h, 2, 3, timeout=120)


#: (name, codec, options, split, total): biased with residuals (top-k, error feedback) and unbiased with
#: shared seeds (QSGD), both with outer momentum, H=3, saved mid-interval after one sync; streaming
#: top-k, 2 fragments of H=4 with overlap 2, saved at step 5 while the sync launched at step 4 is in
#: flight (it merges at step 6, in the resumed run)
RESUME_CASES: list[tuple[str, str, dict[str, Any], int, int]] = [
    ("topk", "topk", {"ratio": 0.1}, 4, 9), ("qsgd", "qsgd", {"bits": 8}, 4, 9),
    ("streaming", "topk", {"ratio": 0.1, "sync_every": 4, "fragments": 2, "overlap": 2}, 5, 11),
    # the same, but flush() merges that sync at step 5 before the save (the checkpoint holds none in flight)
    ("flushed", "topk", {"ratio": 0.1, "sync_every": 4, "fragments": 2, "overlap": 2, "flush": True}, 5, 11),
]


def test_resume_in_fresh_processes_is_bit_exact(tmp_path: Path) -> None:
    w.launch(lw.worker_resume_save, 2, str(tmp_path), RESUME_CASES, timeout=120)
    w.launch(lw.worker_resume_load, 2, str(tmp_path), RESUME_CASES, timeout=120)
    for name, *_ in RESUME_CASES:
        out = tmp_path / name
        for rank in range(2):
            assert (out / f"resumed{rank}").read_text() == (out / f"full{rank}").read_text(), name
        if name not in ("streaming", "flushed"):
            assert (out / "full0").read_text() == (out / "full1").read_text(), name  # it ends on a sync


def test_nonfinite_pseudo_gradient_on_one_rank_skips_the_outer_step_everywhere() -> None:
    # dense all-reduce (NaN propagates), all-gather with error feedback (sign), unbiased QSGD
    w.launch(lw.worker_nonfinite_skips, 2, [("none", {}), ("sign", {}), ("qsgd", {"bits": 8})], timeout=120)


def test_ranks_configured_differently_fail_at_construction() -> None:
    w.launch(lw.worker_ranks_disagree, 2, timeout=120)


def test_fragments_are_contiguous_whole_parameters_balanced_by_numel() -> None:
    split = commpress.local.diloco.split_fragments
    assert split([10, 10, 10, 10], 1) == [0, 4]
    assert split([10, 10, 10, 10], 2) == [0, 2, 4]
    assert split([10, 10, 10, 10], 4) == [0, 1, 2, 3, 4]
    assert split([1, 100, 1, 1], 2) == [0, 2, 4]  # the boundary nearest the half (101 of 103)
    assert split([100, 1, 1, 1], 3) == [0, 1, 2, 4]  # every fragment keeps at least one parameter
    # the digits MLP of scripts/bench_local.py (64-256-256-10): its 256x256 matrix is a fragment on its own
    assert split([16384, 256, 65536, 256, 2560, 10], 4) == [0, 2, 3, 4, 6]


def test_bad_arguments_raise_clear_errors() -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for trainer in (commpress.local.LocalSGD, commpress.local.DiLoCo):
        with pytest.raises(ConfigurationError, match="sync_every must be an int >= 1"):
            trainer(model, opt, sync_every=0)
        with pytest.raises(ConfigurationError, match="sync_every must be an int >= 1"):
            trainer(model, opt, sync_every=2.5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="model must be a torch.nn.Module"):
            trainer(lambda x: x, opt)
        with pytest.raises(ConfigurationError, match="optimizer must be a torch.optim.Optimizer"):
            trainer(model, "sgd")
        with pytest.raises(ConfigurationError, match="does not update parameter"):
            trainer(model, torch.optim.SGD([model.weight], lr=0.1))
        with pytest.raises(RuntimeError, match="init_process_group"):
            trainer(model, opt)


@pytest.mark.parametrize(("case", "overlap"), [("exit", 0), ("exit0", 1), ("hang", 0)])
def test_a_rank_lost_between_syncs_ends_the_live_rank_with_a_clear_error(tmp_path: Path, case: str, overlap: int) -> None:
    # rank 1 exits (its connections close), rank 0 (the store's host) exits, or rank 1 hangs past sync_timeout=3 s
    out = tmp_path / "seen.json"
    w.launch(lw.worker_peer_lost, 2, str(out), case, overlap, timeout=60)
    seen = json.loads(out.read_text())
    lost = 0 if case == "exit0" else 1
    assert seen["rank"] == lost, seen
    assert f"rank {lost} failed at commpress.local.DiLoCo sync" in seen["message"], seen
    assert ("did not arrive" in seen["message"]) if case != "exit0" else ("rank 0, is gone" in seen["message"]), seen
    assert seen["elapsed"] < seen["timeout"] + 5, seen  # bounded (a hang would be gloo's 90 s here)
    assert seen["again"] == seen["message"], seen  # the trainer stays failed


def test_streaming_fragments_and_overlap_match_a_hand_written_reference() -> None:
    # fragments=1, overlap=0 is today's DiLoCo; every merge leaves the ranks' global copies identical
    w.launch(lw.worker_streaming_matches_reference, 2, lw.STREAMING_CASES, timeout=120)


def test_overlap_peak_bytes_are_one_fragment_and_waits_are_measured(tmp_path: Path) -> None:
    out = tmp_path / "stats.json"
    w.launch(lw.worker_overlap_stats, 2, str(out), timeout=120)
    seen = json.loads(out.read_text())
    # every sync sends one all-gather frame: the packets of its parameters behind a frame header of
    # 8 bytes + one flag byte per parameter rounded up to 8 (commpress/wire/frame.py): 16 bytes here
    def header(params: int) -> int:
        return 8 + -(-params // 8) * 8

    whole = seen["1,0"]["peak_bytes_in_flight"] - header(8)
    assert whole > 0
    assert (seen["2,0"]["peak_bytes_in_flight"] - header(4)) * 2 == whole, seen
    assert (seen["2,2"]["peak_bytes_in_flight"] - header(4)) * 2 == whole, seen
    assert (seen["4,1"]["peak_bytes_in_flight"] - header(2)) * 4 == whole, seen
    # the same packets in all, spread over the syncs (one more frame header per extra sync)
    assert seen["2,2"]["bytes_sent"] == seen["1,0"]["bytes_sent"] + 3 * header(4), seen
    for key, s in seen.items():
        assert s["sync_transfer_s"] > 0 and 0 <= s["sync_wait_s"], (key, s)
        assert s["syncs"] == 12 // (4 // int(key[0])), (key, s)
    # finish(): one more sync per fragment holding steps no sync took (all but the one launched at step 12)
    assert {key: s["syncs_after_finish"] - s["syncs"] for key, s in seen.items()} == {"1,0": 0, "2,0": 1, "2,2": 1, "4,1": 3}
    # how much of the transfer the overlap hides is a timing (scripts/bench_local.py prints it): on
    # a loaded 2-core machine a blocking sync can finish before the loop waits, so no ratio here


def test_finish_syncs_the_steps_no_sync_took() -> None:
    # a run of 5 steps with sync_every=8 ends with the replicas' average, the same on both ranks
    w.launch(lw.worker_finish_syncs_the_tail, 2, timeout=120)


def test_replicas_of_two_ranks_agree_after_every_sync() -> None:
    # 4 gloo ranks: 2 replicas of 2 (DDP inside), DiLoCo with the default outer codec across them
    w.launch(lw.worker_replicas, 4, "qsgd", 2, timeout=120)


def test_fsdp_inside_replicas_syncs_shards() -> None:
    # 4 gloo ranks: 2 replicas of 2, FSDP2 sharding each; agreement after syncs, equal to DDP inside
    w.launch(lw.worker_fsdp_replicas, 4, 2, timeout=180)


def test_auto_codec_picks_by_link_and_ranks_agree() -> None:
    w.launch(lw.worker_auto_codec, 2, timeout=180)
