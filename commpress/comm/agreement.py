"""Agree on one configuration across the ranks of a process group, with a time bound.

Every compressed collective assumes that all ranks run the same codec, algorithm and layout;
ranks that disagree do not fail cleanly on their own: gloo aborts the process when frame sizes
differ, and collectives issued in a different order wait until the process group's timeout.
:func:`check_same_config` therefore compares a digest of each rank's configuration once, before
any compressed traffic, and names what differs.

It goes through the process group's key-value store (the one ``init_process_group`` created),
not through a collective: a rank that never arrives (``register`` under ``if rank == 0:``)
becomes a :class:`~commpress.errors.ConfigurationError` naming the missing ranks after
``timeout_s`` on every backend, NCCL included, instead of a collective that waits forever.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigurationError
from .store import all_gather_single, group_name, store_of

#: per process group: how many agreements it has run, so that the n-th registration on one
#: rank meets the n-th on every other rank (keys are never reused within a job).
_rounds: dict[str, int] = {}


def config_digest(config: Any) -> str:
    """A short, stable digest of a JSON-serialisable configuration."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def check_same_config(
    config: dict[str, Any], *, summary: str, group: Any = None, timeout_s: float, what: str
) -> None:
    """Raise :class:`ConfigurationError` on every rank unless all ranks pass an equal ``config``.

    Every rank of ``group`` must call this within ``timeout_s`` seconds of the others.
    ``summary`` is a short human-readable form of the configuration (quoted in the error when
    ranks differ); ``what`` names the call every rank must make (``"commpress.ddp.register"``).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    digest = config_digest(config)
    store = store_of(group)
    if store is None:  # fall back to a collective (bounded by the process group's timeout)
        _check_by_collective(digest, rank, world, group, what)
        return
    name = group_name(group)
    round_ = _rounds.get(name, 0)
    _rounds[name] = round_ + 1
    keys = [f"commpress/agree/{round_}/{r}" for r in range(world)]
    store.set(keys[rank], f"{digest} {summary}")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError on timeout
        missing = _missing(store, keys)
        # the ranks that did arrive all raise: let each one read the store before any exits
        _store_barrier(store, f"commpress/agree/{round_}/late", rank, [r for r in range(world) if r not in missing], timeout_s)
        raise ConfigurationError(
            f"commpress: rank {rank} called {what}, but ranks {missing} did not within {timeout_s:g} s "
            f"(verify_timeout): call {what} on every rank of the process group, in the same order"
        ) from None
    others = [store.get(k).decode() for k in keys]
    # A rank that raises below usually exits, and rank 0 hosts the store: wait until every rank
    # has read the others' values, so none of them sees a broken connection instead of the error.
    _store_barrier(store, f"commpress/agree/{round_}/read", rank, list(range(world)), timeout_s)
    differ = {r: v.split(" ", 1)[1] for r, v in enumerate(others) if v.split(" ", 1)[0] != digest}
    if differ:
        first, theirs = next(iter(differ.items()))
        raise ConfigurationError(
            f"commpress: ranks {sorted(differ)} are configured differently from rank {rank} "
            f"(codec, algorithm, options or model parameters): rank {first} has {theirs}; "
            f"rank {rank} has {summary}. Every rank must call {what} with the same arguments"
        )


def _missing(store: Any, keys: list[str]) -> list[int]:
    """The ranks whose key is absent (all of them unknown -> every rank listed)."""
    try:
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except RuntimeError:  # the store went away with its host rank
        return list(range(len(keys)))


def _store_barrier(store: Any, prefix: str, rank: int, ranks: list[int], timeout_s: float) -> None:
    """Wait until every rank in ``ranks`` reached this point; give up quietly after ``timeout_s``."""
    try:
        store.set(f"{prefix}/{rank}", "1")
        store.wait([f"{prefix}/{r}" for r in ranks], datetime.timedelta(seconds=timeout_s))
    except RuntimeError:
        pass  # a rank that already left had read everything it needed


def _check_by_collective(digest: str, rank: int, world: int, group: Any, what: str) -> None:
    mine = torch.tensor([int(digest[:14], 16)], dtype=torch.int64)
    everyone = torch.empty(world, dtype=torch.int64)
    all_gather_single(everyone, mine, group=group)
    differ = [i for i, d in enumerate(everyone.tolist()) if d != int(mine)]
    if differ:
        raise ConfigurationError(
            f"commpress: ranks {differ} are configured differently from rank {rank} "
            f"(codec, algorithm, options or model parameters): every rank must call {what} the same way"
        )
