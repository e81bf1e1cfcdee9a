"""What this installation can do: which backends and optional libraries are present."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .codecs import available
from .kernels import ops


def _has_module(name: str) -> bool:
    # find_spec only looks for the package; it neither imports it nor initialises a GPU.
    return importlib.util.find_spec(name) is not None


def _cuda_sources_present() -> bool:
    # the CuPy backend compiles csrc/cuda at run time (commpress/kernels/cupy_cuda.py)
    from .kernels.cupy_cuda import CSRC, UNITS

    return all((CSRC / "cuda" / f"{unit}.cu").is_file() for unit in UNITS)


def info() -> dict[str, Any]:
    """Report versions, native kernels per device, optional libraries and codecs.

    Never initialises CUDA: kernel availability is read from torch's dispatcher registry.
    """
    from . import __version__

    reason = ops.load_native()
    return {
        "commpress": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "native": {"loaded": reason is None, "reason": reason, "ops": ops.native_ops()},
        "backends": {
            "reference": True,
            "cpu": any("cpu" in d for d in ops.native_ops().values()),
            "cuda": any("cuda" in d for d in ops.native_ops().values()),
            # installed, not probed: whether a GPU is usable is asked only when an op runs
            "numba (cpu)": _has_module("numba"),
            "cupy (cuda)": _has_module("cupy") and _cuda_sources_present(),
        },
        "optional": {name: _has_module(name) for name in ("numba", "cupy", "mpi4py", "tqdm")},
        "codecs": available(),
    }


def format_info(report: dict[str, Any]) -> str:
    """Render :func:`info` as aligned ``key: value`` lines for humans."""
    native = report["native"]
    lines = [
        f"commpress  {report['commpress']}",
        f"torch      {report['torch']} (CUDA build: {report['torch_cuda'] or 'no'})",
        f"native     {'loaded' if native['loaded'] else 'not loaded: ' + str(native['reason'])}",
    ]
    for op, devices in native["ops"].items():
        lines.append(f"  {op:<14} {', '.join(devices) or '-'}")
    lines.append("backends   " + ", ".join(k for k, v in report["backends"].items() if v))
    lines.append(
        "optional   "
        + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["optional"].items())
    )
    lines.append("codecs     " + ", ".join(report["codecs"]))
    return "\n".join(lines)
