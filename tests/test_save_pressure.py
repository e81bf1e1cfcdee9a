"""Saving under pressure (issue #28 item 4): a full disk, a file size limit, a kill during ``state.save``.

Each case runs a real :class:`~commpress.ddp.CompressionState` (one gloo rank, a DDP model whose
file is ~20 KB) in a child process: this file run as a script is the child
(``python tests/test_save_pressure.py MODE DIR``). The child saves a first checkpoint (step 2),
trains a step, then saves again under the pressure of ``MODE``:

- ``fsize``: ``RLIMIT_FSIZE`` below the file's size (any user): ``EFBIG``;
- ``full``: a 64 KiB tmpfs the test mounts (root only, else skipped with the reason) holding
  the first checkpoint and a ballast file: ``ENOSPC``;

and checks that the error names the path and the cause, that the old file still loads at step 2,
that no temporary file is left, that the state is unchanged, and that a retry once the cause is
gone writes step 3. ``kill-fsync`` / ``kill-replace`` SIGKILL the child inside the save (after
the temporary file is written, before it is synced / renamed), ``kill-loop`` is killed by the
test at an arbitrary moment while it saves in a loop: the file at the path must load, at the
old step or a newer complete one, and the next save must remove the leftover temporary file.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from commpress import checkpoint

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
NAME = "commpress-rank0.cpst"


def _temps(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f".{NAME}.") and n.endswith(".tmp"))


def _child(mode: str, directory: str, timeout: float = 120.0, kill_after: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if kill_after is None:
        return subprocess.run([sys.executable, str(HERE), mode, directory], env=env, capture_output=True, text=True,
                              timeout=timeout)
    # kill-loop: SIGKILL from outside, once the child has saved a few times
    proc = subprocess.Popen([sys.executable, str(HERE), mode, directory], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith(kill_after) or time.monotonic() > deadline:
            break
    time.sleep(0.013)  # somewhere inside the next save
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _saved_step(path: Path) -> int:
    return int(checkpoint.load_state(str(path))["step"])


@pytest.mark.timeout(200)
def test_a_file_size_limit_fails_clearly_keeps_the_old_file_and_a_retry_works(tmp_path: Path) -> None:
    run = _child("fsize", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["errno"] == 27 and report["type"] == "SaveError", report  # EFBIG
    assert str(tmp_path / NAME) in report["message"] and "File too large" in report["message"], report
    assert _saved_step(tmp_path / NAME) == 3 and not _temps(tmp_path)  # the retry's file


@pytest.mark.timeout(200)
def test_a_full_disk_fails_clearly_keeps_the_old_file_and_a_retry_works() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a 64 KiB tmpfs needs root (the RLIMIT_FSIZE test covers the same path as any user)")
    mnt = tempfile.mkdtemp(prefix="commpress-full-")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", mnt], capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:200]}")
        try:
            run = _child("full", mnt)
            assert run.returncode == 0, run.stdout + run.stderr
            report = json.loads(run.stdout.strip().splitlines()[-1])
            assert report["errno"] == 28 and report["type"] == "SaveError", report  # ENOSPC
            assert f"{mnt}/{NAME}" in report["message"] and "No space left on device" in report["message"], report
            assert _saved_step(Path(mnt) / NAME) == 3 and not _temps(Path(mnt))
        finally:
            subprocess.run(["umount", mnt], check=True)
    finally:
        os.rmdir(mnt)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["kill-fsync", "kill-replace", "kill-loop"])
def test_a_kill_during_save_leaves_a_loadable_checkpoint_and_the_next_save_cleans_up(tmp_path: Path, mode: str) -> None:
    run = _child(mode, str(tmp_path), kill_after="saved 3" if mode == "kill-loop" else None)
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stdout, run.stderr)
    step = _saved_step(tmp_path / NAME)  # the digest checks the whole file
    temps = _temps(tmp_path)
    if mode == "kill-loop":
        assert step >= 4 and len(temps) <= 1, (step, temps)  # the old or a newer complete file
    else:
        assert step == 2, "the killed save replaced the old checkpoint"
        assert len(temps) == 1, temps  # the killed save's temporary file: another name, never loaded
        leftover = (tmp_path / temps[0]).read_bytes()
        assert len(leftover) > 0
        # the user's "does a checkpoint exist" is the final name; were a cut-short temporary file
        # ever taken for one, the digest refuses it
        cut = tmp_path / "cut.cpst"
        cut.write_bytes(leftover[: len(leftover) // 2])
        with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
            checkpoint.load_state(str(cut))
        cut.unlink()
    time.sleep(0.01)  # the leftover's mtime is before the next save's start
    checkpoint.save_state(str(tmp_path / NAME), {"step": 99})
    assert _saved_step(tmp_path / NAME) == 99 and not _temps(tmp_path), _temps(tmp_path)


# ----- the child ---------------------------------------------------------------------------------
def _state_snapshot(state: object) -> dict[str, torch.Tensor | int]:
    sd = state.state_dict()  # type: ignore[attr-defined]
    flat: dict[str, torch.Tensor | int] = {"step": sd["step"]}
    flat.update({f"r.{k}": v for k, v in sd["feedback"]["residuals"].items()})
    flat.update({f"v.{k}": v for k, v in sd["velocity"].items()})
    return flat


def _same(a: dict[str, torch.Tensor | int], b: dict[str, torch.Tensor | int]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, b[k]) if isinstance(x, torch.Tensor) else x == b[k] for k, x in a.items())


def _pressured_save(state: object, path: str, undo: object) -> dict[str, object]:
    """Save under pressure: the error's content, the old file and the state checked, then undo and retry."""
    before = _state_snapshot(state)
    try:
        state.save(path)  # type: ignore[attr-defined]
    except OSError as exc:
        report: dict[str, object] = {"type": type(exc).__name__, "errno": exc.errno, "message": str(exc)}
    else:
        raise AssertionError("the save under pressure succeeded")
    assert _same(_state_snapshot(state), before), "a failed save changed the state"
    assert int(checkpoint.load_state(path)["step"]) == 2, "the old checkpoint is damaged"
    assert not _temps(Path(path).parent), "a temporary file was left"
    undo()  # type: ignore[operator]
    state.save(path)  # type: ignore[attr-defined]
    return report


