"""Checkpoint files of the DDP and FSDP compression states (``save(path)`` / ``load(path)``).

Issue 12, failures 6 and 7: the states' ``state_dict`` went through the user's ``torch.save``,
with no digest, a predictable temp name and a world-readable file. The files now carry a sha256
digest checked on load before anything changes, are written through a private ``mkstemp`` file
(mode 0600) renamed into place, and a symlink is refused on load (:mod:`commpress.checkpoint`).
Each state is exercised on 2 gloo ranks (it needs a process group); the file-level checks run
serially below.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

import commpress.checkpoint as files

import ddp_workers as w


def _same(a: Any, b: Any) -> bool:
    """Exact equality of nested state dicts (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _exercise(state: Any, fresh: Any, out: Path, rank: int) -> None:
    """Save ``state``; round trip into ``fresh``; flipped byte, symlink, implausible value refused."""
    path = str(out / f"state-rank{rank}.cpst")
    state.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [n for n in os.listdir(out) if n.startswith(f".state-rank{rank}.cpst.")]  # the temp file is gone
    before = fresh.state_dict()
    # a flipped byte: refused before anything changes
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    bad = out / f"flipped-rank{rank}.cpst"
    bad.write_bytes(bytes(data))
    with pytest.raises(files.CheckpointError, match="corrupt: its sha256 digest does not match"):
        fresh.load(str(bad))
    assert _same(fresh.state_dict(), before)
    # a symlink: refused
    link = out / f"link-rank{rank}.cpst"
    link.symlink_to(path)
    with pytest.raises(files.CheckpointError, match="symlink is refused"):
        fresh.load(str(link))
    # a valid digest over an implausible residual (someone who recomputed it): the values' check
    hostile = state.state_dict()
    residuals = hostile.get("residuals") or (hostile.get("feedback") or {}).get("residuals")
    key = next(iter(residuals))
    if residuals[key].is_floating_point():
        residuals[key] = torch.full_like(residuals[key], 1e30)
    else:  # int8 / int4 codes (FSDP's residual_dtype="auto"): the float32 block scales carry the values
        hostile["residual_scales"][key] = torch.full_like(hostile["residual_scales"][key], 1e30)
    files.save_state(str(out / f"hostile-rank{rank}.cpst"), hostile)
    with pytest.raises(ValueError, match="1e\\+30"):
        fresh.load(str(out / f"hostile-rank{rank}.cpst"))
    assert _same(fresh.state_dict(), before)
    # a planted symlink at the target is replaced, never followed
    victim = out / f"victim-rank{rank}.txt"
    victim.write_text("untouched")
    planted = out / f"planted-rank{rank}.cpst"
    planted.symlink_to(victim)
    state.save(str(planted))
    assert victim.read_text() == "untouched" and not planted.is_symlink()
    # the round trip is exact
    fresh.load(path)
    assert _same(fresh.state_dict(), state.state_dict())


def worker_ddp(rank: int, world: int, out: str) -> None:
    import commpress.ddp

    ddp = w.make_ddp()
    state = commpress.ddp.register(ddp, "topk", ratio=0.1, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        w.train_step(ddp, opt, rank, step)
    assert state.feedback is not None and state.velocity
    fresh = commpress.ddp.register(w.make_ddp(), "topk", ratio=0.1, momentum=0.9)
    _exercise(state, fresh, Path(out), rank)
    assert fresh.step == 3


def worker_fsdp(rank: int, world: int, out: str) -> None:
    import commpress.fsdp

    import fsdp_workers as fw

    model = fw.make_fsdp()
    state = commpress.fsdp.register(model, "sign", block_size=256)
    fw.train(model, rank, range(3))
    fresh = commpress.fsdp.register(fw.make_fsdp(), "sign", block_size=256)
    _exercise(state, fresh, Path(out), rank)


@pytest.mark.parametrize("which", ["ddp", "fsdp"])
def test_state_files_have_a_digest_a_private_atomic_write_and_refuse_symlinks(which: str, tmp_path: Path) -> None:
    w.launch(worker_ddp if which == "ddp" else worker_fsdp, 2, str(tmp_path), timeout=240)


def test_a_state_file_of_another_kind_or_a_truncated_one_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "s.cpst")
    files.save_state(path, {"format": 1, "x": torch.arange(4.0)})
    assert _same(files.load_state(path), {"format": 1, "x": torch.arange(4.0)})
    Path(path).write_bytes(Path(path).read_bytes()[:-5])
    with pytest.raises(files.CheckpointError, match="corrupt"):
        files.load_state(path)
    files.write_file(path, {"format": 2}, magic=files.PS_MAGIC, fmt=2)  # a parameter-server file
    with pytest.raises(files.CheckpointError, match="no b'CPST' header"):
        files.load_state(path)
    with pytest.raises(files.CheckpointError, match="cannot read"):
        files.load_state(str(tmp_path / "missing.cpst"))
