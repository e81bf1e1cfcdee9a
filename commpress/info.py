"""What this installation can do: which backends are present and which one runs each op.

``python -m commpress info`` prints it; an install (pure-Python or native wheel, CPU or CUDA
torch) is checked by reading it (tests/test_install.py, scripts/cuda_build_check.sh).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from .codecs import available
from .kernels import ops


def _has_module(name: str) -> bool:
    # find_spec only looks for the package; it neither imports it nor initialises a GPU.
    return importlib.util.find_spec(name) is not None


def _cuda_sources_present() -> bool:
    # the CuPy backend compiles csrc/cuda at run time (commpress/kernels/cupy_header.py)
    from .kernels.cupy_header import CSRC, UNITS

    return all((CSRC / "cuda" / f"{unit}.cu").is_file() for unit in UNITS)


def _cuda_backend(op: str, cupy_installed: bool) -> str:
    """The backend that would run ``op`` on a CUDA tensor, read without touching a GPU.

    The order of :func:`commpress.kernels.ops.backend_for`, except that CuPy counts when it is
    installed with the kernel sources: whether a device is usable is asked only when an op runs.
    """
    preferred = os.environ.get("COMMPRESS_BACKEND", "")
    order: tuple[str, ...] = ops.BACKEND_ORDER["cuda"]
    if preferred in ops.BACKEND_NAMES:
        order = (preferred, *order)
    for name in order:
        if name == "native" and ops.has_native(op, "cuda"):
            return name
        if name == "cupy" and cupy_installed:
            return name
        if name == "reference":
            return name
    return "reference"


def info() -> dict[str, Any]:
    """Report versions, native kernels per device, the backend of each op, libraries and codecs.

    Never initialises CUDA: kernel availability is read from torch's dispatcher registry, so a
    CUDA build of the extension lists its CUDA kernels on a machine without a GPU.
    """
    from ._version import __version__

    reason = ops.load_native()
    native_ops = ops.native_ops()
    cupy_installed = _has_module("cupy") and _cuda_sources_present()
    return {
        "commpress": __version__,
        "location": os.path.dirname(os.path.abspath(__file__)),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "native": {"loaded": reason is None, "reason": reason, "ops": native_ops},
        "backends": {
            "reference": True,
            "cpu": any("cpu" in d for d in native_ops.values()),
            "cuda": any("cuda" in d for d in native_ops.values()),
            # installed, not probed: whether a GPU is usable is asked only when an op runs
            "numba (cpu)": _has_module("numba"),
            "cupy (cuda)": cupy_installed,
        },
        # which backend runs each op for a tensor on that device (ops.backend_for's order)
        "op_backends": {
            op: {
                "cpu": ops.backend_for(op, "cpu"),
                # a CPU build of torch has no CUDA tensors to run anything on
                "cuda": _cuda_backend(op, cupy_installed) if torch.version.cuda else None,
            }
            for op in native_ops
        },
        "optional": {name: _has_module(name) for name in ("numba", "cupy", "mpi4py", "tqdm")},
        "codecs": available(),
    }


def format_info(report: dict[str, Any]) -> str:
    """Render :func:`info` as aligned lines for humans: versions, then one row per op."""
    native = report["native"]
    if native["loaded"]:
        native_line = "loaded (commpress._C)"
    elif "No module named 'commpress._C'" in str(native["reason"]):
        native_line = "not built (pure-Python install; README 'Install' builds it)"
    else:
        native_line = f"not loaded: {native['reason']}"
    lines = [
        f"commpress  {report['commpress']} ({report['location']})",
        f"torch      {report['torch']} (CUDA build: {report['torch_cuda'] or 'no'})",
        f"native     {native_line}",
        "backends   " + ", ".join(k for k, v in report["backends"].items() if v),
        "",
        f"  {'op':<20} {'native kernels':<15} {'runs on CPU':<12} runs on CUDA",
    ]
    for op, devices in native["ops"].items():
        chosen = report["op_backends"][op]
        lines.append(f"  {op:<20} {', '.join(devices) or '-':<15} {chosen['cpu']:<12} {chosen['cuda'] or '- (CPU torch)'}")
    lines.append("")
    lines.append(
        "optional   "
        + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["optional"].items())
    )
    lines.append("codecs     " + ", ".join(report["codecs"]))
    return "\n".join(lines)