def main(mode: str, directory: str) -> None:
    """Train a one-rank DDP model a few steps and save under the pressure ``mode`` names."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import commpress.ddp

    torch.set_num_threads(1)
    store_dir = tempfile.mkdtemp(prefix="commpress-store-")
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = commpress.ddp.register(ddp, "topk", ratio=0.05, warmup_steps=0, optimizer=opt)
    path = os.path.join(directory, NAME)

    def step(i: int, model: nn.Module = ddp) -> None:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        F.cross_entropy(model(x), torch.arange(16) % 10).backward()
        opt.step()

    step(0)
    step(1)
    state.save(path)
    step(2)
    ballast = os.path.join(directory, "ballast")
    if mode == "full":  # a ballast file leaves room for half a checkpoint: the disk is full
        free = os.statvfs(directory)
        with open(ballast, "wb") as f:
            f.write(b"\0" * max(0, free.f_bavail * free.f_frsize - os.path.getsize(path) // 2))
    if mode == "fsize":
        size = os.path.getsize(path)
        previous = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, previous[1]))

        def undo() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, previous)
            signal.signal(signal.SIGXFSZ, old_handler)

        report = _pressured_save(state, path, undo)
    elif mode == "full":
        report = _pressured_save(state, path, lambda: os.remove(ballast))
    elif mode in ("kill-fsync", "kill-replace"):
        def die(*args: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        if mode == "kill-fsync":
            os.fsync = die  # type: ignore[assignment]
        else:
            os.replace = die  # type: ignore[assignment]
        state.save(path)
        raise AssertionError("the save was not killed")
    elif mode == "kill-loop":
        for i in range(3, 10_000):
            step(i)
            state.save(path)
            print(f"saved {i + 1}", flush=True)
        raise AssertionError("the loop was not killed")
    else:
        raise ValueError(f"unknown mode {mode!r}")
    print(json.dumps(report), flush=True)
    del ddp, state, step
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
