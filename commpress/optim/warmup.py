"""Warm-up: the first steps reduced dense or through an unbiased codec before compression starts.

DGC and 1-bit Adam start with uncompressed steps: gradients change fastest early, Adam's variance
must settle before it freezes, and a value-blind codec's residual sends each element ~1/ratio
steps late. :class:`Warmup` is that schedule for any adapter: how many steps, and how they are
reduced (``codec``: an unbiased codec or a cast, None for a dense all-reduce).

Measured, for the defaults: value-blind codecs with error feedback need the steps (digits MLP,
``SGD(lr=0.1, momentum=0.9)``, random-k 1%, seeds 0-3: 89.4 / 96.2 / 92.2 / 94.5% without,
97.2 / 96.7 / 97.0 / 97.5% with 50 dense steps; dense 97.7%); Adam/AdamW needs them before its
variance freezes (0 is raised to 50 there). 8-bit QSGD instead of dense warm-up steps
(``docs/benchmarks.md``): with AdamW on the 10.8M-parameter byte LM it took top-k 1% from +1.71%
to +0.94% of dense's held-out loss and sign from +1.08% to +0.61%; on the digits MLP, AdamW: sign
94.0% vs 94.5%, top-k 95.0% vs 95.2% (dense 96.0%); SGD momentum, random-k 1% seeds 0-3: 97.0 /
97.0 / 97.0 / 97.5% vs 97.2 / 96.7 / 97.0 / 97.5% (dense 97.7%). 4-bit QSGD helped the LM more
(top-k -0.24%, sign -0.85%) but cost sign 4.6 points on digits.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import codecs, comm
from ..codecs import Codec
from ..errors import CodecError

logger = logging.getLogger("commpress")

#: Dense steps before compression starts where it needs a warm-up (Adam's variance freezing,
#: value-blind codecs) and the user sets no ``warmup_steps``.
DEFAULT_WARMUP_STEPS = 50

#: How warm-up steps are reduced when the user names no ``warmup_codec``: unbiased (nothing to
#: keep in residuals across the switch), 4x fewer bytes than the all-reduce, and measured no worse
#: than dense warm-up steps (see ``CompressionState``'s ``warmup_codec``).
DEFAULT_WARMUP_CODEC = "qsgd:bits=8"


def resolve_warmup_codec(choice: str | Codec | None, where: str) -> Codec | None:
    """Resolve and check a ``warmup_codec`` (None: the default; ``"dense"``: the all-reduce, None here)."""
    if choice is None:
        choice = DEFAULT_WARMUP_CODEC
    if choice == "dense":
        return None
    if isinstance(choice, str) and ":" in choice:  # "qsgd:bits=8"
        choice = codecs.from_spec(choice)
    codec = comm.resolve_codec(choice, {}, where)
    if not (codec.unbiased or codec.cast_dtype is not None):
        raise CodecError(f"warmup_codec must be unbiased or a cast (the warm-up keeps no residuals), got {codec!r}")
    return codec


class Warmup:
    """The warm-up schedule: ``steps`` steps reduced by ``codec`` (None: dense) before compressing.

    ``steps=None`` takes :data:`DEFAULT_WARMUP_STEPS` where ``needed`` (a value-blind codec with
    error feedback), else 0; an optimizer mode may raise it later (:meth:`at_least`).
    """

    __slots__ = ("steps", "codec")

    def __init__(self, steps: int | None, codec: str | Codec | None, *, needed: bool, compressor: Codec,
                 where: str) -> None:
        self.codec = resolve_warmup_codec(codec, where)
        if steps is None:
            steps = DEFAULT_WARMUP_STEPS if needed else 0
            if steps:
                logger.info("commpress: %d dense warm-up steps before %r compresses (warmup_steps=0 turns them off)",
                            steps, compressor)
        elif not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise CodecError(f"warmup_steps must be an int >= 0 or None, got {steps!r}")
        self.steps: int = steps

    def active(self, step: int) -> bool:
        """True while ``step`` is a warm-up step."""
        return step < self.steps

    def codec_now(self, step: int) -> Codec | None:
        """The codec of warm-up step ``step``, or None for a dense all-reduce (also after warm-up)."""
        return self.codec if step < self.steps else None

    def config(self) -> dict[str, Any]:
        """What all ranks must agree on (plain types)."""
        return {"warmup_steps": self.steps, "warmup_codec": None if self.codec is None else self.codec.config()}


__all__ = ["DEFAULT_WARMUP_CODEC", "DEFAULT_WARMUP_STEPS", "Warmup", "resolve_warmup_codec"]
