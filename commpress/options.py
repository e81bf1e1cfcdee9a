"""Option checks, defaults and statistics every adapter state shares (DDP, FSDP, and the next ones).

One rule each, with the message a user sees for a bad value: the error-feedback default, typed
options, the seed, the registration timeout, the initialised process group, the per-step
ratios of ``stats()`` and the checkpoint's "same as this state" checks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .codecs import Codec, NoneCodec
from .errors import CodecError

logger = logging.getLogger("commpress")


def error_feedback_default(error_feedback: bool | None, codec: Codec) -> bool | None:
    """``None`` -> on for the biased, contractive codecs (topk, sign, unscaled randomk), off for the unbiased ones.

    Error feedback needs a contraction: the unbiased codecs' variance exceeds ``||x||^2`` (QSGD
    at 4 bits: ~2x on Gaussian input), so the residual grows geometrically; measured,
    qsgd(bits=4) + error feedback diverged.
    """
    if error_feedback is None:
        return not codec.unbiased
    return error_feedback


def check_bools(**values: Any) -> None:
    """:class:`CodecError` naming the first option that is not a bool."""
    for name, value in values.items():
        if not isinstance(value, bool):
            raise CodecError(f"{name} must be a bool, got {value!r}")


def check_seed(seed: Any) -> int:
    """The base seed: an int in ``[0, 2**64)``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise CodecError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed


def check_timeout(value: Any, name: str = "verify_timeout") -> float:
    """A positive number of seconds."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise CodecError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def require_process_group() -> None:
    """RuntimeError unless ``torch.distributed`` is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")


def warn_unbiased_feedback(error_feedback: bool, codec: Codec) -> None:
    """Log that error feedback with an unbiased (non-contractive) codec may diverge."""
    if error_feedback and codec.unbiased and not isinstance(codec, NoneCodec):
        logger.warning(
            "commpress: error feedback with the unbiased codec %r: it needs a contraction "
            "and may diverge when the codec's variance exceeds the signal", codec,
        )


def ratio_stats(s: dict[str, float], steps: int) -> dict[str, float]:
    """Add ``compression_ratio``, ``wire_ratio`` and the per-step bytes (over ``steps``, at least 1) to ``s``."""
    s["compression_ratio"] = s["dense_bytes"] / s["bytes_sent"] if s["bytes_sent"] else 1.0
    s["wire_ratio"] = s["dense_wire"] / s["bytes_wire"] if s["bytes_wire"] else 1.0
    s["bytes_sent_per_step"] = s["bytes_sent"] / max(steps, 1)
    s["dense_bytes_per_step"] = s["dense_bytes"] / max(steps, 1)
    return s


def check_saved_seed(state: Mapping[str, Any]) -> int:
    """A checkpoint's ``seed`` (ValueError unless an int in ``[0, 2**64)``)."""
    seed = state["seed"]
    if not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed


__all__ = [
    "check_bools", "check_saved_seed", "check_seed", "check_timeout", "error_feedback_default", "ratio_stats",
    "require_process_group", "warn_unbiased_feedback",
]
