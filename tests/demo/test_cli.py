"""The console entry point: `commpress train` end to end, and its usage errors."""

import os
import subprocess
import sys

import pytest

from commpress.comm.costmodel import Link
from commpress.demo import shaped_net
from commpress.demo import train as demo


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "commpress", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


ROWS = ("dense all-reduce (DDP, no hook)", "PyTorch fp16_compress_hook", "commpress qsgd")


def _rows(stdout):
    """``{label: [MB/step, loss, step s, ...]}`` of the closing table."""
    out = {}
    for line in stdout.splitlines():
        for label in ROWS:
            if line.startswith(label + " ") and label not in out:
                out[label] = line[len(label):].split()
    return out


def test_train_demo_loopback_projects_the_link(tmp_path):
    """Always runs (no root needed): loopback, the link's cost labelled as a projection."""
    proc = run("train", "--loopback", "--steps", "4", "--batch", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "PROJECTION (loopback + cost model)" in proc.stdout and "1gbit link is PROJECTED" in proc.stderr
    rows = _rows(proc.stdout)
    assert list(rows) == list(ROWS), proc.stdout
    dense, fp16, qsgd = (float(rows[r][0]) for r in ROWS)
    assert dense == pytest.approx(43.25, abs=0.01) and fp16 == pytest.approx(dense / 2, abs=0.01)
    assert qsgd < dense / 6  # 4-bit QSGD: ~7.7x fewer bytes
    # projected step = loopback step + the 1 Gbit/s link's time for the bytes: >= 0.35 s for dense
    assert float(rows[ROWS[0]][2]) >= 0.8 * dense * 1e6 * 8 / 1e9
    assert os.path.getsize(tmp_path / "train_demo.png") > 1000


@pytest.mark.skipif(not shaped_net.can_shape()[0], reason=f"cannot shape links: {shaped_net.can_shape()[1]}")
def test_train_demo_on_shaped_links(tmp_path):
    """As root with ip netns: measured on 1 Gbit/s links, no projection."""
    proc = run("train", "--steps", "3", "--batch", "1", "--no-baseline", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "1gbit links (shaped, measured)" in proc.stdout and "PROJECTION" not in proc.stdout
    assert list(_rows(proc.stdout)) == ["commpress qsgd"]


def test_projection_and_time_to_target():
    link = Link.from_gbit(1.0, 50e-6)
    assert demo.link_seconds(link, 2 * 1e6 / 2, 2) == pytest.approx(link.allreduce(1e6, 2))  # ring all-reduce
    results = [{"method": "allreduce", "claimed_wire_bytes_per_step": 125e6, "median_step_s": 0.1,
                "curve": [[1, 0.1, 3.0], [2, 0.2, 2.0]]}]
    demo.project(results, link, 2)
    extra = 2 * 50e-6 + 1.0  # 125 MB at 1 Gbit/s
    assert results[0]["median_step_s"] == pytest.approx(0.1 + extra) and results[0]["loopback_step_s"] == 0.1
    assert results[0]["curve"][1][1] == pytest.approx(0.2 + 2 * extra)
    assert demo.time_to_target(results[0], 2.5) == pytest.approx(0.2 + 2 * extra)
    assert demo.time_to_target(results[0], 1.0) is None
    assert demo.parse_link("10gbit") == 10.0 and demo.parse_link("500mbit") == 0.5
    with pytest.raises(ValueError, match="--link"):
        demo.parse_link("fast")


def test_train_rejects_bad_codec_and_params():
    for args, msg in [(["--codec", "nope"], "unknown codec"), (["--codec", "topk", "--param", "ratio=2"], "ratio"),
                      (["--param", "oops"], "KEY=VALUE"), (["--workers", "0"], "--workers"),
                      (["--link", "fast"], "--link")]:
        proc = run("train", *args)
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr)


def test_help_everywhere():
    for args in (["--help"], ["info", "--help"], ["train", "--help"], ["bench", "--help"]):
        proc = run(*args)
        assert proc.returncode == 0 and "usage:" in proc.stdout
    text = run("train", "--help").stdout
    assert all(opt in text for opt in ("--codec", "--steps", "--link", "--loopback", "default qsgd"))


def test_ps_subcommand_forwards_to_the_parameter_server_cli():
    proc = run("ps", "--help")
    assert proc.returncode == 0 and "python -m commpress.ps" in proc.stdout
    proc = run("info", "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
