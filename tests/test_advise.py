"""``commpress advise``: the buckets and bytes it prices are DDP's and commpress's own; the CLI.

How close its step times come to the measured ones is a benchmark, not a unit test (timing on a
shared machine): ``scripts/advise_validate.py`` checks them against ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from advise_workers import worker_buckets_and_bytes

from commpress.advise import CODECS, ModelShape, advise, calibration_numel, count_shape, ddp_buckets
from commpress.advise import main as advise_main
from commpress.comm.costmodel import DeviceCost, Entry, Link

from ddp_workers import free_port, launch

ROOT = Path(__file__).resolve().parents[1]
FREE = DeviceCost(0.0, 0.0, 0.0, 0.0)  # no device costs: predictions are the link's alone


def test_buckets_and_bytes_are_ddps_and_the_hooks(tmp_path):
    """The bucket layout equals DDP's (after its rebuild); each codec's bytes equal the hook's stats."""
    out = tmp_path / "out.json"
    launch(worker_buckets_and_bytes, 2, str(out))
    got = json.loads(out.read_text())
    assert [[n for n, _ in b] for b in got["predicted"]] == got["real"]
    assert len(got["real"]) >= 2  # the model spans several 1 MB buckets: the test can tell layouts apart
    buckets = tuple(tuple(Entry(n, c) for n, c in b) for b in got["predicted"])
    shape = ModelShape("test", buckets, None, "none")
    options = {o.name: o for o in advise(shape, 2, Link.from_gbit(1.0), {name: FREE for name in CODECS})}
    for name, measured in got["bytes"].items():
        # within 0.1%: the hook's count is 8 bytes per step below the frames' plan (29560 vs 29568)
        assert options[name].bytes_sent == pytest.approx(measured, rel=1e-3), name


def test_every_option_pays_ddps_two_bucket_copies():
    """DDP copies the gradient into its bucket and back whatever the hook: 2 passes in every option."""
    shape = count_shape("10.8M", "sgd", 25.0)
    link = Link.from_gbit(1.0, 0.0)
    free = {o.name: o for o in advise(shape, 2, link, {name: FREE for name in CODECS})}
    copying = DeviceCost(0.0, 0.0, 1e-9, 0.0)  # 1 ns per element and pass, nothing else
    paid = {o.name: o for o in advise(shape, 2, link, {name: copying for name in CODECS})}
    for name, o in paid.items():
        # dense pays one more pass (its division), the compressed paths their own passes: at least the copies
        assert o.work_s - free[name].work_s >= 2 * 1e-9 * shape.numel * (1 - 1e-9), name
    assert paid["topk"].work_s - free["topk"].work_s == pytest.approx((2 + 2) * 1e-9 * shape.numel, rel=1e-3)


def test_calibration_size_is_the_bucket_a_typical_element_is_in():
    def shape(*sizes: int) -> ModelShape:
        return ModelShape("t", tuple((Entry(n, True),) for n in sizes), None, "sgd")

    assert calibration_numel(shape(1 << 20, 16_777_216, 1 << 20)) == 16_777_216  # the 17M MLP's big bucket
    assert calibration_numel(shape(*[6_553_600] * 4, 300_000)) == 6_553_600  # 25 MB buckets
    assert calibration_numel(shape(1000, 2000)) == 1 << 20  # tiny models: not below 1M (timer resolution)
    assert calibration_numel(shape(1 << 27)) == 1 << 25  # bounded: 128 MB per buffer at most


def test_registration_order_is_reversed():
    buckets = ddp_buckets([("a", (1024, 256)), ("b", (256,)), ("c", (512, 1024))], bucket_cap_mb=1.0)
    assert [[e.numel for e in b] for b in buckets] == [[512 * 1024], [256, 1024 * 256]]
    assert [[e.compressed for e in b] for b in buckets] == [[True], [False, True]]


def test_dense_and_fp16_follow_the_ring():
    shape = count_shape("10.8M", "sgd", 25.0)
    assert shape.numel == 10_800_000
    link = Link.from_gbit(1.0, 0.0)
    options = {o.name: o for o in advise(shape, 4, link, {name: FREE for name in CODECS})}
    assert options["dense"].bytes_sent == pytest.approx(2 * 3 / 4 * 4 * 10.8e6)
    assert options["fp16"].bytes_sent == pytest.approx(options["dense"].bytes_sent / 2)
    assert options["dense"].wire_s == pytest.approx(options["dense"].bytes_sent * 8 / 1e9)
    assert options["topk"].bytes_sent < options["dense"].bytes_sent / 10
    # with free codecs, auto is at least as fast as every option it chooses between
    assert options["auto"].reduce_s <= min(options["dense"].reduce_s, options["fp16"].reduce_s) + 1e-12


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commpress", "advise", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cli_table_plot_and_json(tmp_path):
    plot, js = tmp_path / "advise.png", tmp_path / "advise.json"
    proc = _cli("--params", "10.8M", "--world", "4", "--link", "10gbit", "--compute-ms", "50",
                "--plot", str(plot), "--json", str(js), "--calibration-numel", "65536")
    assert proc.returncode == 0, proc.stderr
    for option in ("dense", "fp16", "topk", "sign", "qsgd", "randomk", "auto"):
        assert f"| {option}" in proc.stdout
    assert "fastest predicted:" in proc.stdout
    assert plot.stat().st_size > 1000
    data = json.loads(js.read_text())
    assert data["world"] == 4 and data["compute_s"] == pytest.approx(0.05)
    steps = {o["name"]: o["step_s"] for o in data["options"]}
    assert all(s > 0.05 for s in steps.values())


def test_under_torchrun_every_rank_measures_and_rank_0_prints(tmp_path):
    js = tmp_path / "advise.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "commpress", "advise", "--params", "2M", "--compute-ms", "10", "--plot", "", "--json", str(js),
           "--calibration-numel", "65536"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("fastest predicted:") == 1  # rank 0 only
    data = json.loads(js.read_text())
    assert data["world"] == 2 and {o["name"] for o in data["options"]} >= {"dense", "fp16", "sign", "auto"}


@pytest.mark.parametrize("args, message", [
    (("--params", "10M", "--world", "1"), "--world must be at least 2"),
    (("--model", "no_such_module:build"), "no_such_module"),
    (("--params", "ten"), "--params expects a count"),
    (("--params", "10M", "--link", "fast"), "--link expects a rate"),
    (("--params", "10M", "--calibrate"), "run under torchrun"),
])
def test_cli_bad_input_is_a_usage_error(args, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        advise_main([*args, "--plot", ""])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
