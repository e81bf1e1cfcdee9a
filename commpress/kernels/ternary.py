"""Fast path of the ``ternary`` stored kind, bit for bit :mod:`commpress.spec.ternary`.

:func:`encode_stochastic` and :func:`decode` have the specification's signatures and results,
and run the dispatcher ops ``commpress::ternary_encode_sr`` / ``ternary_decode`` where the
native extension has them for the tensor's device (the C++ CPU kernels of
``csrc/cpu/ternary.cpp``: one pass over the input, AVX-512 for the rounding; the CUDA kernels
of ``csrc/cuda/ternary.cu`` in a CUDA build). Otherwise (no extension,
``COMMPRESS_DISABLE_NATIVE``, a CUDA tensor with a CPU-only build, another backend chosen by
:func:`commpress.kernels.ops.use_backend`) they run the specification's own torch code.

One difference from the specification, on both paths: NaN or Inf in ``x`` raises
:class:`~commpress.errors.NonFiniteError` (the specification takes finite input and leaves
such values undefined). tests/kernels/test_ternary_kernels.py checks both paths against the
specification.
"""

from __future__ import annotations

import torch

from ..spec import ternary as spec
from ..spec.numerics import require_finite
from . import ops


def _native(op: str, device_type: str) -> bool:
    return ops.backend_for(op, device_type) == "native"


def encode_stochastic(x: torch.Tensor, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` of ``x`` (any shape, converted to float32 like the specification), identical to :func:`commpress.spec.ternary.encode_stochastic`."""
    flat = x.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.to(torch.float32)
    if _native("ternary_encode_sr", flat.device.type):
        return ops.ternary_encode_sr(flat.contiguous(), block, seed)
    require_finite(flat)
    return spec.encode_stochastic(flat, block, seed)


def decode(scales: torch.Tensor, packed: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Float32 levels times scales for the first ``numel`` elements, identical to :func:`commpress.spec.ternary.decode`.

    The native op takes ``scales`` (float32) and ``packed`` exactly as :func:`encode_stochastic`
    made them for ``numel`` elements (else :class:`~commpress.errors.KernelArgumentError`).
    Bytes above :data:`commpress.spec.ternary.MAX_BYTE` decode to the specification's
    (meaningless but in-range) levels: check them first.
    """
    if scales.dtype == torch.float32 and _native("ternary_decode", packed.device.type):
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
        ops.ternary_decode(scales.contiguous(), packed.contiguous(), block, out)
        return out
    return spec.decode(scales, packed, block, numel)


__all__ = ["decode", "encode_stochastic"]
