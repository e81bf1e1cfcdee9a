"""Plausibility of loaded state: the bound on stored magnitudes and the one check of a loaded tensor.

Every checkpoint loader (error feedback, the DDP and FSDP states, :mod:`commpress.checkpoint` and
through it the parameter server) refuses a tensor that a model in training cannot hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MAX_PLAUSIBLE_ABS", "check_loaded_tensor"]

#: The largest magnitude a checkpointed residual, velocity or parameter may hold: gradients,
#: residuals and moments of a model that trains stay far below it; a value beyond it is corruption
#: (checked by every checkpoint loader: error feedback, the DDP and FSDP states, the parameter server).
MAX_PLAUSIBLE_ABS = 1e15


def _names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return " or ".join(", ".join(names).rsplit(", ", 1))


def check_loaded_tensor(
    t: Any,
    what: str,
    *,
    numel: int | None = None,
    dtypes: Sequence[torch.dtype] | None = (torch.float32, torch.float64),
    finite: bool = True,
    max_abs: float | None = MAX_PLAUSIBLE_ABS,
    error: type[ValueError] = ValueError,
) -> None:
    """Raise ``error`` (a ValueError) naming ``what`` unless ``t`` is a plausible loaded tensor.

    In order: a tensor; with ``numel``, that many elements; with ``dtypes``, one of them; with
    ``finite``, no NaN or Inf; with ``max_abs``, no magnitude above it. ``what`` names the entry
    (``"residual 'w'"``). Reads only.
    """
    if not isinstance(t, torch.Tensor):
        raise error(f"{what} must be a tensor, got {type(t).__name__}")
    if numel is not None and t.numel() != numel:
        raise error(f"{what} has {t.numel()} elements, expected {numel}")
    if dtypes is not None and t.dtype not in dtypes:
        raise error(f"{what} has dtype {t.dtype}, expected {_names(dtypes)}")
    if not t.numel():
        return
    if finite and not bool(torch.isfinite(t).all()):
        raise error(f"{what} contains NaN or Inf")
    if max_abs is not None:
        top = float(t.abs().max())
        if top > max_abs:
            raise error(f"{what} holds {top:.3g}, beyond the plausible magnitude {max_abs:g} (a corrupt checkpoint?)")
