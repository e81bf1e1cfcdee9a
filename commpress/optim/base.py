"""The contract of an optimizer mode an adapter runs for the user (``modes=[...]`` of ``commpress.ddp.register``).

A mode sees each parameter's gradient view by name, in the same order on every rank, before it
is compressed, and closes each step; it keeps its own checkpoint form and statistics, as the
built-in modes (:mod:`.momentum`, :mod:`.guard`, ...) do. Adding a mode is one file with an
:class:`OptimizerMode` subclass; the adapter needs no change (``tests/example_extensions.py``
has a worked example).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class OptimizerMode(ABC):
    """A per-parameter gradient transform with state, run by the adapter on every step.

    ``name`` keys the mode's entry in the adapter's checkpoint and stats; two modes of one state
    must have different names.
    """

    name: str = "mode"

    @abstractmethod
    def apply(self, param: str, grad: torch.Tensor, *, compressing: bool) -> None:
        """Transform the gradient view ``grad`` of parameter ``param`` in place, before it is reduced.

        ``compressing``: this step's reduction of the bucket compresses (not a warm-up or a
        guard's dense step). Called on the hook's thread, in bucket order.
        """

    def end_step(self, step: int) -> None:  # noqa: B027 (optional)
        """After the step's last bucket (``step`` is the step that just ended)."""

    def state_dict(self) -> dict[str, Any]:
        """Plain types and tensors only (checkpoints load with ``weights_only=True``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """Restore :meth:`state_dict` output (validate it: a checkpoint can be hostile)."""

    def stats(self) -> dict[str, float]:
        """Numbers for the adapter's ``stats()``, prefixed with the mode's name by the adapter."""
        return {}


__all__ = ["OptimizerMode"]
