"""FSDP2 compressed reduce-scatter (``commpress.fsdp``): gloo tests on CPU (see tests/fsdp_workers.py).

Each multi-rank test is one process launch running several scenarios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import commpress.fsdp
from commpress.errors import CodecError

import ddp_workers as w
import fsdp_workers as fw

ROOT = Path(__file__).resolve().parents[2]


def test_bad_options_raise_clear_errors() -> None:
    model = torch.nn.Linear(64, 64)
    with pytest.raises(CodecError, match="unknown codec 'nope'"):
        commpress.fsdp.register(model, "nope")
    with pytest.raises(CodecError, match="fixed-size"):
        commpress.fsdp.register(model, "qsgd", coding="gamma")
    with pytest.raises(CodecError, match="residual_dtype"):
        commpress.fsdp.register(model, "sign", residual_dtype=torch.float16)
    with pytest.raises(CodecError, match="unknown option"):
        commpress.fsdp.register(model, commpress.codecs.get("sign"), block_size=4)
    with pytest.raises(CodecError, match="min_numel"):
        commpress.fsdp.register(model, "sign", min_numel=-1)
    with pytest.raises(TypeError, match="nn.Module"):
        commpress.fsdp.register(object(), "sign")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="init_process_group"):
        commpress.fsdp.register(model, "topk", ratio=0.01)


@pytest.mark.parametrize("world", [2, 4])
def test_every_codec_trains_and_none_is_fsdp_bit_for_bit(world: int, tmp_path: Path) -> None:
    """Every fixed-size codec trains an FSDP2 model; ``none`` == FSDP's reduce-scatter exactly;
    residual memory is (n-1)/n of the compressed parameters in the residual dtype."""
    w.launch(fw.worker_matrix, world, 5, str(tmp_path), timeout=240)
    report = json.loads((tmp_path / f"fsdp_matrix_{world}.json").read_text())
    assert len(report) == len(fw.MATRIX_CASES)
    assert report["topk" + json.dumps({"ratio": "0.01"})]["compression_ratio"] > 10
    default = report["topk" + json.dumps({"ratio": "0.01"})]["residual_bytes"]
    f32 = report["topk" + json.dumps({"ratio": "0.01", "residual_dtype": "torch.float32"}, sort_keys=True)]["residual_bytes"]
    bf16 = report["topk" + json.dumps({"ratio": "0.01", "residual_dtype": "torch.bfloat16"}, sort_keys=True)]
    assert f32 > 0 and bf16["residual_bytes"] * 2 == f32
    # the default ("auto": int8 at 2 ranks, int4 at 4, one float32 scale per 64) keeps them within one shard
    assert 0 < default <= f32 / (world - 1) * 1.02 and default < f32 / 3, (default, f32)


def test_one_rank_trains_as_plain_fsdp_with_the_optimizers_momentum() -> None:
    w.launch(fw.worker_one_rank_leaves_the_optimizer_alone, 1)


def test_nonfinite_checkpoint_and_misconfiguration() -> None:
    """An Inf on one rank voids the step everywhere, residuals untouched; state_dict resumes
    bit for bit (sign, top-k with bf16 residuals, qsgd); ranks set up differently fail."""
    w.launch(_both, 2, timeout=240)


def _both(rank: int, world: int) -> None:
    fw.worker_nonfinite(rank, world)
    fw.worker_checkpoints(rank, world)
    fw.worker_misconfigured(rank, world)


def test_convergence_on_digits_matches_dense(tmp_path: Path) -> None:
    """top-k 1% and sign (block 256) with error feedback, and QSGD, reach dense FSDP's accuracy
    within 1.5 points (the DDP test's tolerance) at 2 ranks, same plain SGD; scripts/bench_fsdp.py."""
    pytest.importorskip("sklearn")
    out = tmp_path / "conv.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_fsdp.py"), "--world", "2", "--json", str(out),
           "--cases", "dense=dense", "topk1%=topk:ratio=0.01", "sign256=sign:block_size=256", "qsgd=qsgd"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    acc = {k: v["test_acc"] for k, v in json.loads(out.read_text()).items()}
    print(res.stdout)
    assert acc["dense"] > 93.0, acc
    for case in ("topk1%", "sign256", "qsgd"):
        assert acc[case] >= acc["dense"] - 1.5, (case, acc)
