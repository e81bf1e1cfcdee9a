"""scripts/bench_local.py's ``--workload lm``: the rows it runs, the bytes it counts, the defaults it uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commpress.demo.shaped_net import can_shape
from commpress.local.diloco import DEFAULT_SYNC_EVERY

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = "DiLoCo at its defaults (H=16, sign outer, overlap H/4)"
STEPS = 32


def test_lm_rows_bytes_and_defaults(tmp_path: Path) -> None:
    """A tiny byte LM, 2 ranks, AdamW: DDP's bytes are params x 4 x steps; the defaults row is
    ``DiLoCo(model, opt)`` (the library's H, not ``--sync-every``); whole labels select one row each;
    ``--add`` rows take their keywords."""
    out = tmp_path / "lm.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_local.py"), "--workload", "lm", "--steps", str(STEPS),
           "--dim", "32", "--layers", "1", "--ffn", "64", "--context", "16", "--batch", "4", "--heldout", "8",
           "--sync-every", "4",  # must not reach the defaults row
           "--only", "-", "DDP all-reduce every step", DEFAULTS, "DiLoCo H=32, top-k 2% outer (EF)",
           "--add", "sync_every=8,bits=8", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["label"]: r for r in data["results"]}
    # "-" matches no row (most labels hold a hyphen); a whole label does not pick the rows it is part of
    assert list(rows) == ["DDP all-reduce every step", DEFAULTS, "DiLoCo H=32, top-k 2% outer (EF)",
                          "DiLoCo sync_every=8,bits=8"]
    ddp, default, topk, added = rows.values()
    assert added["sync_every"] == 8 and added["syncs"] == STEPS // 8
    # an --add row naming bits but no codec means QSGD (the rows before sign became the default)
    assert added["outer_codec"]["name"] == "qsgd" and added["outer_codec"]["bits"] == 8, added["outer_codec"]
    assert default["outer_codec"]["name"] == "sign" and topk["outer_codec"]["name"] == "topk"
    assert "AdamW(lr=0.001)" in data["header"] and f"{STEPS} steps" in data["header"]
    assert ddp["bytes"] == ddp["params"] * 4 * STEPS
    assert default["sync_every"] == DEFAULT_SYNC_EVERY and default["syncs"] == STEPS // DEFAULT_SYNC_EVERY
    assert topk["sync_every"] == 32 and topk["syncs"] == 1
    for r in rows.values():
        assert 0.0 < r["loss"] < 6.0, r  # finite and below a uniform guess over bytes (ln 256 = 5.55) + slack
    # 16x fewer syncs than DDP steps, each 1 bit per element, biases and norm scales too (384x on this
    # tiny model, one scale per tensor; 195x while its 1-D parameters went dense), and fewer than the
    # 8-bit row's at twice the syncs
    assert 0 < default["bytes"] < ddp["bytes"] / 300, (default["bytes"], ddp["bytes"])
    assert default["bytes"] < added["bytes"] / 2, (default["bytes"], added["bytes"])
    assert "| DDP all-reduce every step | 1 |" in res.stdout and "+0.00%" in res.stdout


TINY = ["--workload", "lm", "--steps", "16", "--dim", "32", "--layers", "1", "--ffn", "64", "--context", "16",
        "--batch", "4", "--heldout", "8", "--eval-every", "4"]
PER_STEP = ["DDP all-reduce every step", "DDP + PyTorch fp16_compress_hook every step", "DDP + commpress qsgd every step"]


def _bench(args: list[str], tmp_path: Path, timeout: float = 240) -> tuple[dict, str]:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_local.py"), *args, "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout + res.stderr


def test_eval_curves_and_time_to_target_on_loopback(tmp_path: Path) -> None:
    """The per-step rows next to DiLoCo, held-out curves on the training clock, the time-to-target columns."""
    data, out = _bench([*TINY, "--only", "-", *PER_STEP, "--add", "sync_every=8,overlap=2"], tmp_path)
    rows = {r["label"]: r for r in data["results"]}
    assert list(rows) == [*PER_STEP, "DiLoCo sync_every=8,overlap=2"]
    ddp, fp16, qsgd, diloco = rows.values()
    assert fp16["bytes"] == fp16["params"] * 2 * 16 and 0 < qsgd["bytes"] < fp16["bytes"]
    assert fp16["loss"] == pytest.approx(ddp["loss"], rel=1e-3)  # fp16 on the wire: nearly DDP
    for r in rows.values():
        steps = [c[0] for c in r["curve"]]
        clock = [c[1] for c in r["curve"]]
        assert steps[-1] == 16 and r["curve"][-1][2] == r["loss"], r["curve"]  # the last point: the final model
        assert clock == sorted(clock) and clock[-1] == pytest.approx(r["train_s"]), r
        assert r["link"] == "loopback"
    assert [c[0] for c in ddp["curve"]] == [4, 8, 12, 16]
    # DiLoCo's global copy changes at the merges (launch at 8, merged 2 steps later), then finish()
    assert [c[0] for c in diloco["curve"]] == [10, 16]
    assert ddp["curve"][-1][1] == pytest.approx(ddp["train_s"])
    assert "time to target (s)" in out and "Target: DDP's final held-out loss on this link x 1.02" in out
    assert "[bench_local loopback] DDP all-reduce every step: step 4/16, held-out loss" in out  # a line per evaluation


def test_unknown_link_is_refused_before_anything_runs(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_local.py"), *TINY, "--links", "loopback", "10mbps"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode != 0 and "unknown link '10mbps'" in res.stderr, res.stderr[-2000:]


def test_shaped_links_side_by_side(tmp_path: Path) -> None:
    """unshaped and 100mbit in one run: a table per link, the 100mbit one against unshaped DDP, the goal lines."""
    ok, why = can_shape()
    if not ok:
        pytest.skip(f"shaped links need network namespaces: {why}")
    data, out = _bench([*TINY, "--links", "unshaped", "100mbit", "--only", "-", "DDP all-reduce every step",
                        "--add", "sync_every=8"], tmp_path)
    assert data["shaped"] == {"unshaped": True, "100mbit": True}
    by = {(r["link"], r["label"]) for r in data["results"]}
    assert by == {(link, label) for link in ("unshaped", "100mbit") for label in ("DDP all-reduce every step", "DiLoCo sync_every=8")}
    losses = {r["label"]: set() for r in data["results"]}
    for r in data["results"]:
        losses[r["label"]].add(r["loss"])
    assert all(len(v) == 1 for v in losses.values()), losses  # the link changes the time, not the numbers
    assert "### 100mbit (network namespaces, tc tbf 100mbit" in out and "vs DDP, unshaped" in out
    assert "Goal (issue #26) at 100mbit" in out and "- DiLoCo sync_every=8:" in out
