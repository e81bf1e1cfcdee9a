"""Error feedback: remember what compression dropped and send it next time.

For each tensor key (a parameter name, or a named slice of one) the memory holds a residual
``e`` and a step does::

    c = g + e;  packet = codec.encode(c);  e = c - codec.decode(packet)

so nothing is lost: after T steps ``sum_t decode(packet_t) + e_T == sum_t g_t`` up to float
rounding. Residuals are kept in float32 (float64 for float64 gradients) even for half-precision
gradients, so the rounding to the wire dtype is fed back as well.

Keys are per parameter, never per DDP bucket index: DDP rebuilds its buckets after the first
step, which would silently mix residuals between parameters.

**Non-finite policy.** A gradient whose ``g + e`` holds NaN or Inf (an fp16 overflow, a loss
spike) would poison the residual forever. :meth:`ErrorFeedback.compress` then returns ``None``,
leaves the residual untouched, and counts the skip (``nonfinite_steps`` and
``nonfinite_counts[key]``) and logs a warning on the ``commpress`` logger. The caller decides
what to send for that tensor (the DDP hook propagates NaN so that ``GradScaler`` skips the step
on every rank alike).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .checks import MAX_PLAUSIBLE_ABS as MAX_PLAUSIBLE_ABS
from .checks import check_loaded_tensor
from .codecs import Codec, from_config
from .codecs.base import check_dtype
from .dtypes import accumulate_dtype
from .errors import CodecError
from .wire.packet import Packet

logger = logging.getLogger("commpress")


def check_codec_config(config: Any) -> dict[str, Any]:
    """A checkpoint's codec entry as a dict, or a ValueError saying what it is instead."""
    if not isinstance(config, Mapping):
        raise ValueError(f"codec must be a codec's config() mapping, got {type(config).__name__} {config!r:.80}")
    return dict(config)


