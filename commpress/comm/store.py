"""What commpress reads of a process group besides its collectives: its key-value store and name.

The fault channel (:mod:`.faults`) and the configuration agreement (:mod:`.agreement`) both
talk through the store ``init_process_group`` built (it stays up when collectives do not);
this module finds it. It also holds :func:`all_gather_single`, the one collective whose name
differs between torch versions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# ``all_gather_single`` replaces the deprecated ``all_gather_into_tensor`` (same semantics).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: Any = None, async_op: bool = False) -> Any:
    """All-gather equal-size tensors into one (gloo and NCCL, any torch >= 2.1)."""
    return _all_gather_single(output, input, group=group, async_op=async_op)


def store_of(group: Any) -> Any:
    """The process group's store, or None where this torch does not expose it."""
    try:
        from torch.distributed.distributed_c10d import _get_process_group_store
        pg = group if group is not None else dist.group.WORLD
        return _get_process_group_store(pg) if pg is not None else None
    except (ImportError, KeyError, AttributeError):
        return None


def group_name(group: Any) -> str:
    """The process group's name (``"default"`` for an unnamed one), for store keys."""
    pg = group if group is not None else dist.group.WORLD
    return str(getattr(pg, "group_name", "") or "default")


def tcp_store(group: Any) -> Any:
    """The TCPStore under the process group's store, or None (other stores, older torch)."""
    store = store_of(group)
    while store is not None and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store if store is not None and all(hasattr(store, a) for a in ("clone", "host", "port")) else None


__all__ = ["all_gather_single", "group_name", "store_of", "tcp_store"]
