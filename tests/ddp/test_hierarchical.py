"""Topology-aware DDP: detection (no processes), and the hierarchical algorithm on 4 gloo ranks as 2 nodes x 2.

The multi-rank scenarios run in three launches (tests/hierarchical_workers.py): one for every
codec trained hierarchical and flat, ``none`` against DDP without a hook, resume, a non-finite
step, bad layouts and torchrun's variables; one per level for a failure reaching every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import hierarchical_workers as hw
import pytest
import torch

from commpress.codecs import get as get_codec
from commpress.comm import ALGORITHMS, Hierarchical, topology
from commpress.comm.driver import Entry
from commpress.comm.hierarchical import frames_cross_node
from commpress.comm.topology import RankPlace, decide, explicit, read_environment
from commpress.errors import CodecError, ConfigurationError

import ddp_workers as w
import misuse_workers as mw

STEPS = 8


# ----- detection: pure functions ---------------------------------------------------------------------
def places(nodes: list[int], size: int | list[int]) -> list[RankPlace]:
    sizes = size if isinstance(size, list) else [size] * len(nodes)
    return [RankPlace(s, n) for n, s in zip(nodes, sizes)]


def test_torchrun_layouts() -> None:
    topo = decide(places([0, 0, 1, 1], 2))
    assert (topo.hierarchical, topo.nodes, topo.local_world_size, topo.source) == (True, 2, 2, "torchrun")
    assert topo.node_of(2) == 1 and topo.local_rank(3) == 1
    assert decide(places([0, 0, 0, 0, 1, 1, 1, 1], 4)).config() == {"nodes": 2, "local_world_size": 4, "source": "torchrun"}
    # flat, each with its reason: nodes of 3 and 1 ranks; interleaved ranks; one node; one rank per node; unset
    cases = {
        "LOCAL_WORLD_SIZE differs": places([0, 0, 0, 1], [3, 3, 3, 1]),
        "nodes hold [3, 1]": places([0, 0, 0, 1], 2),
        "not contiguous": places([0, 1, 0, 1], 2),
        "one node": places([0, 0, 0, 0], 4),
        "one rank per node": places([0, 1, 2, 3], 1),
        "unset on ranks [2]": [RankPlace(2, 0), RankPlace(2, 0), RankPlace(None, None), RankPlace(2, 1)],
    }
    for reason, layout in cases.items():
        topo = decide(layout)
        assert not topo.hierarchical and topo.source == "flat" and reason in topo.reason, (reason, topo)
    assert decide([RankPlace(None, None)] * 4).reason == ""  # not under torchrun: flat, nothing to say


def test_environment_and_explicit() -> None:
    assert read_environment({"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}) == RankPlace(4, 1)
    assert read_environment({"LOCAL_WORLD_SIZE": "x"}) == RankPlace(None, None)
    assert RankPlace.decode(RankPlace(4, 1).encode()) == RankPlace(4, 1)
    assert RankPlace.decode(RankPlace(None, 3).encode()) == RankPlace(None, 3)
    assert RankPlace.decode("garbage") == RankPlace(None, None)
    assert explicit(8, 4).config() == {"nodes": 2, "local_world_size": 4, "source": "explicit"}
    assert not explicit(4, 4).hierarchical and not explicit(4, 1).hierarchical
    for bad, message in ((3, "does not divide the 4 ranks"), (0, "int >= 1"), (True, "int >= 1"), ("2", "int >= 1")):
        with pytest.raises(ConfigurationError, match=message):
            explicit(4, bad)


def test_share_layout_and_wire_plan() -> None:
    """Each rank's residuals cover its 1/L share only; the plan splits intra-node from inter-node bytes."""
    topo = explicit(4, 2)
    codec = get_codec("topk", ratio=0.01)
    shares = []
    for rank in range(4):
        alg = Hierarchical.bind(topo, rank, ALGORITHMS["allgather"])
        pieces = alg.residual_layout("w", (64, 64), codec, 4)
        assert len(pieces) == 1 and pieces[0].key == f"w@{rank % 2}"
        shares.append((pieces[0].lo, pieces[0].hi))
    assert shares[0] == shares[2] and shares[1] == shares[3] and shares[0][1] == shares[1][0] == 2048
    two = Hierarchical.bind(topo, 1, ALGORITHMS["twophase"])
    assert [(p.key, p.lo, p.hi) for p in two.residual_layout("w", (64, 64), codec, 4)] == [
        ("w@1#0", 2048, 3072), ("w@1#1", 3072, 4096)]
    assert [(p.key, p.lo) for p in two.server_layout("w", (64, 64), codec, 4, 1)] == [("w@1#0", 2048)]
    assert two.flush_weights(4) == (2.0, 4.0)
    entries = [Entry(4096, True), Entry(64, False)]
    plan = Hierarchical.bind(topo, 0, ALGORITHMS["allgather"]).wire_plan(entries, codec, 4, torch.float32)
    flat = ALGORITHMS["allgather"].wire_plan(entries, codec, 4, torch.float32)
    # step 3 gathers the 2 nodes' top-k frames of each share, not the 2080 dense floats of the widest share
    assert plan["intra_alltoall"] == 4 * (2048 + 32)
    assert plan["intra_allgather"] == 2 * plan["allgather"] < 0.2 * 4 * (2048 + 32)
    assert plan["allgather"] < 0.6 * flat["allgather"] and plan["decodes"] == 2.0
    # the frames only where they are fewer bytes: 8-bit QSGD across 4 nodes (4 frames of ~1 byte
    # per element) gathers the dense share; the all-reduce's sum (random-k, none) is dense anyway
    qsgd8 = get_codec("qsgd", bits=8)
    four = explicit(8, 2)
    assert frames_cross_node(ALGORITHMS["allgather"], 1100, 2, 4000)
    assert not frames_cross_node(ALGORITHMS["allgather"], 1100, 4, 4000)
    assert not frames_cross_node(ALGORITHMS["allreduce"], 10, 2, 4000)
    q = Hierarchical.bind(four, 0, ALGORITHMS["allgather"]).wire_plan(entries, qsgd8, 8, torch.float32)
    assert 4 * (2048 + 32) <= q["intra_allgather"] < 4 * q["allgather"], q  # the widest share (QSGD's blocks), dense
    with pytest.raises(CodecError, match="needs the node layout"):
        ALGORITHMS["hierarchical"].residual_layout("w", (64, 64), codec, 4)
    with pytest.raises(CodecError, match="several nodes"):
        Hierarchical.bind(topology.flat(4), 0, ALGORITHMS["allgather"])


