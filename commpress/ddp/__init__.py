"""DDP communication hooks with compressed collectives.

``state = commpress.ddp.register(ddp_model, "topk", ratio=0.01)`` registers the hook and
returns its :class:`CompressionState` (statistics, checkpointing); equivalently::

    state = commpress.ddp.CompressionState(ddp_model, "topk", ratio=0.01)
    ddp_model.register_comm_hook(state, commpress.ddp.hook)

See :class:`CompressionState` for the options and :mod:`commpress.comm` for the
algorithms, their ordering guarantee and the non-finite policy. ``register(ddp_model, "auto",
optimizer=opt)`` chooses per bucket between dense, fp16 and a compressing codec from a
calibrated cost model (:mod:`commpress.ddp.auto`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import Codec
from ..errors import RankFailedError
from ..optim import DivergenceGuard
from .auto import AutoPolicy
from .hook import hook
from .planning import ParamPlan, plan_parameters
from .state import CompressionState

__all__ = ["AutoPolicy", "CompressionState", "DivergenceGuard", "ParamPlan", "RankFailedError", "hook", "plan_parameters", "register"]


def register(
    ddp_model: Any, codec: str | Codec, *, optimizer: torch.optim.Optimizer | str | None = "auto", **options: Any
) -> CompressionState:
    """Register the commpress hook on ``ddp_model`` and return its state.

    ``codec`` is a name, ``"auto"`` (:mod:`commpress.ddp.auto`) or a :class:`~commpress.codecs.Codec`; ``options`` are those of
    :class:`CompressionState` plus, when ``codec`` is a name, the codec's parameters. Your
    optimizer's momentum moves into the hook where error feedback needs it (:mod:`commpress.optim`):
    pass it (``optimizer=opt``), or leave the default ``"auto"`` and the optimizer that steps the
    model's parameters is adopted after its first step (:mod:`commpress.optim.discovery`);
    ``optimizer=None`` leaves it alone. Must be called on every rank, before the first backward pass.
    """
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"register needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    state = CompressionState(ddp_model, codec, optimizer=optimizer, **options)
    ddp_model.register_comm_hook(state, hook)
    return state
