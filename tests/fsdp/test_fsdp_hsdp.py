"""FSDP2 sharded inside each node, commpress compressing the cross-node all-reduce (tests/fsdp_hsdp_workers.py).

4 gloo ranks as 2 nodes x 2: ``none`` equals FSDP over all ranks; every codec trains with the
same parameters on every rank, hands fewer bytes across nodes than flat commpress with the same
codec and keeps one shard of compression state; resume (per-rank files or DCP) is bit-exact; a non-finite gradient voids
the step everywhere; bad layouts are clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import fsdp_hsdp_workers as hw
import pytest

from commpress.fsdp import residuals as rstore

import ddp_workers as w

CODECS = ("topk-adamw", "sign-sgd", "qsgd-sgd", "randomk-sgd")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("hsdp") / "hsdp.json"
    w.launch(hw.worker_all, 4, str(out), timeout=400)
    return json.loads(Path(out).read_text())


def test_node_mesh_holds_the_nodes_ranks(report: dict) -> None:
    assert report["all_meshes"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert report["layouts"]["one_node_size"] == 4  # one node: FSDP over every rank, as usual


def test_none_equals_fsdp_over_every_rank(report: dict) -> None:
    r = report["none"]
    assert r["diff"] < 1e-6, r  # fp32 rounding: the sums run in another order
    assert (r["hierarchical"], r["nodes"]) == (1.0, 2.0)
    assert r["inter_per_step"] == r["shard_bytes"]  # the dense all-reduce of one float32 shard per step
    assert not r["allgather"]  # parameters stay inside the node: FSDP's own all-gather


@pytest.mark.parametrize("label", CODECS)
def test_codecs_train_alike_everywhere_with_fewer_cross_node_bytes(report: dict, label: str) -> None:
    r, dense = report["codecs"][label], report["codecs"]["dense_loss"]
    assert r["same_everywhere"] and r["finite"], r  # every node's replica of every shard, bit for bit
    assert not r["allgather"]  # the default param_codec under HSDP: FSDP's own, inside the node
    # one node's rank carries its shard (1/L of the gradient) across, where flat commpress sends
    # (n-1)/n of it through the all_to_all: (1/2) / (3/4) at 2 x 2
    assert r["inter_per_step"] <= 0.7 * r["flat_per_step"], r
    assert r["intra_per_step"] == r["shard_bytes"]  # FSDP's dense reduce-scatter inside the node: (L-1)/L x 2 shards
    assert r["ratio"] > 3, r  # against the dense all-reduce of a float32 shard
    # compression state within one gradient shard (residual_dtype="auto")
    assert r["residual_bytes"] + r["velocity_bytes"] <= r["shard_bytes"], r
    # it learns (ln 10 = 2.303 at the start), as much as flat commpress with the same codec does
    assert r["loss"] < 0.97 * 2.303 and abs(r["loss"] - r["flat_loss"]) < 0.03 * r["flat_loss"], r
    if label == "topk-adamw":  # 12 steps, 2 of them dense warm-up: behind dense AdamW, not lost
        assert r["loss"] < 1.8 * dense, (r, dense)
    assert r["adam"] == (label == "topk-adamw") and r["handover"] == label.endswith("-sgd") or label == "qsgd-sgd"


def test_auto_state_kinds_under_hsdp() -> None:
    # one residual chunk and one velocity chunk: float32 alone fits one shard; with velocities bfloat16 both
    assert rstore.auto_kinds(2, False, velocity_chunks=1) == ("float32", "float32")
    assert rstore.auto_kinds(2, True, velocity_chunks=1) == ("bfloat16", "bfloat16")
    assert rstore.state_bytes(2, "bfloat16", "bfloat16", velocity_chunks=1) == 4.0


def test_resume_is_bit_exact(report: dict) -> None:
    r = report["resume"]
    assert r["equal"]
    assert "h1.weight#0" in r["velocities"] and r["residuals"] == sorted(
        f"{n}.weight#0" for n in ("h1", "h2", "h3", "inp", "out"))  # one piece per parameter: the node's shard


def test_resume_through_dcp_is_bit_exact(report: dict) -> None:
    assert report["dcp"] == {"residuals_loaded": True, "equal": True}


def test_a_nonfinite_gradient_voids_the_step_everywhere(report: dict) -> None:
    r = report["nonfinite"]
    assert r["nan_everywhere"] and r["residuals_kept"] and r["nonfinite_slots"] > 0, r


def test_bad_layouts_are_clear_errors(report: dict) -> None:
    r = report["layouts"]
    assert "2-D (replicate, shard) mesh" in r["mesh2d_error"] and "node_mesh" in r["mesh2d_error"]
    assert "ranks [0, 2] of 4" in r["interleaved_error"] and "contiguous" in r["interleaved_error"]


def test_sign_keeps_embeddings_exact_under_hsdp(report: dict) -> None:
    # flat FSDP compresses them for sign (its own chunk travels exact); sharded in the node nothing does
    assert report["layouts"]["sign_compressed"] == {"0.weight": False, "1.weight": False, "1.bias": False}


def test_three_nodes_reencodable_codecs_cross_by_two_phase(tmp_path: Path) -> None:
    """From 3 nodes, QSGD without residuals runs the two-phase all-reduce across nodes: about 2(N-1)/N
    frames per rank where the all-gather (QSGD with error feedback) sends N-1; same parameters everywhere."""
    out = tmp_path / "three.json"
    w.launch(hw.worker_three_nodes, 6, str(out), timeout=400)
    got = json.loads(out.read_text())
    for label in ("dense", "twophase"):
        assert got[label]["same_everywhere"] and got[label]["finite"] and got[label]["nodes"] == 3, got
    assert got["allgather"]["same_everywhere"] and got["allgather"]["nodes"] == 3, got
    # 2 * 2/3 = 1.33 frames against 2, plus the two-phase pieces' headers: on the test model's small
    # shards (a few KB) 0.84x measured; the all-gather's own bytes if two-phase were not taken
    assert got["twophase"]["inter_wire_per_step"] < 0.9 * got["allgather"]["inter_wire_per_step"], got
    assert got["twophase"]["inter_wire_per_step"] < 0.25 * got["dense"]["inter_wire_per_step"], got
    assert abs(got["twophase"]["loss"] - got["dense"]["loss"]) < 0.05 * got["dense"]["loss"], got


def test_auto_chooses_the_cross_node_all_reduce(report: dict) -> None:
    """codec='auto' sharded in the node (asserted here from the workers' all-gathered checks): FSDP's own
    all-gather in the node; a slow network compresses every module that has a compressible parameter
    across nodes, a fast one stays dense
    (equal to codec 'none' bit for bit); calibrated on the cross-node groups, every rank chooses alike."""
    auto = report["auto"]
    for label in ("slow", "fast", "calibrated"):
        r = auto[label]
        assert r["same_everywhere"] and r["choices_everywhere"] and r["finite"] and not r["allgather"], (label, r)
        assert r["fallback"] == 0.0, (label, r)
    # every module with a compressible parameter (the root holds only a LayerNorm's vectors: dense)
    assert auto["slow"]["compressed_modules"] == auto["slow"]["compressible"] == auto["slow"]["modules"] - 1, auto["slow"]
    assert auto["fast"]["dense_modules"] == auto["fast"]["modules"] and auto["fast"]["equal_to_none"], auto["fast"]
    assert auto["slow"]["inter_per_step"] < 0.2 * auto["fast"]["inter_per_step"], auto
    assert auto["calibrated"]["gbit"] > 0, auto["calibrated"]
