"""Compressed collectives on ``torch.distributed`` (nothing here knows about DDP or FSDP).

One driver (:mod:`.driver`: slot checks, accounting, timing, the non-finite / undo policy,
ordered issue, the returned future) runs one algorithm per buffer, each a short file:

================  ===============================================================  ==============
algorithm         what it does                                                      codecs
================  ===============================================================  ==============
``allreduce``     all-reduce of the (cast) buffer, or of random-k's values at       summable:
                  indices every rank draws from the shared seed                     none, fp16,
                                                                                    bf16, randomk
``allgather``     all_gather of fixed-size frames; every rank decodes all n         any (topk; sign
                  frames in rank order, accumulates and averages                    and qsgd at 2)
``twophase``      compressed all-reduce: all_to_all of pieces, average, re-encode   reencodable:
                  with server-side error feedback, all_gather                       sign, qsgd
``reducescatter`` all_to_all of the other ranks' chunks, each rank averages its own  any (FSDP:
                  (ends in a shard, :attr:`~.driver.Algorithm.shards`;              ``output=``)
                  ``reducescatter-dense``: torch's own, for ``none``)
``hierarchical``  dense reduce-scatter in the node, one of the above across nodes   those its inner
                  on the 1/L share, dense all-gather in the node (bound per state   algorithm runs
                  to the node layout, :mod:`.topology`)
================  ===============================================================  ==============

Adding an algorithm is one file with an :class:`~.driver.Algorithm` subclass (built on the
driver's frame helpers, stating its own bytes in ``wire_plan``) and one line in
:data:`ALGORITHMS`. Around them: :mod:`.faults` (a failure on one rank is every rank's error),
:mod:`.store` (the process group's store), :mod:`.stats`, :mod:`.agreement`, :mod:`.costmodel`. Seeds are never drawn from torch's global RNG: the caller gives each slot a
seed all ranks agree on, and algorithms derive per-rank/piece/phase seeds with
:func:`commpress.rng.derive_seed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import codecs
from ..codecs import Codec
from ..errors import CodecError
from ..feedback import ErrorFeedback
from .allgather import AllGather
from .allreduce import AllReduce, allreduce_mean
from .driver import Algorithm, Piece, Slot, StepContext, check_slots
from .hierarchical import Hierarchical
from .reducescatter import DenseReduceScatter, ReduceScatter
from .stats import CommStats
from .store import all_gather_single
from .twophase import TwoPhase, piece_bounds, piece_key

#: name -> algorithm; one line per algorithm.
ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (AllReduce(), AllGather(), TwoPhase(), ReduceScatter(),
                                                         DenseReduceScatter(), Hierarchical())}


def register(algorithm: Algorithm) -> Algorithm:
    """Add an algorithm under its name (a new one; see ``tests/example_extensions.py``)."""
    if not isinstance(algorithm, Algorithm) or algorithm.name in ALGORITHMS:
        raise CodecError(f"cannot register {algorithm!r}: not an Algorithm, or its name is taken")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The algorithm registered under ``name``; :class:`CodecError` if unknown."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise CodecError(f"unknown algorithm {name!r}; use 'auto' or one of {', '.join(ALGORITHMS)}") from None


#: Codec parameters whose default in the collectives (DDP hook, FSDP reduce-scatter) differs from
#: the codec's own. Random-k: unscaled, with error feedback (which then holds the momentum,
#: optimizer=): measured on the digits MLP with SGD momentum 0.9, scaled random-k 1% ended at
#: chance (8.6%; its variance is ~100x the gradient's), unscaled 94.2%. The parameter server
#: keeps the codec's scaled default (it needs it there).
COLLECTIVE_CODEC_DEFAULTS: dict[str, dict[str, Any]] = {"randomk": {"scaled": False}}


def resolve_codec(codec: str | Codec, codec_params: dict[str, Any], where: str) -> Codec:
    """The codec a collective runs: a :class:`Codec` as given, or a name plus parameters.

    A name's parameters go over :data:`COLLECTIVE_CODEC_DEFAULTS`; the codec must be fixed-size
    (every rank must know every buffer's size before the collective). ``where`` names the caller
    in errors.
    """
    if isinstance(codec, Codec):
        if codec_params:
            raise CodecError(f"unknown option(s) {sorted(codec_params)} (codec parameters go to codecs.get)")
        resolved = codec
    elif isinstance(codec, str):
        resolved = codecs.get(codec, **{**COLLECTIVE_CODEC_DEFAULTS.get(codec, {}), **codec_params})
    else:
        raise CodecError(f"codec must be a codec name or a commpress Codec, got {type(codec).__name__}")
    if not resolved.fixed_size:
        raise CodecError(
            f"{resolved!r} makes packets of data-dependent size, which {where} cannot exchange; "
            "use its fixed-size form here (the parameter server takes both)"
        )
    return resolved


def default_algorithm(codec: Codec, world_size: int = 0) -> str:
    """The algorithm a codec runs with by default, from its declared capabilities.

    Summable codecs all-reduce; reencodable ones (sign, QSGD) run the two-phase scheme, except at
    two ranks, where all-gather sends the same bytes and compresses once instead of twice
    (measured on the digits MLP, SGD momentum 0.9 in the hook: sign 94.0% two-phase, 97.5%
    all-gather, dense 97.7%); the others (top-k) all-gather.
    """
    if codec.summable:
        return "allreduce"
    if codec.reencodable and world_size != 2:
        return "twophase"
    return "allgather"


def check_algorithm(algorithm: str, codec: Codec, world_size: int = 0) -> str:
    """Resolve ``"auto"`` and reject algorithms a codec cannot run with (:class:`CodecError`)."""
    if algorithm == "auto":
        return default_algorithm(codec, world_size)
    chosen = get(algorithm)
    if chosen.shards:
        raise CodecError(f"algorithm {algorithm!r} ends in a shard (FSDP's reduce-scatter), not in every rank's average")
    chosen.check(codec)
    return algorithm


def run(
    algorithm: str | Algorithm,
    buffer: torch.Tensor,
    slots: Sequence[Slot],
    *,
    group: Any = None,
    server_feedback: ErrorFeedback | None = None,
    stats: CommStats | None = None,
    output: torch.Tensor | None = None,
    average: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """Reduce ``buffer`` (averaged, in place) with one algorithm; the future completes it.

    An algorithm that ends in a shard (:attr:`~.driver.Algorithm.shards`: ``reducescatter``)
    writes this rank's part into ``output`` instead (summed, not averaged, without ``average``).
    ``algorithm`` is a registered name or an instance (a bound ``hierarchical`` one).
    """
    chosen = algorithm if isinstance(algorithm, Algorithm) else get(algorithm)
    if chosen.shards != (output is not None):
        raise CodecError(f"algorithm {chosen.name!r} {'needs' if chosen.shards else 'takes no'} output= tensor")
    return chosen.launch(StepContext(buffer, slots, group, stats, output=output, average=average), server_feedback)


__all__ = [
    "ALGORITHMS", "COLLECTIVE_CODEC_DEFAULTS", "Algorithm", "CommStats", "Hierarchical", "Piece", "Slot", "StepContext", "all_gather_single",
    "allreduce_mean", "check_algorithm", "check_slots", "default_algorithm", "get", "piece_bounds",
    "piece_key", "register", "resolve_codec", "run",
]
