"""Fault injection for tests and drills (testing only; never enabled unless asked for).

A fault is given as ``kind:worker=W[,step=T][,seconds=S]`` (CLI ``--fault``, repeatable) and
acts in worker ``W`` just before it pushes step ``T`` (every step when ``step`` is omitted):

===========  ==========================================================================
kind         what the worker does
===========  ==========================================================================
corrupt      sends a copy of its push to shard 0 with one payload byte flipped (CRC fails)
truncate     sends its push cut short, with header length and CRC made consistent
wrongshard   sends its push for shard 0 to the server of the last shard
spoof        sends its push with another worker's index in the header
badwire      sends its push with a broken commpress packet inside (CRC made consistent)
garbage      sends 64 random bytes
oversize     sends a message longer than any valid one
hang         stops answering for ``seconds`` (default: forever), then carries on
slow         sleeps ``seconds`` every step (a straggler)
vanish       leaves its training loop without a goodbye and idles
die          raises an exception (the process dies)
sigterm      sends itself SIGTERM (a preemption: :mod:`commpress.ps.preempt`), then carries on
===========  ==========================================================================

The message faults are sent *in addition to* the honest push, so a correct server rejects
them and trains exactly as if they had never been sent.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs import parse_params
from ..errors import CodecError
from .errors import ConfigError, PSError
from .protocol import HEADER, HEADER_NBYTES

KINDS = ("corrupt", "truncate", "wrongshard", "spoof", "badwire", "garbage", "oversize",
         "hang", "slow", "vanish", "die", "sigterm")
MESSAGE_KINDS = frozenset({"corrupt", "truncate", "wrongshard", "spoof", "badwire", "garbage", "oversize"})


class FaultInjected(PSError):
    """Raised by the ``die`` fault."""


class Vanish(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the ``vanish`` fault: the worker leaves its loop without a goodbye."""


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring)."""

    kind: str
    worker: int
    step: int | None = None
    seconds: float = float("inf")

    def applies(self, worker: int, step: int) -> bool:
        """Whether this fault fires in ``worker`` before pushing ``step``."""
        return worker == self.worker and (self.step is None or step == self.step)


def parse_fault(spec: str) -> Fault:
    """Parse ``kind:worker=W[,step=T][,seconds=S]`` (options read by :func:`commpress.codecs.parse_params`)."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"fault {spec!r}: kind must be one of {', '.join(KINDS)}")
    try:
        fields = parse_params(rest, f"fault {spec!r}")
    except CodecError as exc:
        raise ConfigError(str(exc)) from None
    for key in fields:
        if key not in ("worker", "step", "seconds"):
            raise ConfigError(f"fault {spec!r}: expected worker=, step= or seconds=, got {key}=")
    if "worker" not in fields:
        raise ConfigError(f"fault {spec!r}: worker= is required")
    for key in ("worker", "step"):
        val = fields.get(key, 0)
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ConfigError(f"fault {spec!r}: {key} must be an int >= 0, got {val!r}")
    seconds = fields.get("seconds", float("inf"))
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        raise ConfigError(f"fault {spec!r}: seconds must be a number >= 0, got {seconds!r}")
    return Fault(kind, fields["worker"], fields.get("step"), float(seconds))


def _reheader(msg: np.ndarray, **changes: int) -> np.ndarray:
    """Copy of ``msg`` with header fields changed and nbytes/CRC recomputed (a careful liar)."""
    out = msg.copy()
    fields = list(HEADER.unpack_from(out[:HEADER_NBYTES].tobytes()))
    names = ["magic", "version", "type", "flags", "shard", "worker", "step", "nbytes", "crc32", "reserved", "value"]
    for key, val in changes.items():
        fields[names.index(key)] = val
    fields[7] = len(out) - HEADER_NBYTES
    fields[8] = zlib.crc32(out[HEADER_NBYTES:].data)
    out[:HEADER_NBYTES] = np.frombuffer(HEADER.pack(*fields), dtype=np.uint8)
    return out


def before_push(
    fault: Fault,
    step: int,
    pushes: Sequence[tuple[int, torch.Tensor]],
    send: Callable[[int, np.ndarray], None],
) -> None:
    """Act out ``fault`` before the honest ``pushes`` ((server rank, message) per shard) go out."""
    first_rank, first = pushes[0][0], pushes[0][1].cpu().numpy()
    last_rank = pushes[-1][0]
    kind = fault.kind
    if kind == "corrupt":
        bad = first.copy()
        bad[HEADER_NBYTES + (len(bad) - HEADER_NBYTES) // 2] ^= 0x5A
        send(first_rank, bad)
    elif kind == "truncate":
        send(first_rank, _reheader(first[: HEADER_NBYTES + (len(first) - HEADER_NBYTES) // 2]))
    elif kind == "wrongshard":
        send(last_rank, first.copy())
    elif kind == "spoof":
        send(first_rank, _reheader(first, worker=fault.worker + 1))
    elif kind == "badwire":
        bad = first.copy()
        bad[HEADER_NBYTES : HEADER_NBYTES + 4] = np.frombuffer(b"XXXX", dtype=np.uint8)  # packet magic
        send(first_rank, _reheader(bad))
    elif kind == "garbage":
        send(first_rank, np.random.default_rng(step).integers(0, 256, 64, dtype=np.uint8))
    elif kind == "oversize":
        send(first_rank, np.zeros(len(first) * 2 + 4096, dtype=np.uint8))
    elif kind in ("hang", "slow"):
        time.sleep(min(fault.seconds, 1e7) if kind == "hang" else (0.0 if fault.seconds == float("inf") else fault.seconds))
    elif kind == "vanish":
        raise Vanish()
    elif kind == "die":
        raise FaultInjected(f"fault injected: worker {fault.worker} dies at step {step}")
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
