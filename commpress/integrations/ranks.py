"""Every rank's :class:`~commpress.ddp.CompressionState` in one checkpoint, without pickle.

Error-feedback residuals and hook velocities differ per rank, but Lightning (like most
trainers) writes one checkpoint from global rank 0. :func:`gather_states` moves each rank's
``state_dict()`` to rank 0 as bytes, one peer at a time (so rank 0's device never holds more
than two ranks' states), and :func:`own_state` picks a rank's entry back out on load (rank 0's
at another world size: the state's loader keeps what is global and drops the per-rank rest).

Byte form of one state (:func:`encode` / :func:`decode`), native byte order::

    offset  size  field
    0       8     header length H (int64)
    8       H     UTF-8 JSON: {"tree": ..., "tensors": [[dtype, shape, nbytes], ...]}
    8+H     ...   the tensors' raw bytes, in the header's order

``tree`` is the state dict with every tensor replaced by ``{"__tensor__": index}``; it holds
only dicts with str keys, lists, str, int, float, bool and None. Decoded tensors live on the
CPU, so the checkpoint loads on any device with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

#: Version of the ``{"format", "world_size", "ranks"}`` entry written into checkpoints.
FORMAT = 1
_TENSOR = "__tensor__"
_HEADER_LEN = 8


def _flatten(value: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {_TENSOR: len(tensors) - 1}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or k == _TENSOR:
                raise TypeError(f"state key {k!r} at {path or 'top level'} must be a str other than {_TENSOR!r}")
            out[k] = _flatten(v, tensors, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"state value at {path or 'top level'} has type {type(value).__name__}; only tensors and plain types travel")


def encode(state: Mapping[str, Any], device: torch.device | str = "cpu") -> torch.Tensor:
    """One rank's state dict as a flat uint8 tensor on ``device`` (the layout in the module docstring)."""
    tensors: list[torch.Tensor] = []
    tree = _flatten(state, tensors, "")
    meta = [[str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()] for t in tensors]
    header = json.dumps({"tree": tree, "tensors": meta}, allow_nan=True).encode()
    parts = [
        torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8).to(device),
        torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device),
    ]
    parts += [t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors]
    return torch.cat(parts)


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"commpress rank state: unknown tensor dtype {name!r}")
    return dtype


def _unflatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            index = value[_TENSOR]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise ValueError(f"commpress rank state: tensor index {index!r} out of range")
            return tensors[index]
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def decode(buf: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`encode`: a state dict whose tensors are fresh CPU tensors.

    Raises ValueError when the declared lengths do not match the buffer.
    """
    buf = buf.detach().to("cpu", torch.uint8).reshape(-1)
    if buf.numel() < _HEADER_LEN:
        raise ValueError(f"commpress rank state: {buf.numel()} bytes, shorter than its length field")
    header_len = int(buf[:_HEADER_LEN].clone().view(torch.int64)[0])
    if not 0 <= header_len <= buf.numel() - _HEADER_LEN:
        raise ValueError(f"commpress rank state: header length {header_len} exceeds the {buf.numel()} bytes")
    header = json.loads(bytes(buf[_HEADER_LEN : _HEADER_LEN + header_len].tolist()).decode())
    if not isinstance(header, dict) or set(header) != {"tree", "tensors"} or not isinstance(header["tensors"], list):
        raise ValueError("commpress rank state: malformed header")
    tensors: list[torch.Tensor] = []
    offset = _HEADER_LEN + header_len
    for entry in header["tensors"]:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ValueError(f"commpress rank state: malformed tensor entry {entry!r}")
        name, shape, nbytes = entry
        dtype = _dtype(name)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"commpress rank state: bad tensor shape {shape!r}")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes != numel * itemsize or offset + nbytes > buf.numel():
            raise ValueError(f"commpress rank state: tensor of shape {shape} {name} does not fit the buffer")
        tensors.append(buf[offset : offset + nbytes].clone().view(dtype).reshape(shape))
        offset += nbytes
    if offset != buf.numel():
        raise ValueError(f"commpress rank state: {buf.numel() - offset} trailing bytes")
    tree = _unflatten(header["tree"], tensors)
    if not isinstance(tree, dict):
        raise ValueError("commpress rank state: the top level is not a dict")
    return tree


def comm_device(group: Any = None) -> torch.device:
    """Where the gather's buffers live: the current CUDA device for NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_states(state: Mapping[str, Any], group: Any = None) -> list[dict[str, Any]] | None:
    """Collect every rank's ``state`` on the group's rank 0; a collective, call it on every rank.

    Returns the list of all ranks' states (CPU tensors) on rank 0 and ``None`` elsewhere.
    Each peer sends its length and then its bytes; rank 0 receives them in rank order.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = comm_device(group)
    mine = encode(state, device)
    if rank != 0:
        dist.send(torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group, group_dst=0)
        dist.send(mine, group=group, group_dst=0)
        return None
    states = [decode(mine)]
    del mine
    for src in range(1, world):
        size = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(size, group=group, group_src=src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(buf, group=group, group_src=src)
        states.append(decode(buf))
        del buf
    return states


def checkpoint_entry(state: Mapping[str, Any], world_size: int, group: Any = None) -> dict[str, Any]:
    """The checkpoint entry ``{"format", "world_size", "ranks"}``; ``ranks`` is None off rank 0."""
    return {"format": FORMAT, "world_size": world_size, "ranks": gather_states(state, group)}


def own_state(entry: Mapping[str, Any], rank: int, world_size: int, device: torch.device | str) -> dict[str, Any]:
    """Rank ``rank``'s state from a :func:`checkpoint_entry`, its tensors moved to ``device``.

    Written at another world size, every rank gets rank 0's state: what is global (configuration,
    step, seed, counters, guard state, momentum rules) is the same in every rank's, and the state's
    own loader drops the per-rank residuals and velocities with one warning
    (:meth:`commpress.ddp.CompressionState.load_state_dict`). Raises ValueError naming what is
    wrong (format, world size, a missing rank).
    """
    if not isinstance(entry, Mapping) or entry.get("format") != FORMAT:
        got = entry.get("format") if isinstance(entry, Mapping) else type(entry).__name__
        raise ValueError(f"commpress checkpoint entry: format {got!r} is not supported (expected {FORMAT})")
    saved_world = entry.get("world_size")
    if not isinstance(saved_world, int) or isinstance(saved_world, bool) or saved_world < 1:
        raise ValueError(f"commpress checkpoint entry: world_size must be a positive int, got {saved_world!r}")
    ranks = entry.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != saved_world or not all(isinstance(r, Mapping) for r in ranks):
        raise ValueError(
            "commpress checkpoint entry does not hold every rank's state (only global rank 0's copy of "
            "a checkpoint does)"
        )
    return to_device(ranks[rank if saved_world == world_size else 0], torch.device(device))


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a state dict) with every tensor moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    return value
