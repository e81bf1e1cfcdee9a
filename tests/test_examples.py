"""The scripts in examples/ run as their docstrings say, at a tiny size (2 CPU gloo ranks).

Each test launches one example the way a user would (torchrun, or mpirun for the parameter
server) with a hard timeout, and checks the exit status, the final ``done:`` line rank 0 prints
and that the loss went down. The DDP example runs twice: the second run resumes from the
checkpoint the first one wrote.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_workers import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
DONE = re.compile(r"^done: loss ([-+0-9.e]+|nan|inf) -> ([-+0-9.e]+|nan|inf), bytes/", re.MULTILINE)


def run(cmd: list[str], timeout: float = 100.0) -> str:
    """Run ``cmd`` in its own process group; return its output, failing on error or hang."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def torchrun(script: str, *args: str, nproc: int = 2) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLES / script), *args])


def losses(out: str) -> tuple[float, float]:
    """The ``done:`` line's first and last loss (exactly one such line: rank 0's)."""
    found = DONE.findall(out)
    assert len(found) == 1, f"expected one 'done:' line, got {len(found)}:\n{out[-3000:]}"
    first, last = (float(v) for v in found[0])
    assert math.isfinite(first) and math.isfinite(last), found[0]
    return first, last


@pytest.mark.timeout(150)
def test_ddp_torchrun_trains_and_resumes(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first, last = losses(torchrun("ddp_torchrun.py", "--steps", "5", "--ckpt", ckpt))
    assert last < first
    assert sorted(os.listdir(ckpt)) == ["commpress-rank0.cpst", "commpress-rank1.cpst", "model.pt", "optim.pt"]
    out = torchrun("ddp_torchrun.py", "--steps", "5", "--ckpt", ckpt)
    assert "resumed from" in out and "at step 5" in out and "stats: steps 10," in out
    resumed_first, resumed_last = losses(out)
    assert resumed_first == pytest.approx(last, abs=1e-3)  # continues from the saved model
    assert resumed_last < resumed_first


@pytest.mark.timeout(100)
@pytest.mark.parametrize("script, args", [
    ("fsdp2.py", ["--steps", "5"]),
    ("local_sgd.py", ["--steps", "8", "--sync-every", "4"]),
])
def test_torchrun_example(script: str, args: list[str]) -> None:
    first, last = losses(torchrun(script, *args))
    assert last < first


@pytest.mark.timeout(100)
def test_local_sgd_example_fsdp_inside_replicas() -> None:
    # 4 ranks as 2 replicas of 2, FSDP2 inside each: every rank syncs half the model
    out = torchrun("local_sgd.py", "--steps", "8", "--sync-every", "4", "--replica-size", "2", nproc=4)
    first, last = losses(out)
    assert last < first
    assert "replicas: 2 of 2 ranks (FSDP2 inside); this rank syncs 5509 of 11018 elements" in out, out[-2000:]


@pytest.mark.timeout(100)
def test_lightning_example() -> None:
    pytest.importorskip("lightning")
    first, last = losses(torchrun("lightning_ddp.py", "--steps", "5"))
    assert last < first


@pytest.mark.timeout(100)
def test_accelerate_example(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    first, last = losses(torchrun("accelerate_ddp.py", "--steps", "5", "--ckpt", str(tmp_path / "ckpt")))
    assert last < first
    assert {"commpress_rank0.pt", "commpress_rank1.pt"} <= set(os.listdir(tmp_path / "ckpt"))


@pytest.mark.timeout(100)
@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="mpirun not installed in the venv")
def test_parameter_server_example() -> None:
    pytest.importorskip("mpi4py")
    out = run([MPIRUN, "-n", "3", "--oversubscribe", sys.executable, str(EXAMPLES / "parameter_server.py"),
               "--steps", "5"])
    first, last = losses(out)
    assert last < first
