"""The kernel backends the kernel tests run on, and the ``backend`` fixture's value.

Backends: ``cpu:<isa>`` (the native CPU kernels, once per instruction-set variant this CPU
runs), ``numba`` (commpress.kernels.numba_cpu), ``cuda`` (the native CUDA kernels) and
``cupy`` (commpress.kernels.cupy_cuda). A backend that cannot run here is a skipped param
whose reason says why. The fixture (in conftest.py) yields a :class:`Backend`: the device
string, so ``tensor.to(backend)`` works, carrying the ops with the native schemas' arguments
(:data:`commpress.kernels.ops.checked`: the one argument check, then the backend under test,
as every caller gets them). ``.native`` tells whether it is the extension.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from commpress.kernels import backends, ops

NATIVE_REASON = ops.load_native()


class Backend(str):
    """A backend under test: its device string, with ``.name`` and ``.ops``."""

    name: str
    ops: Any
    native: bool

    @classmethod
    def make(cls, device: str, name: str, kernels: Any, native: bool) -> Backend:
        b = cls(device)
        b.name, b.ops, b.native = name, kernels, native
        return b


def _skip(name: str, reason: str | None) -> Any:
    return pytest.param(name, marks=[pytest.mark.skip(reason=reason)] if reason else [])


def cuda_reason(op: str) -> str | None:
    """Why the native CUDA ``op`` cannot run here (no extension, no device, a CPU-only build), or None."""
    if NATIVE_REASON is not None:
        return f"commpress._C not available: {NATIVE_REASON}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not ops.has_native(op, "cuda"):
        return f"commpress._C was built without the CUDA {op}"
    return None


def params(all_isas: bool, op: str = "sign_encode", python: bool = True) -> list[Any]:
    """Params for ``@pytest.mark.parametrize("backend", ..., indirect=True)``.

    ``all_isas``: every native CPU variant (for the loops that differ between them), else the
    one the CPU picks. ``python``: include numba and CuPy (False for torch.library-only tests).
    """
    out: list[Any] = []
    if NATIVE_REASON is not None:
        out.append(_skip("cpu", f"commpress._C not available: {NATIVE_REASON}"))
    elif not ops.has_native(op, "cpu"):
        out.append(_skip("cpu", f"commpress._C was built without the CPU {op}"))
    else:
        out += [f"cpu:{isa}" for isa in (ops.cpu_isas() if all_isas else [ops.cpu_isa()])]
    if python:
        out.append(_skip("numba", backends.unavailable("numba")))
    out.append(_skip("cuda", cuda_reason(op)))
    if python:
        out.append(_skip("cupy", backends.unavailable("cupy")))
    return out


def activate(name: str) -> Iterator[Backend]:
    """Select backend ``name`` for the duration of a test (generator for the fixture)."""
    if name.startswith("cpu:"):
        before = ops.cpu_isa()
        ops.cpu_isa(name.split(":")[1])
        try:
            yield Backend.make("cpu", name, ops.checked, True)
        finally:
            ops.cpu_isa(before or "")
    elif name in ("cpu", "cuda"):
        yield Backend.make(name, name, ops.checked, True)
    else:
        device = backends.PYTHON_BACKENDS[name][1]
        with ops.use_backend(name):  # the codecs' wrappers run on it too
            yield Backend.make(device, name, ops.checked, False)


@contextlib.contextmanager
def cpu_isa(name: str) -> Iterator[None]:
    """Within the block the native CPU kernels run their ``name`` variant ("default", "avx2", "avx512")."""
    before = ops.cpu_isa()
    ops.cpu_isa(name)
    try:
        yield
    finally:
        ops.cpu_isa(before)

