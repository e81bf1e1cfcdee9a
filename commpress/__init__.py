"""commpress: gradient compression for PyTorch distributed training.

Codecs (:mod:`commpress.codecs`) turn a gradient into a few bytes and back, the wire format
(:mod:`commpress.wire`) carries them safely, and error feedback (:mod:`commpress.feedback`)
keeps what compression dropped for the next step. Importing the package never needs the
native extension and never initialises CUDA; :func:`info` says which backends are present.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import codecs, feedback, wire
from ._version import __version__ as __version__
from .errors import CodecError, WireError
from .feedback import ErrorFeedback
from .info import info
from .preemption import (
    PreemptionHandler,
    init_restartable_process_group,
    install_preemption_handler,
)
from .wire.packet import Packet

__all__ = [
    "CodecError", "ErrorFeedback", "Packet", "PreemptionHandler", "WireError", "codecs", "comm", "ddp", "feedback", "fsdp", "integrations",
    "info", "init_restartable_process_group", "install_preemption_handler", "ps", "wire",
]

# Loaded on first use: they import torch.distributed (and mpi4py for ps), which plain codec
# users do not need.
_LAZY = ("comm", "ddp", "fsdp", "integrations", "ps")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
