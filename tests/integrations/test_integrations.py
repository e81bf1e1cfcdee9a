"""Lightning and Accelerate integrations (commpress/integrations), with the real packages.

Each multi-rank test launches tests/integration_workers.py under torchrun (2 CPU gloo ranks),
the way a user's script runs: an uninterrupted run checkpoints half-way, new processes resume
from that checkpoint, and the resumed run must end with bit-identical parameters. A control
run that loses the compression state must end elsewhere, so the comparison can fail.
The gather/encode path of commpress.integrations.ranks is tested in one process too.
"""

from __future__ import annotations

import csv
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import commpress.ddp
from commpress.integrations import ranks

from ddp_workers import free_port, launch
from integration_workers import LOG_EVERY, STEPS, worker_gather

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parents[1] / "integration_workers.py"


def torchrun(framework: str, mode: str, out: Path, world: int = 2, timeout: float = 120.0) -> None:
    """Run the worker on ``world`` ranks under torchrun; fail with its output on error or hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKERS.parent)]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(WORKERS), framework, mode, str(out),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        output, _ = proc.communicate()
        raise AssertionError(f"{framework} {mode} did not finish in {timeout:.0f} s:\n{output.decode()[-4000:]}") from None
    assert proc.returncode == 0, f"{framework} {mode} failed ({proc.returncode}):\n{output.decode()[-6000:]}"


def results(out: Path, mode: str, world: int = 2) -> list[dict]:
    return [torch.load(out / f"{mode}_rank{r}.pt", weights_only=True) for r in range(world)]


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lightning_callback_resumes_exactly(tmp_path: Path) -> None:
    torchrun("lightning", "full", tmp_path)
    ckpt = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=True)
    entry = ckpt["callbacks"]["CompressionCallback"]
    assert entry["world_size"] == 2 and [s["rank"] for s in entry["ranks"]] == [0, 1]
    res0, res1 = (s["feedback"]["residuals"]["net.inp.weight"] for s in entry["ranks"])
    assert not torch.equal(res0, res1)  # residuals are per rank: rank 1's is not rank 0's copy
    assert all(s["step"] == 8 and s["velocity"] for s in entry["ranks"])  # SGD momentum in the hook

    torchrun("lightning", "resume", tmp_path)
    del ckpt["callbacks"]["CompressionCallback"]
    torch.save(ckpt, tmp_path / "dropped.ckpt")
    torchrun("lightning", "dropped", tmp_path)
    full, resumed, dropped = (results(tmp_path, m) for m in ("full", "resume", "dropped"))
    for r in range(2):
        assert same_params(full[r]["params"], resumed[r]["params"]), f"rank {r}: resumed run differs"
        assert full[r]["step"] == resumed[r]["step"] == 16
        assert not same_params(full[r]["params"], dropped[r]["params"])  # the state matters
        assert dropped[r]["step"] == 8  # restarted at 0 without it
    assert same_params(resumed[0]["params"], resumed[1]["params"])

    # log_stats: rank 0's stats reached Lightning's logger on its log_every_n_steps steps
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(LOG_EVERY - 1, 2 * STEPS, LOG_EVERY))
    assert [float(r["commpress/steps"]) for r in rows] == [int(r["step"]) + 1 for r in rows]  # the hook's own count
    sent = [float(r["commpress/bytes_sent"]) for r in rows]
    assert all(a < b for a, b in zip(sent, sent[1:])) and sent[0] > 0
    assert all(3 < float(r["commpress/compression_ratio"]) < 20 for r in rows)  # top-k 5% of the weights
    assert all(float(r["commpress/guard_ratio"]) > 0 for r in rows) and "commpress/guard_fired" in rows[0]
    assert full[0]["metrics"]["commpress/steps"] == resumed[0]["metrics"]["commpress/steps"] == 2 * STEPS
    assert full[1]["metrics"] == resumed[1]["metrics"] == {}  # rank 0 only


def test_accelerate_register_resumes_exactly(tmp_path: Path) -> None:
    torchrun("accelerate", "full", tmp_path)
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("commpress_rank*.pt"))
    assert files == ["commpress_rank0.pt", "commpress_rank1.pt"]
    states = [torch.load(tmp_path / "ckpt" / f, weights_only=True) for f in files]
    assert [s["rank"] for s in states] == [0, 1] and all(s["step"] == 8 for s in states)
    torchrun("accelerate", "resume", tmp_path)
    torchrun("accelerate", "unregistered", tmp_path)
    full, resumed, control = (results(tmp_path, m) for m in ("full", "resume", "unregistered"))
    for r in range(2):
        assert same_params(full[r]["params"], resumed[r]["params"]), f"rank {r}: resumed run differs"
        assert full[r]["step"] == resumed[r]["step"] == 16
        assert not same_params(full[r]["params"], control[r]["params"])
        assert control[r]["step"] == 8


def test_gather_states_collects_every_rank_in_order() -> None:
    launch(worker_gather, 3, timeout=120)


# ----- single process: the byte form ------------------------------------------------------------
def sample_state() -> dict:
    return {
        "format": 1, "seed": 2**64 - 1, "ratio": 0.1 + 0.2, "nan": float("inf"), "name": "topk", "flag": True,
        "none": None, "rules": {"w": [0.9, 0.0, False]}, "guard": (0, 1, 2, 0.5),
        "velocity": {"w": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.float64)},
        "empty": torch.empty(0, 7), "scalar": torch.tensor(3, dtype=torch.int32), "mask": torch.tensor([True, False]),
    }


def test_encode_decode_round_trip_is_exact() -> None:
    state = sample_state()
    back = ranks.decode(ranks.encode(state))
    assert back["guard"] == [0, 1, 2, 0.5]  # tuples come back as lists
    back["guard"] = tuple(back["guard"])
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and torch.equal(back[key], value)
        elif key == "velocity":
            assert all(torch.equal(back[key][k], v) for k, v in value.items())
        else:
            assert back[key] == value, key


@pytest.mark.parametrize("bad", [{1: 2}, {"x": object()}, {"__tensor__": 0}, {"x": [{"y": {3}}]}])
def test_encode_rejects_what_would_not_travel(bad: dict) -> None:
    with pytest.raises(TypeError, match="state"):
        ranks.encode(bad)


def test_decode_rejects_truncated_or_padded_bytes() -> None:
    buf = ranks.encode(sample_state())
    for broken in (buf[:-1], torch.cat([buf, torch.zeros(1, dtype=torch.uint8)]), buf[:4]):
        with pytest.raises(ValueError, match="commpress rank state"):
            ranks.decode(broken)
    huge = buf.clone()
    huge[:8] = torch.tensor([1 << 40], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="header length"):
        ranks.decode(huge)


def test_own_state_checks_format_world_size_and_ranks() -> None:
    entry = {"format": ranks.FORMAT, "world_size": 2, "ranks": [{"rank": 0, "t": torch.ones(2)}, {"rank": 1}]}
    assert torch.equal(ranks.own_state(entry, 0, 2, "cpu")["t"], torch.ones(2))
    assert ranks.own_state(entry, 1, 2, "cpu") == {"rank": 1}
    for rank, world in ((0, 1), (2, 3), (3, 4)):  # another world size: rank 0's, whose loader drops per-rank parts
        assert ranks.own_state(entry, rank, world, "cpu")["rank"] == 0
    with pytest.raises(ValueError, match="format"):
        ranks.own_state({**entry, "format": 9}, 0, 2, "cpu")
    with pytest.raises(ValueError, match="every rank's state"):
        ranks.own_state({**entry, "ranks": None}, 1, 2, "cpu")
    with pytest.raises(ValueError, match="every rank's state"):
        ranks.own_state({**entry, "ranks": entry["ranks"][:1]}, 0, 1, "cpu")
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        ranks.own_state({**entry, "world_size": "2"}, 0, 2, "cpu")


def _trained_state(steps: int) -> commpress.ddp.CompressionState:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(ddp, "topk", optimizer=opt, ratio=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(torch.randn(16, 32, generator=g)), torch.randint(0, 10, (16,), generator=g)).backward()
        opt.step()
    return state


def test_integration_entry_of_another_world_size_loads_what_is_global(group_of_one: None, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Lightning's entry (``ranks.own_state``) and Accelerate's files (``read_state``) written by 2 ranks, loaded by
    this 1-rank group: rank 0's state, whose per-rank residuals and velocities the DDP loader drops with one warning."""
    from commpress.integrations.accelerate import read_state, state_path

    saved = _trained_state(3).state_dict()
    assert saved["feedback"]["residuals"] and saved["velocity"] and saved["step"] == 3
    per_rank = [{**saved, "world_size": 2, "rank": r} for r in range(2)]  # as 2 ranks wrote them
    entry = {"format": ranks.FORMAT, "world_size": 2, "ranks": [ranks.decode(ranks.encode(s)) for s in per_rank]}
    for r, s in enumerate(per_rank):
        torch.save(s, state_path(tmp_path, "commpress", r))
    for how, own in (("lightning", lambda: ranks.own_state(entry, 0, 1, "cpu")),
                     ("accelerate", lambda: read_state(tmp_path, "commpress", 0, 1, "cpu"))):
        state = _trained_state(0)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="commpress"):
            state.load_state_dict(own())
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "written by 2 ranks (file of rank 0) loaded at 1 ranks (rank 0)" in warnings[0], (
            how, warnings)
        assert state.step == 3 and state.guard.state() == saved["guard"] and state.stats()["bytes_sent"] > 0, how
        assert not state.velocity and all(state.residual(n) is None for n in state.plans), how
    # a rank the saving run did not have (it had fewer processes) reads rank 0's file; at its own size a lost file is an error
    assert read_state(tmp_path, "commpress", 2, 3, "cpu")["rank"] == 0
    state_path(tmp_path, "commpress", 1).unlink()
    with pytest.raises(FileNotFoundError, match="no commpress state for rank 1 of 2"):
        read_state(tmp_path, "commpress", 1, 2, "cpu")


def test_callback_refuses_an_optimizer_argument_and_bad_index() -> None:
    from commpress.integrations.lightning import CompressionCallback

    with pytest.raises(TypeError, match="optimizer_index"):
        CompressionCallback("topk", optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(TypeError, match="optimizer_index"):
        CompressionCallback("topk", optimizer_index=-1)
    with pytest.raises(TypeError, match="log_stats"):
        CompressionCallback("topk", log_stats="yes")
    with pytest.raises(TypeError, match="log_prefix"):
        CompressionCallback("topk", log_prefix=None)


def test_callback_needs_the_ddp_strategy() -> None:
    import lightning.pytorch as pl

    from commpress.integrations.lightning import CompressionCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            return self.lin(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[CompressionCallback("topk")])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    with pytest.raises(TypeError, match="needs Lightning's DDPStrategy .* got SingleDeviceStrategy"):
        trainer.fit(Tiny(), loader)


def test_accelerate_register_needs_the_prepared_ddp_model() -> None:
    from accelerate import Accelerator

    from commpress.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 1))  # one process: no DDP wrapper
    with pytest.raises(TypeError, match="DistributedDataParallel .* got Linear with 1 process"):
        register(accelerator, model, "topk")
