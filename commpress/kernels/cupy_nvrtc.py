"""NVRTC compile and load of the CuPy backend: ``csrc/cuda/<unit>.cu`` to kernels on a device.

* **Sources.** Each ``csrc/cuda/<unit>.cu`` is one NVRTC program (like one nvcc translation
  unit), compiled as the file nvcc compiles (:func:`module_source`). Their host code -- the C
  launchers and ``<<<...>>>`` -- is fenced off with ``#ifndef __CUDACC_RTC__``;
  ``csrc/cuda/nvrtc/`` stands in for the few system headers. The kernels are templates: every
  instantiation the launchers use is an NVRTC name expression in the table of
  ``csrc/cuda/launch_params.h`` (:func:`.cupy_header.kernel_names`), looked up by its lowered
  name.
* **Compiler options** are nvcc's defaults spelled out (``-ftz=false -prec-div=true
  -prec-sqrt=true -fmad=true``): results must not depend on the compiler. That is also why
  this module calls NVRTC itself (:func:`compile_unit`) and loads the binary with
  ``cupy.RawModule(path=...)`` instead of ``RawModule(code=...)``: CuPy appends ``-ftz=true``
  to every source it compiles, which would flush float32 subnormals to zero.
* **Loading**: one compiled unit per (unit, device), kept for the process; a
  :class:`Launcher` runs its kernels on torch's current stream. :func:`unavailable` says why
  the backend cannot run here.

Nothing here touches CUDA or CuPy before a launcher is built or :func:`unavailable` is called.
"""

from __future__ import annotations

import os
import tempfile
import threading
from functools import lru_cache
from typing import Any

import torch

from .cupy_header import CSRC, UNITS, kernel_names


def module_source(unit: str) -> tuple[str, tuple[str, ...], list[str]]:
    """``(code, options, name_expressions)`` of ``csrc/cuda/<unit>.cu`` for NVRTC.

    ``code`` is the file as nvcc compiles it. Needs no GPU (tests compile it on any machine).
    """
    names = kernel_names(unit)
    code = (CSRC / "cuda" / f"{unit}.cu").read_text(encoding="utf-8")
    options = (
        "-std=c++17",
        f"-I{CSRC / 'include'}",
        f"-I{CSRC / 'cuda'}",
        f"-I{CSRC / 'cuda' / 'nvrtc'}",
        # nvcc's defaults, so results match the nvcc build bit for bit
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        "-fmad=true",
    )
    return code, options, names


def compile_unit(unit: str, arch: str) -> tuple[bytes, dict[str, str]]:
    """Compile ``unit`` with NVRTC for ``arch`` (``sm_90``: cubin; ``compute_90``: PTX).

    Returns the image and the lowered (mangled) name of every name expression. Needs CuPy's
    NVRTC binding but no GPU. Raises RuntimeError with NVRTC's log when compilation fails.
    """
    from cupy.cuda import nvrtc

    code, options, names = module_source(unit)
    prog = nvrtc.createProgram(code, f"{unit}.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*options, f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile csrc/cuda/{unit}.cu:\n{log}") from exc
        image = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(image, str):
        image = image.encode()
    return bytes(image), lowered


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when CuPy, NVRTC, a CUDA device and the kernel sources are all there, else why not.

    Called only on first use (never at ``import commpress``); it asks torch and CuPy for a
    device, which loads the CUDA driver.
    """
    missing = [u for u in UNITS if not (CSRC / "cuda" / f"{u}.cu").is_file()]
    if missing:
        return (
            f"CUDA kernel sources not found under {CSRC / 'cuda'} (an installed copy without csrc/)"
        )
    try:
        import cupy
        from cupy.cuda import nvrtc
    except ImportError as exc:
        return f"cupy not importable: {exc}"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc raises various errors
        return f"NVRTC not loadable: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 - CuPy's runtime errors vary by version
        return f"CuPy cannot use the CUDA device: {exc}"
    return None


# ----- loading ------------------------------------------------------------------------------------
_lock = threading.Lock()
_images: tempfile.TemporaryDirectory[str] | None = None  # cubin files of this process


def _arch_for(device: torch.device) -> str:
    """``sm_XY`` when NVRTC can build a cubin for the device, else PTX for the newest it can."""
    from cupy.cuda import nvrtc

    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    supported = [int(a) for a in nvrtc.getSupportedArchs()]
    if cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a <= cc]
    if not older:
        raise RuntimeError(f"NVRTC {nvrtc.getVersion()} cannot compile for compute capability {cc}")
    return f"compute_{max(older)}"  # the driver JITs the PTX for the newer GPU


class _Unit:
    """One compiled source unit on one device: kernels by name expression."""

    def __init__(self, unit: str, device: torch.device) -> None:
        import cupy

        global _images
        image, self.lowered = compile_unit(unit, _arch_for(device))
        if _images is None:
            _images = tempfile.TemporaryDirectory(prefix="commpress-cupy-")
        path = os.path.join(_images.name, f"{unit}-{device.index}.bin")
        with open(path, "wb") as f:
            f.write(image)
        with cupy.cuda.Device(device.index):
            self.module = cupy.RawModule(path=path)
        self.kernels: dict[str, Any] = {}

    def kernel(self, name: str) -> Any:
        fn = self.kernels.get(name)
        if fn is None:
            fn = self.kernels[name] = self.module.get_function(self.lowered[name])
        return fn


_units: dict[tuple[str, int], _Unit] = {}


def _unit(unit: str, device: torch.device) -> _Unit:
    key = (unit, device.index if device.index is not None else torch.cuda.current_device())
    with _lock:
        if key not in _units:
            _units[key] = _Unit(unit, torch.device("cuda", key[1]))
        return _units[key]


class Launcher:
    """Launches one unit's kernels on ``device`` and torch's current stream there."""

    def __init__(self, unit: str, device: torch.device) -> None:
        import cupy

        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.unit = _unit(unit, self.device)
        self._cupy = cupy
        self._stream = cupy.cuda.ExternalStream(
            torch.cuda.current_stream(self.device).cuda_stream, index
        )

    def __call__(self, name: str, grid: int, block: int, *args: Any) -> None:
        """Launch kernel ``name`` (a name expression) on ``grid`` blocks of ``block`` threads."""
        with self._cupy.cuda.Device(self.device.index), self._stream:
            self.unit.kernel(name)((grid,), (block,), args)