# ----- 2 nodes x 2 ranks ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("hier")
    w.launch(hw.worker_all, 4, str(out), STEPS, timeout=300)
    return json.loads((out / "hierarchical.json").read_text())


def test_none_equals_dense_ddp(report: dict) -> None:
    """Bit-identical ranks after every step (asserted in the workers); dense DDP at fp32 rounding.

    Not bit-exact: flat DDP sums g/4 over 4 ranks, the hierarchy sums 2 ranks, halves, then
    averages 2 nodes: another order of float additions.
    """
    none = report["none"]
    assert none["hierarchical"] == 1.0
    assert 0 <= none["max_abs_diff"] < 1e-6, none
    # dense: half the buffer crosses nodes (each rank its share), the other half stays in the node
    assert none["inter_bytes_sent"] == none["dense_bytes"] / 2 and none["inter_compression_ratio"] == 2.0, none


@pytest.mark.parametrize("label", [c[0] for c in hw.CODECS])
def test_codecs_train_with_1_over_L_of_the_cross_node_bytes(report: dict, label: str) -> None:
    hier, flat = report["codecs"][label]["hier"], report["codecs"][label]["flat"]
    assert hier["algorithm"] == "hierarchical" and flat["algorithm"] != "hierarchical"
    assert hier["loss_after"] < hier["loss_before"] - 0.02, hier  # it trains
    assert abs(hier["loss_after"] - flat["loss_after"]) < 0.02, (hier, flat)  # as flat does, at equal steps
    # bytes handed across nodes per rank and step: 1/L of flat's, plus per-packet headers (<10%);
    # two-phase's all-gather phase carries 1/n of the buffer at n=4 and 1/n of the 1/2 share at n=2: equal
    slack = 1.1 * 0.5
    assert hier["inter_bytes_wire"] <= slack * flat["bytes_wire"], (hier, flat)
    if hier["inner"] != "twophase":
        assert hier["inter_bytes_sent"] <= slack * flat["bytes_sent"], (hier, flat)
    assert hier["residual_elements"] * 2 == flat["residual_elements"]  # error feedback on the share only


@pytest.mark.parametrize("label", ["topk", "sign", "qsgd"])
def test_frames_inside_the_node_equal_the_dense_share(report: dict, label: str) -> None:
    """Bit for bit (asserted in the workers), the same bytes across nodes, far fewer inside the node.

    Top-k 1% and sign at 2 nodes: the frames are a few percent of the dense share; 4-bit QSGD's two
    frames are a quarter of it. Step 1 (the dense reduce-scatter) is the same either way.
    """
    r = report["frames"][label]
    assert r["inter_frames"] == r["inter_dense"], r
    step1 = r["intra_dense"] / 2  # the all_to_all and the dense all-gather each send about half a buffer
    limit = {"topk": 0.1, "sign": 0.15, "qsgd": 0.35}[label]
    assert r["intra_frames"] - step1 < limit * (r["intra_dense"] - step1), r


