"""The console entry point: `commpress train` end to end, and its usage errors."""

import os
import subprocess
import sys


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "commpress", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_train_demo_runs_and_reports(tmp_path):
    proc = run("train", "--steps", "4", "--workers", "2", "--batch", "4", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "dense all-reduce (no hook)" in proc.stdout and "commpress topk:ratio=0.01" in proc.stdout
    assert os.path.getsize(tmp_path / "train_demo.png") > 1000


def test_train_rejects_bad_codec_and_params():
    for args, msg in [(["--codec", "nope"], "unknown codec"), (["--codec", "topk", "--param", "ratio=2"], "ratio"),
                      (["--param", "oops"], "KEY=VALUE"), (["--workers", "0"], "--workers")]:
        proc = run("train", *args)
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr)


def test_help_everywhere():
    for args in (["--help"], ["info", "--help"], ["train", "--help"], ["bench", "--help"]):
        proc = run(*args)
        assert proc.returncode == 0 and "usage:" in proc.stdout


def test_ps_subcommand_forwards_to_the_parameter_server_cli():
    proc = run("ps", "--help")
    assert proc.returncode == 0 and "python -m commpress.ps" in proc.stdout
    proc = run("info", "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
