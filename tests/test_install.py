"""Installing commpress as a user does: into a fresh venv that holds only torch, then used from
outside the source tree (so ``import commpress`` finds the installed copy, never the checkout).

* ``pip install .`` (pip isolates the build, which then sees no torch): the pure-Python
  package, whose ops run on the reference backend.
* the native wheel (``pip wheel --no-build-isolation``): ``commpress._C`` with the CPU kernels.
  It is built in the checkout, where ``scripts/test.sh``'s editable build already left the
  compiled objects in ``build/``, so ninja only links (seconds, not a full build).

About 1.5 minutes on 2 cores, most of it installing torch into the venv (from the local file of
torch==2.13.0 on CI's machine).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# A tiny round trip through the installed package: encode, serialise, parse, decode.
ROUND_TRIP = """
import torch, commpress
from commpress import codecs, wire
assert commpress.__file__.startswith(__import__("sys").prefix), commpress.__file__
x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
for spec in ("sign", "qsgd:bits=4", "topk:ratio=0.01", "randomk:ratio=0.01"):
    codec = codecs.from_spec(spec)
    y = codec.decode(wire.from_bytes(wire.to_bytes(codec.encode(x, seed=3))))
    assert y.shape == x.shape and torch.isfinite(y).all(), spec
# the CuPy backend's kernel sources travel inside the package (no checkout beside a wheel)
from pathlib import Path
src = Path(commpress.__file__).parent / "_csrc"
units = ("bitpack", "sign", "qsgd", "topk", "randomk")
assert all((src / "cuda" / f"{u}.cu").is_file() for u in units), sorted(src.rglob("*"))
assert (src / "cuda" / "launch_params.h").is_file() and (src / "include" / "commpress" / "hd.h").is_file()
print("round trip ok")
"""


def _run(*args, cwd, timeout=600):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMMPRESS_PURE_PYTHON")})
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _pip(python, *args, cwd):
    return _run(python, "-m", "pip", "--disable-pip-version-check", "-q", *args, cwd=cwd)


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    """(python of a fresh venv holding only the torch these tests run on, an empty folder)."""
    base = tmp_path_factory.mktemp("install")
    _run(sys.executable, "-m", "venv", base / "venv", cwd=base)
    python = base / "venv" / "bin" / "python"
    _pip(python, "install", f"torch=={torch.__version__.split('+')[0]}", cwd=base)
    outside = base / "elsewhere"
    outside.mkdir()
    return python, outside


def _source_copy(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "out", "*.so", "*.egg-info",
                                    "__pycache__", ".*_cache", ".hypothesis")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _info(python, cwd):
    report = json.loads(_run(python, "-m", "commpress", "info", "--json", cwd=cwd))
    assert Path(report["location"]).is_relative_to(python.parent.parent), report["location"]
    return report


@pytest.mark.timeout(900)
def test_pip_install_dot_gives_working_pure_python_package(clean_venv, tmp_path):
    python, outside = clean_venv
    src = _source_copy(tmp_path / "src")
    _pip(python, "install", src, cwd=outside)  # isolated build: no torch there, so no extension
    report = _info(python, outside)
    assert not report["native"]["loaded"] and "commpress._C" in report["native"]["reason"]
    assert report["optional"]["numba"] is False and report["optional"]["tqdm"] is True  # runtime.txt
    assert {b["cpu"] for b in report["op_backends"].values()} == {"reference"}
    text = _run(python, "-m", "commpress", "info", cwd=outside)
    assert "not built (pure-Python install" in text and "runs on CPU" in text
    assert _run(python, "-c", ROUND_TRIP, cwd=outside).strip() == "round trip ok"


@pytest.mark.timeout(900)
def test_native_wheel_installs_and_runs(clean_venv, tmp_path):
    python, outside = clean_venv
    dist = tmp_path / "dist"
    _pip(sys.executable, "wheel", "--no-build-isolation", "--no-deps", "-w", dist, ROOT, cwd=ROOT)
    (wheel,) = dist.glob("commpress-*.whl")
    assert wheel.name.endswith("-cp311-abi3-linux_x86_64.whl") or "abi3" in wheel.name, wheel.name
    _pip(python, "install", "--force-reinstall", "--no-deps", wheel, cwd=outside)
    report = _info(python, outside)
    assert report["native"]["loaded"], report["native"]["reason"]
    assert all("cpu" in devices for devices in report["native"]["ops"].values()), report["native"]["ops"]
    assert {b["cpu"] for b in report["op_backends"].values()} == {"native"}
    assert _run(python, "-c", ROUND_TRIP, cwd=outside).strip() == "round trip ok"


def _names(requirements):
    return {re.split(r"[<>=!~ \[;]", r.strip(), maxsplit=1)[0].lower() for r in requirements if r.strip()}


def test_the_demo_list_is_a_subset_of_the_dev_list():
    """scripts/env.sh skips the demo's install when the dev list is current: it must contain the demo's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("commpress_setup", ROOT / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # setup() itself runs only under __main__
    demo, dev = setup_py._read_requirements("demo.txt"), setup_py._read_requirements("dev.txt")
    assert demo and set(demo) <= set(dev), set(demo) - set(dev)


def test_runtime_requirements_and_extras_are_in_the_pinned_dev_list():
    import importlib.util

    spec = importlib.util.spec_from_file_location("commpress_setup", ROOT / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # setup() itself runs only under __main__
    dev = _names(setup_py._read_requirements("dev.txt"))
    runtime = setup_py._read_requirements("runtime.txt")
    assert runtime and "torch" not in _names(runtime)
    for extra, requirements in {"runtime": runtime, **setup_py.EXTRAS}.items():
        assert _names(requirements) <= dev, f"{extra}: {_names(requirements) - dev} missing from requirements/dev.txt"
