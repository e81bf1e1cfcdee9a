"""DDP communication hook: multi-process gloo tests on CPU (see tests/ddp_workers.py).

Each multi-rank test is one process launch (spawn costs ~3 s) running many scenarios; the
workers assert on all-gathered values so a failure fails every rank instead of hanging one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import commpress
import commpress.ddp
from commpress.comm import piece_bounds
from commpress.rng import derive_seed

import ddp_workers as w

ROOT = Path(__file__).resolve().parents[2]


# ----- single process: options and helpers --------------------------------------------------------
def test_bad_options_raise_clear_errors() -> None:
    model = torch.nn.Linear(64, 64)
    with pytest.raises(commpress.CodecError, match="unknown codec 'nope'"):
        commpress.ddp.CompressionState(model, "nope")
    for ratio in (0.0, 1.5, -0.1):
        with pytest.raises(commpress.CodecError, match=r"ratio must be in \(0, 1\]"):
            commpress.ddp.CompressionState(model, "topk", ratio=ratio)
    with pytest.raises(commpress.CodecError, match="unknown algorithm"):
        commpress.ddp.CompressionState(model, "topk", ratio=0.1, algorithm="magic")
    with pytest.raises(commpress.CodecError, match="'allreduce' sums values"):
        commpress.ddp.CompressionState(model, "topk", ratio=0.1, algorithm="allreduce")
    with pytest.raises(commpress.CodecError, match="unknown option"):
        commpress.ddp.CompressionState(model, commpress.codecs.get("sign"), block_size=4)
    with pytest.raises(commpress.CodecError, match="warmup_steps"):
        commpress.ddp.CompressionState(model, "sign", warmup_steps=-1)
    with pytest.raises(commpress.CodecError, match="momentum"):
        commpress.ddp.CompressionState(model, "sign", momentum=1.0)
    with pytest.raises(commpress.CodecError, match="warmup_codec must be unbiased"):
        commpress.ddp.CompressionState(model, "topk", ratio=0.1, warmup_codec="sign")
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        commpress.ddp.register(model, "sign")
    # Valid options, but no process group: a clear error rather than a crash in the hook.
    with pytest.raises(RuntimeError, match="init_process_group"):
        commpress.ddp.CompressionState(model, "topk", ratio=0.01)


def test_plan_keeps_small_and_1d_dense() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    codec = commpress.codecs.get("topk", ratio=0.01)
    _, plans = commpress.ddp.plan_parameters(model.named_parameters(), codec, min_numel=1024)
    assert {n for n, p in plans.items() if p.compressed} == {"0.weight"}
    _, plans = commpress.ddp.plan_parameters(
        model.named_parameters(), codec, compress_filter=lambda name, p: name.endswith("bias")
    )
    assert {n for n, p in plans.items() if p.compressed} == {"0.bias", "1.bias", "2.bias"}
    with pytest.raises(commpress.CodecError, match="'2.weight'"):
        commpress.ddp.plan_parameters(model.named_parameters(), commpress.codecs.get("topk", k=600), min_numel=1)


def test_seeds_and_pieces_are_pure_functions() -> None:
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3) != derive_seed(1, 3, 2)
    assert all(0 <= derive_seed(s, t) < 2**64 for s in (0, 2**64 - 1) for t in (0, 10**12))
    for numel in (0, 1, 7, 512, 1000, 4097):
        for n in (1, 2, 3, 4):
            for align in (1, 64, 512):
                b = piece_bounds(numel, n, align)
                assert b[0][0] == 0 and b[-1][1] == numel
                assert all(lo <= hi for lo, hi in b) and all(b[i][1] == b[i + 1][0] for i in range(n - 1))
                assert all(lo % align == 0 for lo, _ in b[1:] if lo < numel)


# ----- multi-rank ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_every_codec_multibucket_identical_parameters(world: int, tmp_path: Path) -> None:
    """Every codec and algorithm, >= 4 buckets, 50 steps (20 at 4 ranks, which share 2 cores in
    CI): no hang, bit-identical parameters after every step on every rank, codec none == DDP
    without a hook."""
    w.launch(w.worker_matrix, world, 50 if world == 2 else 20, str(tmp_path), timeout=240)
    report = json.loads((tmp_path / f"matrix_{world}.json").read_text())
    assert len(report) == len(w.MATRIX_CASES)
    assert report["topk(ratio=0.01)"]["compression_ratio"] > 15
    assert report["sign(block_size=256)"]["compression_ratio"] > 8


def test_ddp_features_half_precision_and_nonfinite() -> None:
    """gradient_as_bucket_view, find_unused_parameters, no_sync, fp16/bf16 parameters; an Inf on
    one rank voids the step on every rank (GradScaler) and leaves residuals untouched; bad
    checkpoint loads raise."""
    w.launch(w.worker_features_and_nonfinite, 2, 8, timeout=240)


def test_checkpoint_resume_in_fresh_processes_matches(tmp_path: Path) -> None:
    w.launch(w.worker_checkpoint, 2, "full", str(tmp_path), 6)
    w.launch(w.worker_checkpoint, 2, "resume", str(tmp_path), 6)


def test_torchrun(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "tests" / "ddp_workers.py"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("torchrun ok") == 3, out.stdout


def test_convergence_on_digits_matches_dense(tmp_path: Path) -> None:
    """top-k 1% and sign (block 256) with error feedback reach dense accuracy within 1.5
    points at the same step count, same optimizer (plain SGD); without error feedback they are
    measurably worse. Numbers come from scripts/ddp_convergence.py."""
    pytest.importorskip("sklearn")
    out = tmp_path / "conv.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "ddp_convergence.py"), "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    acc = {k: v["test_acc"] for k, v in json.loads(out.read_text()).items()}
    print(res.stdout)
    dense = acc["dense"]
    assert dense > 93.0, acc
    for with_ef, without in (("topk1%+EF", "topk1%-EF"), ("sign256+EF", "sign256-EF")):
        assert acc[with_ef] >= dense - 1.5, (with_ef, acc)
        assert acc[without] <= acc[with_ef] - 2.0, (without, acc)
