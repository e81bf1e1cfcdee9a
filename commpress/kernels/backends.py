"""Kernel backends besides the native extension: numba on the CPU, CuPy on CUDA devices.

:mod:`commpress.kernels.ops` runs each op on the first backend that has it for the tensor's device:
``native`` (the ``commpress._C`` extension), then the Python backend of that device
(``numba`` for CPU tensors, ``cupy`` for CUDA tensors), then ``reference`` (the pure-torch
specification, :mod:`.reference` over :mod:`commpress.spec`). Every backend module here exports the ops with the
native schemas' arguments, already validated by :mod:`.checks` (ops.py checks once, before any
backend), and is imported only when first used, so a missing numba or CuPy never breaks
``import commpress``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import schema

#: Every commpress kernel op (the schemas of ``csrc/registration.cpp``, stated in
#: :mod:`.schema`); each Python backend lists the ones it implements in its ``OPS``.
OP_NAMES = schema.OP_NAMES

#: backend name -> (module, device type it serves)
PYTHON_BACKENDS = {
    "numba": ("commpress.kernels.numba_cpu", "cpu"),
    "cupy": ("commpress.kernels.cupy_cuda", "cuda"),
}


def module(name: str) -> ModuleType:
    """The module of a Python backend (``numba`` or ``cupy``)."""
    return importlib.import_module(PYTHON_BACKENDS[name][0])


def unavailable(name: str) -> str | None:
    """None when the Python backend ``name`` can run here, else the reason it cannot."""
    if name not in PYTHON_BACKENDS:
        return f"unknown backend {name!r}"
    try:
        mod = module(name)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    reason: str | None = mod.unavailable()
    return reason


def supports(name: str, op: str, device_type: str) -> bool:
    """True when the Python backend ``name`` runs ``op`` on ``device_type`` tensors here."""
    if name not in PYTHON_BACKENDS or PYTHON_BACKENDS[name][1] != device_type:
        return False
    return unavailable(name) is None and op in module(name).OPS
