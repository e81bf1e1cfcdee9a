"""commpress.statslog: ``stats()`` flattened to scalar metrics, and ``state.log_to(writer)``.

The DDP runs are one process in a world-size-1 gloo group (the hook runs as at any world size:
top-k still sends a fraction of the dense bytes). The TensorBoard test writes real event files
with ``torch.utils.tensorboard.SummaryWriter`` and reads them back with TensorBoard's own
``EventAccumulator``. The FSDP state's ``log_to`` is checked on 2 ranks in
``fsdp_workers.worker_nonfinite``, the Lightning callback's logging in
``tests/integrations/test_integrations.py``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import commpress
from commpress.comm.costmodel import OPTIONS
from commpress.statslog import StatsLogger, flatten_stats

STEPS = 6


class Recorder:
    """A duck-typed writer: keeps every ``add_scalar`` call."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.rows.append((tag, value, global_step))


class Broken:
    """A writer whose disk is full."""

    def __init__(self) -> None:
        self.calls = 0

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.calls += 1
        raise OSError("No space left on device")


def train(codec: str, steps: int = STEPS, writer: Any = None, every: int = 2, **options: Any) -> tuple[
        commpress.ddp.CompressionState, StatsLogger | None]:
    """``steps`` SGD steps of a small MLP under the commpress hook; (the state, its logger)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(ddp, codec, optimizer=opt, **options)
    log = None if writer is None else state.log_to(writer, every=every)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    del ddp, opt
    return state, log


# ----- flatten_stats ----------------------------------------------------------------------------
def test_flatten_keeps_numbers_and_bools_and_skips_the_rest() -> None:
    stats = {
        "bytes_sent": 10, "ratio": 2.5, "on": True, "off": False, "nan": float("nan"), "name": "topk",
        "none": None, "list": [1, 2], "t": torch.tensor(3.0), "big": torch.ones(2), "sub": {"a": 1, "b": "x"},
    }
    flat = flatten_stats(stats)
    assert set(flat) == {"commpress/" + k for k in ("bytes_sent", "ratio", "on", "off", "nan", "t")} | {"commpress/sub/a"}
    assert flat["commpress/bytes_sent"] == 10.0 and flat["commpress/ratio"] == 2.5 and flat["commpress/t"] == 3.0
    assert flat["commpress/on"] == 1.0 and flat["commpress/off"] == 0.0 and math.isnan(flat["commpress/nan"])
    assert all(type(v) is float for v in flat.values())
    assert set(flatten_stats({"x": 1, "y": "z"}, prefix="")) == {"x"}
    assert set(flatten_stats({"x": 1}, prefix="train/comm")) == {"train/comm/x"}


def test_flatten_a_real_topk_state(group_of_one: None) -> None:
    state, _ = train("topk", ratio=0.05)
    stats = state.stats()
    flat = flatten_stats(stats)
    numeric = {k for k, v in stats.items() if isinstance(v, (int, float))}
    assert set(flat) == {f"commpress/{k}" for k in numeric} and len(flat) == len(stats)  # every entry is a number
    for key in ("compression_ratio", "bytes_sent", "dense_bytes", "guard_ratio", "guard_fired", "steps"):
        assert flat[f"commpress/{key}"] == float(stats[key]), key
    assert flat["commpress/steps"] == STEPS
    assert flat["commpress/bytes_sent"] > 0 and 2 < flat["commpress/compression_ratio"] < 50  # top-k 5% of the first weight, the rest dense


def test_flatten_auto_reports_its_choice_as_numbers(group_of_one: None) -> None:
    state, _ = train("auto", steps=2)
    flat = flatten_stats(state.stats())
    counts = {o: flat[f"commpress/auto_{o}_buckets"] for o in OPTIONS}
    choices = [v for k, v in flat.items() if k.startswith("commpress/auto_b") and k.endswith("_choice")]
    assert choices and sum(counts.values()) == len(choices)  # one choice per bucket, counted per option
    for code in choices:
        assert code in range(len(OPTIONS)) and counts[OPTIONS[int(code)]] >= 1


# ----- log_to -----------------------------------------------------------------------------------
def test_log_to_writes_every_n_steps_to_a_tensorboard_event_file(group_of_one: None, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (requirements/dev.txt has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    state, log = train("topk", writer=writer, every=2, ratio=0.05)
    writer.close()
    assert log is not None and log.writes == STEPS // 2

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"commpress/compression_ratio", "commpress/bytes_sent", "commpress/guard_ratio", "commpress/steps"} <= tags
    assert tags == set(flatten_stats(state.stats()))
    series = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}
    assert all([s for s, _ in v] == [2, 4, 6] for v in series.values())
    assert [v for _, v in series["commpress/steps"]] == [2, 4, 6]  # the hook's step count at each write
    sent = [v for _, v in series["commpress/bytes_sent"]]
    assert 0 < sent[0] < sent[1] < sent[2] and sent[2] == pytest.approx(state.stats()["bytes_sent"])
    assert all(2 < v < 50 for _, v in series["commpress/compression_ratio"])  # as above


def test_log_to_a_duck_typed_writer_and_write_now(group_of_one: None) -> None:
    writer = Recorder()
    state, log = train("sign", steps=5, writer=writer, every=3)
    assert log is not None and {step for _, _, step in writer.rows} == {3}
    log.write(state.step)
    assert {step for _, _, step in writer.rows} == {3, 5} and log.writes == 2
    assert ("commpress/steps", 5.0, 5) in writer.rows
    log.stop()
    log.write(6)
    assert log.writes == 2


def test_a_failing_writer_warns_once_and_training_goes_on(group_of_one: None, caplog: pytest.LogCaptureFixture) -> None:
    writer = Broken()
    with caplog.at_level(logging.WARNING, logger="commpress"):
        state, log = train("topk", steps=STEPS, writer=writer, every=1, ratio=0.05)
    assert state.step == STEPS and log is not None and not log.active and writer.calls == 1
    warnings = [r for r in caplog.records if "writing the stats" in r.getMessage()]
    assert len(warnings) == 1 and "step 1" in warnings[0].getMessage()


def test_only_rank_zero_writes_unless_all_ranks() -> None:
    def stats() -> dict[str, float]:
        return {"compression_ratio": 4.0}

    for rank, all_ranks, expected in ((0, False, 1), (1, False, 0), (1, True, 1)):
        writer = Recorder()
        log = StatsLogger(stats, writer, every=2, rank=rank, all_ranks=all_ranks)
        for step in range(1, 4):
            log.after_step(step)
        assert len(writer.rows) == expected, (rank, all_ranks)
        assert all(row == ("commpress/compression_ratio", 4.0, 2) for row in writer.rows)


@pytest.mark.parametrize("kwargs, error", [
    ({"every": 0}, ValueError), ({"every": True}, ValueError), ({"every": 1.5}, ValueError),
    ({"prefix": None}, TypeError), ({"all_ranks": 1}, TypeError),
])
def test_bad_arguments_fail_clearly(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        StatsLogger(dict, Recorder(), **kwargs)


def test_a_writer_without_add_scalar_is_a_type_error(group_of_one: None) -> None:
    state, _ = train("topk", steps=1, ratio=0.05)
    with pytest.raises(TypeError, match="add_scalar"):
        state.log_to(object())  # type: ignore[arg-type]