def check_state_header(state: Any, *, required: set[str], fmt: int, codec: Codec, what: str) -> None:
    """What every commpress state loader checks first (error feedback, the DDP and FSDP states).

    A mapping holding ``required`` (plus ``format`` and ``codec``), written in format ``fmt``, by
    the same ``codec``: ValueError (:class:`CodecError` for another codec) naming what differs.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping, got {type(state).__name__}")
    missing = ({"format", "codec"} | required) - set(state)
    if missing:
        raise ValueError(f"{what} is missing {sorted(missing)}")
    if state["format"] != fmt:
        raise ValueError(f"state format {state['format']!r} is not supported (expected {fmt})")
    try:
        saved = from_config(check_codec_config(state["codec"]))
    except (TypeError, OverflowError, AttributeError) as exc:  # a name or parameter of the wrong type
        raise CodecError(f"{what}: malformed codec config {state['codec']!r:.80} ({exc})") from None
    if saved != codec:
        raise CodecError(f"codec mismatch: checkpoint has {saved!r}, this state uses {codec!r}")


STATE_FORMAT = 1


#: Dtype residuals are kept in: float64 for float64 gradients, float32 otherwise.
residual_dtype = accumulate_dtype


class ErrorFeedback:
    """Per-key residual memory wrapped around one codec.

    Args:
        codec: the codec that compresses every key.
        shapes: optional declaration of every key's shape; when given, unknown keys and shape
            changes are rejected and :meth:`load_state_dict` checks checkpoints against it.

    Example::

        ef = ErrorFeedback(codecs.get("topk", ratio=0.01))
        packet = ef.compress("layer1.weight", grad, seed=step)
        if packet is None:  # non-finite gradient: nothing was encoded, memory untouched
            ...
    """

    def __init__(self, codec: Codec, shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        if not isinstance(codec, Codec):
            raise CodecError(f"codec must be a commpress Codec, got {type(codec).__name__}")
        self.codec = codec
        self.shapes = None if shapes is None else {k: torch.Size(v) for k, v in shapes.items()}
        self._residuals: dict[str, torch.Tensor] = {}
        # Buffers reused from step to step (see save()): a fused codec's saved copy, or a
        # non-fused codec's free buffer for the next residual.
        self._spare: dict[str, torch.Tensor] = {}
        self._kept: dict[str, torch.Tensor] = {}  # non-fused codecs: the saved residual itself
        self._saved: dict[str, bool] = {}  # key -> whether it had a residual when saved
        self._sent: dict[str, Packet] = {}  # sparse codecs: the last packet per key (its indices)
        self.nonfinite_steps = 0
        self.nonfinite_counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._residuals)

    def keys(self) -> Iterator[str]:
        """Keys that currently hold a residual."""
        return iter(self._residuals)

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual stored for ``key`` (None before its first step).

        This is the live buffer: later steps update it in place or reuse it; clone it to keep
        a snapshot.
        """
        return self._residuals.get(key)

    def set_residual(self, key: str, value: torch.Tensor | None) -> None:
        """Replace the residual of ``key`` (None forgets it); used to undo a voided step."""
        if value is None:
            self._residuals.pop(key, None)
            return
        if value.dtype not in (torch.float32, torch.float64):
            raise CodecError(f"residual for {key!r} must be float32 or float64, got {value.dtype}")
        if self.shapes is not None and value.shape != self.shapes.get(key):
            raise CodecError(f"residual for {key!r} has shape {tuple(value.shape)}, declared {self.shapes.get(key)}")
        self._residuals[key] = value

    def save(self, key: str) -> None:
        """Keep ``key``'s residual as it is now, so that :meth:`rollback` can restore it.

        For callers that learn only after encoding that a step is void (another rank's NaN).
        Fused codecs (sign, qsgd) update the residual in place, so it is copied into a buffer
        kept for the key and reused every step: no allocation and no page faults (``clone()``
        of every residual cost 33 ms per step at 17M parameters in the e2e benchmark). The
        others replace the residual with
        a new tensor, so the old one is simply kept until the next save, and its buffer then
        holds the following residual.
        """
        old = self._residuals.get(key)
        self._saved[key] = old is not None
        if not self.codec.has_fused_feedback:
            previous = self._kept.pop(key, None)  # its step went through: the buffer is free
            if previous is not None and previous is not old:
                self._spare[key] = previous
            if old is not None:
                self._kept[key] = old
            return
        if old is None:
            return
        spare = self._spare.get(key)
        if spare is None or spare.shape != old.shape or spare.dtype != old.dtype or spare.device != old.device:
            spare = self._spare[key] = torch.empty_like(old)
        spare.copy_(old)

    def rollback(self, key: str) -> None:
        """Restore the residual :meth:`save` kept (swapping buffers, no copy); once per save."""
        if key not in self._saved:
            raise CodecError(f"rollback({key!r}) without a save({key!r}) before it")
        had = self._saved.pop(key)
        self._sent.pop(key, None)
        current = self._residuals.pop(key, None)
        if not self.codec.has_fused_feedback:
            kept = self._kept.pop(key, None)
            if had and kept is not None:
                self._residuals[key] = kept
            if current is not None and current is not kept:
                self._spare[key] = current
            return
        if had:
            self._residuals[key] = self._spare.pop(key)
            if current is not None:
                self._spare[key] = current  # becomes the next save's buffer

    def reset(self, key: str | None = None) -> None:
        """Forget the residual of ``key``, or of every key when ``key`` is None."""
        if key is None:
            self._residuals.clear()
            self._spare.clear()
            self._kept.clear()
            self._saved.clear()
            self._sent.clear()
        else:
            for memory in (self._residuals, self._spare, self._kept, self._saved, self._sent):
                memory.pop(key, None)

    def _check_key(self, key: str, grad: torch.Tensor) -> None:
        if not isinstance(key, str):
            raise CodecError(f"key must be a str, got {type(key).__name__}")
        if not isinstance(grad, torch.Tensor):
            raise CodecError(f"grad for {key!r} must be a torch.Tensor, got {type(grad).__name__}")
        check_dtype(grad.dtype)
        if self.shapes is not None:
            if key not in self.shapes:
                raise CodecError(f"key {key!r} was not declared in shapes")
            if grad.shape != self.shapes[key]:
                raise CodecError(f"grad for {key!r} has shape {tuple(grad.shape)}, declared {tuple(self.shapes[key])}")
        old = self._residuals.get(key)
        if old is not None and (old.shape != grad.shape or old.device != grad.device):
            raise CodecError(
                f"grad for {key!r} is {tuple(grad.shape)} on {grad.device}, its residual is "
                f"{tuple(old.shape)} on {old.device}; call reset({key!r}) if the parameter changed"
            )

    def compress(self, key: str, grad: torch.Tensor, *, seed: int = 0) -> Packet | None:
        """Encode ``grad + residual`` for ``key`` and keep the new residual.

        Returns the packet, or None (memory untouched, skip counted) when ``grad + residual``
        is not finite in the gradient's dtype.
        """
        self._check_key(key, grad)
        # c = g + e, encode, e = c - decode(packet): one fused kernel for sign / qsgd (the
        # residual is then updated in place), encode + decode + subtract for the others, into
        # a recycled buffer when there is one.
        old = self._residuals.get(key)
        out = None if self.codec.has_fused_feedback else self._spare.pop(key, None)
        if out is not None and (
            out.shape != grad.shape or out.dtype != residual_dtype(grad.dtype) or out.device != grad.device
        ):
            out = None
        result = self.codec.encode_with_feedback(grad, old, seed=seed, out=out)
        if not self.codec.has_fused_feedback and result is not None and old is not None:
            if self._kept.get(key) is not old:
                self._spare[key] = old  # nobody needs the old residual: recycle its buffer
        elif out is not None and result is None:
            self._spare[key] = out
        self._sent.pop(key, None)
        if result is None:  # g + e is not finite in grad's dtype: residual untouched
            self.nonfinite_steps += 1
            self.nonfinite_counts[key] = self.nonfinite_counts.get(key, 0) + 1
            logger.warning("commpress: non-finite gradient for %r; residual kept, step skipped", key)
            return None
        packet, self._residuals[key] = result
        if self.codec.sparse:
            self._sent[key] = packet
        return packet

    def take_sent(self, key: str) -> torch.Tensor | None:
        """Indices (int64) that the last :meth:`compress` of ``key`` sent, once; None if it sent none.

        Sparse codecs only. DGC's momentum masking zeroes the velocity there, touching k
        entries instead of scanning the residual for zeros (~17 ms per 8M elements).
        """
        packet = self._sent.pop(key, None)
        return None if packet is None else self.codec.sent_indices(packet)

    # ----- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals, codec config and skip counts; plain types, loadable with weights_only=True."""
        return {
            "format": STATE_FORMAT,
            "codec": self.codec.config(),
            "residuals": {k: v.detach().clone() for k, v in self._residuals.items()},
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_counts": dict(self.nonfinite_counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output after validating all of it (all or nothing)."""
        check_state_header(state, required={"residuals", "nonfinite_steps", "nonfinite_counts"},
                           fmt=STATE_FORMAT, codec=self.codec, what="error-feedback state")
        residuals = state["residuals"]
        if not isinstance(residuals, Mapping):
            raise ValueError("state['residuals'] must be a mapping of key -> tensor")
        for key, value in residuals.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise ValueError(f"residual {key!r} must be a tensor under a str key")
            check_loaded_tensor(value, f"residual {key!r}")
            if self.shapes is not None:
                if key not in self.shapes:
                    raise ValueError(f"residual {key!r} is not a declared key")
                if value.shape != self.shapes[key]:
                    raise ValueError(
                        f"residual {key!r} has shape {tuple(value.shape)}, declared {tuple(self.shapes[key])}"
                    )
        steps, counts = state["nonfinite_steps"], state["nonfinite_counts"]
        if not isinstance(counts, Mapping) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in (steps, *counts.values())
        ) or not all(isinstance(k, str) for k in counts):
            raise ValueError(
                f"nonfinite_steps must be an int in [0, 2**62) and nonfinite_counts a str -> such int mapping, "
                f"got {steps!r:.40} / {counts!r:.80}"
            )
        self._residuals = {k: v.detach().clone() for k, v in residuals.items()}
        self.nonfinite_steps = steps
        self.nonfinite_counts = dict(counts)