def test_resume_is_bit_exact(report: dict) -> None:
    """Asserted in the workers (every rank); the checkpoint holds this rank's share's residuals only."""
    assert report["resume"]["topk"]["residual_keys"] == [f"{p}.weight@0" for p in ("h1", "h2", "h3", "inp", "out")]
    assert report["resume"]["sign-twophase"]["server_keys"][0] == "h1.weight@0#0"


def test_error_feedback_loses_nothing_through_warmup_and_dense_steps(report: dict) -> None:
    """Asserted in the workers: W moved by exactly -lr * sum of the mean gradients (fp32 rounding)."""
    for label in ("topk", "sign-twophase"):
        flush = report["flush"][label]
        assert flush["guard_fired"] == 1 and flush["residual_keys"] > 0 and flush["max_err"] < 1e-5, flush


def test_a_nonfinite_gradient_voids_the_step_everywhere(report: dict) -> None:
    assert report["nonfinite"]["nonfinite_slots"] > 0


def test_bad_layouts_and_torchrun_variables(report: dict) -> None:
    out = report["topology"]
    assert "ConfigurationError" in out["L=3"] and "does not divide the 4 ranks" in out["L=3"], out
    assert "ConfigurationError" in out["L=0"] and "int >= 1" in out["L=0"], out
    assert "ConfigurationError" in out["by-name"] and "pass local_world_size=" in out["by-name"], out
    # ranks 0-1 asked for 2 x 2, ranks 2-3 did not: the configuration agreement names it (rank 0's view)
    assert "ConfigurationError" in out["disagree"] and "configured differently" in out["disagree"], out
    assert "ranks [2, 3]" in out["disagree"] and "4 x 1 ranks (flat)" in out["disagree"], out
    two = json.loads(out["env-2x2"])
    assert (two["nodes"], two["local_world_size"], two["source"], two["algorithm"]) == (2, 2, "torchrun", "hierarchical")
    uneven = json.loads(out["env-3+1"])
    assert uneven["source"] == "flat" and "non-homogeneous" in uneven["reason"] and uneven["algorithm"] == "allgather"


@pytest.mark.parametrize("level", ["intra", "inter"])
def test_a_failure_in_either_level_reaches_every_rank(level: str, tmp_path: Path) -> None:
    """Rank 1 fails at step 3 (inside the node, or decoding what came across); every rank raises
    RankFailedError naming it within seconds, instead of waiting for the process group's timeout (120 s)."""
    reports = mw.launch(hw.case_fault, 4, tmp_path, level, pg_timeout_s=120, bound_s=100)
    assert set(reports) == set(range(4)), reports
    for rank in range(4):
        assert "RankFailedError: commpress: rank 1 failed at step 3, bucket " in reports[rank]["error"], reports
        assert abs(reports[rank]["at"] - reports[1]["at"]) < 10, reports
    assert ("injected failure inside the node" if level == "intra" else "WireError") in reports[0]["error"], reports


def test_auto_compresses_through_the_hierarchy_on_a_slow_network(report: dict) -> None:
    """codec='auto' on 2 x 2 (asserted in the workers: ranks bit-identical every step, calibrated links and
    choices equal everywhere): a slow network compresses across nodes only, a fast one goes flat dense and
    flushes every share residual; the node's link is measured apart from the network's; without auto_codec
    the candidate across nodes is QSGD (SGD momentum passed: flat at 2 ranks it would be top-k)."""
    auto = report["auto"]
    assert auto["slow_compressed_buckets"] >= 1 and auto["slow_inter_bytes"] > 0, auto
    assert auto["slow_inter_gbit"] == pytest.approx(0.001) and auto["slow_intra_gbit"] > 0.01, auto  # SLOW: 1 Mbit/s
    assert auto["residual_kept"] > 0 and auto["residual_left"] == 0.0, auto
    assert auto["fast_options"] and set(auto["fast_options"]) == {"dense"} and auto["fast_switches"] >= 1, auto
    assert auto["calibrated_hierarchical"] == 1.0, auto
    assert auto["calibrated_intra_gbit"] > 0 and auto["calibrated_inter_gbit"] > 0, auto
    assert auto["calibrated_candidate"] == "qsgd", auto


def test_warmup_through_a_codec_crosses_the_nodes_hierarchical(report: dict) -> None:
    """8-bit QSGD warm-up steps: dense inside the node, each rank's share across (1/L of flat's bytes); ranks
    bit-identical after every step (asserted in the workers)."""
    hier, flat = report["warmup"]["hier"], report["warmup"]["flat"]
    assert "QSGD" in hier["warmup_codec"] and hier["intra_bytes_sent"] > 0, hier
    assert 0 < hier["inter_bytes_sent"] <= 0.55 * flat["bytes_sent"], (hier, flat)
    assert flat["inter_bytes_sent"] == 0, flat
