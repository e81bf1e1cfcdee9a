"""Which stored kind of FSDP's compression state costs accuracy: residuals or local velocities.

Trains the digits MLP FSDP-sharded (``tests/fsdp_modes_workers.py::train_digits_fsdp``, 12 epochs)
with ``residual_dtype="auto"`` whose sizing is forced to each ``PAIRS`` entry (``residual/velocity``
kinds; ``real/auto`` keeps :func:`commpress.fsdp.residuals.auto_kinds`), ``BLOCK=`` / ``VBLOCK=``
overriding the residuals' / velocities' block size (``BLOCK`` / ``VELOCITY_BLOCK``), ``EPOCHS=`` the
epochs (12; at 8 ranks take 48: 12 epochs are 60 steps there, most of them AdamW's dense warm-up),
``OPTIMIZER=none`` registering with ``optimizer=None`` (error feedback alone, the momentum left in the
optimizer: the velocity kind is then unused). Prints the held-out accuracy per ``seed/optimizer/codec/residual/velocity``::

    PAIRS=int4/float32,float32/int4,int4/int4 VBLOCK=256 SEEDS=0 WORLD=4 CODEC=topk OPTIMS=adamw \\
        python scripts/fsdp_velocity_kinds.py /tmp/kinds.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import fsdp_modes_workers as mw  # noqa: E402
import torch  # noqa: E402

import ddp_workers as w  # noqa: E402


def worker(rank: int, world: int, out: str, pairs: list[tuple[str, str]], seeds: list[int], codec: str,
           opts: dict[str, Any], block: int, vblock: int, optims: list[str], epochs: int) -> None:
    """One accuracy per (seed, optimizer, pair); rank 0 writes them as JSON."""
    torch.set_num_threads(1)
    import commpress.fsdp.residuals as r

    if block:
        r.BLOCK = block
    if vblock:
        r.VELOCITY_BLOCK = vblock
    real = r.auto_kinds
    res = {}
    for seed in seeds:
        for optim in optims:
            for rk, vk in pairs:
                r.auto_kinds = real if rk == "real" else (lambda *a, rk=rk, vk=vk, **k: (rk, vk))
                acc = mw.train_digits_fsdp(rank, world, codec, {**opts, "residual_dtype": "auto"},
                                           mw.DIGITS_OPTIMS[optim], epochs, seed)
                res[f"{seed}/{optim}/{codec}/{rk}/{vk}"] = acc
    if rank == 0:
        Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    pairs = [(p.split("/")[0], p.split("/")[1]) for p in os.environ.get("PAIRS", "real/auto").split(",")]
    seeds = [int(s) for s in os.environ.get("SEEDS", "0").split(",")]
    codec = os.environ.get("CODEC", "topk")
    target = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fsdp_velocity_kinds.json"
    w.launch(worker, int(os.environ.get("WORLD", "4")), target, pairs, seeds, codec,
             {**({"ratio": 0.01} if codec == "topk" else {}),
              **({"optimizer": None} if os.environ.get("OPTIMIZER") == "none" else {})}, int(os.environ.get("BLOCK", "0")),
             int(os.environ.get("VBLOCK", "0")), os.environ.get("OPTIMS", "adamw").split(","),
             int(os.environ.get("EPOCHS", "12")), timeout=6000)
    print(Path(target).read_text())
