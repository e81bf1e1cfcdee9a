"""scripts/bench_local.py's ``--workload lm``: the rows it runs, the bytes it counts, the defaults it uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from commpress.local.diloco import DEFAULT_SYNC_EVERY

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = "DiLoCo at its defaults (H=16, qsgd 4-bit outer, overlap H/4)"
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
    assert "AdamW(lr=0.001)" in data["header"] and f"{STEPS} steps" in data["header"]
    assert ddp["bytes"] == ddp["params"] * 4 * STEPS
    assert default["sync_every"] == DEFAULT_SYNC_EVERY and default["syncs"] == STEPS // DEFAULT_SYNC_EVERY
    assert topk["sync_every"] == 32 and topk["syncs"] == 1
    for r in rows.values():
        assert 0.0 < r["loss"] < 6.0, r  # finite and below a uniform guess over bytes (ln 256 = 5.55) + slack
    # 16x fewer syncs than DDP steps, each QSGD 4-bit (its small and 1-D parameters dense: ~6x below fp32 here)
    assert 0 < default["bytes"] < ddp["bytes"] / 50, (default["bytes"], ddp["bytes"])
    assert "| DDP all-reduce every step | 1 |" in res.stdout and "+0.00%" in res.stdout
