"""Which mode drives the user's optimizer: SGD momentum into the hook, Adam's compressed momentum, or none.

The rule every adapter shares (the adapter then builds :class:`~.sgd.SGDHandover` or
:class:`~.adam.FrozenVarianceAdam` with what it knows of its parameters), and the log line that
tells the user why.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from ..codecs import Codec
from ..errors import CodecError
from .adam import adam_unsupported, is_adam_like
from .sgd import has_momentum, is_sgd_like

logger = logging.getLogger("commpress")


def optimizer_mode(
    optimizer: torch.optim.Optimizer | None, codec: Codec, *, uses_feedback: bool, by_hand_momentum: float,
) -> Literal["unchanged", "adam", "sgd"]:
    """``"sgd"``: move SGD momentum into the hook; ``"adam"``: compressed momentum; ``"unchanged"``: neither.

    Only error feedback needs it (the optimizer otherwise sees an unbiased gradient). Raises
    :class:`CodecError` when both ``optimizer=`` (a mode that owns the momentum) and
    ``momentum=`` (``by_hand_momentum``) are given.
    """
    if not uses_feedback:
        if optimizer is not None:
            logger.info("commpress: %r has no error feedback; the optimizer runs unchanged", codec)
        return "unchanged"
    if optimizer is None:
        if not by_hand_momentum:
            logger.warning(
                "commpress: %r uses error feedback; pass optimizer=<your optimizer> to register() "
                "so that its momentum moves into the hook (DGC momentum correction). Error feedback "
                "feeding an optimizer's momentum converges worse (digits MLP, SGD momentum 0.9: "
                "sign 21.7%% accuracy, 97.5%% with optimizer=)", codec,
            )
        return "unchanged"
    if is_adam_like(optimizer):
        if by_hand_momentum and adam_unsupported(optimizer) is None:
            raise CodecError("pass either optimizer= (Adam's momentum moves into the hook) or momentum=, not both")
        return "adam"
    if not is_sgd_like(optimizer) or not has_momentum(optimizer):
        logger.info("commpress: optimizer %s has no SGD momentum to take over; it runs unchanged",
                    type(optimizer).__name__)
        return "unchanged"
    if by_hand_momentum:
        raise CodecError("pass either optimizer= (its momentum moves into the hook) or momentum=, not both")
    return "sgd"


__all__ = ["optimizer_mode"]
