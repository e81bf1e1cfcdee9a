"""``codec="auto"``'s compressing candidate when ``auto_codec`` is not given, and why.

The default candidate (:func:`default_candidate`) is the codec sending the fewest bytes among
those that are safe with what the hook knows of the optimizer:

- where the hook owns the momentum (``optimizer=`` an SGD-like optimizer, whose momentum moves
  into the hook, or a supported Adam/AdamW, whose momentum is compressed with the variance frozen
  after warm-up; or ``momentum=``), **top-k 1%** or **1-bit sign**, whichever sends fewer bytes
  per element at this world size (:func:`wire_bytes_per_element`: top-k at 2-3 ranks, where its
  all-gather sends 0.08-0.16 bytes per element against sign's 0.13-0.17; sign from 4 ranks,
  where top-k's all-gather grows with the ranks: 0.24 against 0.19). QSGD, the candidate
  before, sends 4x more than sign and its 1 Gbit/s step was 1.2-1.4x the best fixed codec's
  (17M MLP, ``docs/benchmarks.md``); at their defaults with the optimizer passed, top-k and
  sign kept dense quality on the convergence issue's workloads at 2 ranks (byte LM +1.3% /
  +1.0% held-out loss, digits 97.0% / 97.5% vs 97.7%).
- otherwise **QSGD 4-bit**: without the optimizer the hook cannot move its momentum, and error
  feedback feeding a user's momentum is what makes sign diverge (digits: 21.7%); QSGD is
  unbiased and keeps no residuals, so it is safe under any optimizer.

- on **several nodes** (the hierarchical path: dense inside the node, the candidate across
  nodes on each rank's 1/L share) **QSGD 4-bit** whatever the optimizer: the hierarchy already
  divides the cross-node bytes by L, and a biased codec there selects from the node's sum, so
  top-k at 2 nodes sends half the coordinates per step of flat top-k at 4 ranks. Measured on the
  emulated 2 x 2 cluster at 1 Gbit/s (``docs/ddp.md``, 2026-12-06): hierarchical top-k reached
  neither workload's loss target (+25.9% on wide-digits with SGD momentum, +3.49% on the byte LM
  with AdamW) while hierarchical QSGD reached both (-2.42%, -3.03%: first on the LM), at a
  step no slower than top-k's on the LM. QSGD also keeps no error-feedback residuals.

Codec parameters given without ``auto_codec`` keep QSGD as the candidate (they are QSGD's).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import codecs, comm
from ..codecs import Codec
from ..comm.costmodel import Entry, Link, compressed_plan, wire_time
from ..optim import adam_unsupported, is_adam_like, is_sgd_like

#: The compressing candidates when ``auto_codec`` is not given and the hook owns the momentum
#: (:func:`default_candidate` takes the one sending fewer bytes), and the one when it cannot.
DEFAULT_CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (("sign", {}), ("topk", {"ratio": 0.01}))
SAFE_CANDIDATE = "qsgd"
#: The candidate across nodes on a hierarchical layout (module docstring).
HIERARCHICAL_CANDIDATE = "qsgd"


def wire_bytes_per_element(codec: Codec, world_size: int, numel: int = 1 << 20) -> float:
    """Bytes one rank puts on the wire per gradient element with ``codec``'s default algorithm."""
    n = max(world_size, 2)
    plan = compressed_plan([Entry(numel, True)], codec, comm.default_algorithm(codec, n), n)
    return wire_time(Link(0.0, 1.0), plan, n) / numel  # a link of one second per byte: seconds = bytes


def default_candidate(
    optimizer: torch.optim.Optimizer | None, momentum: float = 0.0, world_size: int = 2,
    hierarchical: bool = False,
) -> tuple[str, dict[str, Any], str]:
    """``auto``'s candidate when ``auto_codec`` is not given: name, codec parameters, and why.

    ``hierarchical``: the compressed hop is the hierarchy's, across ``world_size`` nodes:
    :data:`HIERARCHICAL_CANDIDATE`. Otherwise, where the hook will own the momentum
    (``optimizer=`` SGD-like, or an Adam/AdamW the compressed-momentum mode supports, or
    ``momentum=``) the one of :data:`DEFAULT_CANDIDATES` sending the fewest bytes at
    ``world_size`` ranks; QSGD where it cannot (module docstring).
    """
    if hierarchical:
        return HIERARCHICAL_CANDIDATE, {}, (f"several nodes: the hierarchy's share across {world_size} nodes (a biased "
                                            "codec there keeps 1/L of the flat codec's coordinates)")
    owner = None
    if momentum:
        owner = "momentum= is applied in the hook"
    elif optimizer is None:
        return SAFE_CANDIDATE, {}, ("no optimizer= given: its momentum cannot move into the hook (pass "
                                    "optimizer= to let auto use top-k or sign)")
    elif is_adam_like(optimizer):
        reason = adam_unsupported(optimizer)
        if reason is not None:
            return SAFE_CANDIDATE, {}, f"{type(optimizer).__name__} runs unchanged ({reason})"
        owner = f"{type(optimizer).__name__}'s momentum is compressed in the hook"
    elif is_sgd_like(optimizer):
        owner = f"{type(optimizer).__name__}'s momentum (if any) moves into the hook"
    else:
        return SAFE_CANDIDATE, {}, f"{type(optimizer).__name__} runs unchanged on what the hook delivers"
    sizes = [(wire_bytes_per_element(codecs.get(name, **params), world_size), name, params)
             for name, params in DEFAULT_CANDIDATES]
    nbytes, name, params = min(sizes, key=lambda t: t[0])  # ties: the first (sign)
    return name, dict(params), f"{owner}; fewest bytes at {world_size} ranks ({nbytes:.3f} per element)"


__all__ = ["DEFAULT_CANDIDATES", "HIERARCHICAL_CANDIDATE", "SAFE_CANDIDATE", "default_candidate", "wire_bytes_per_element"]
