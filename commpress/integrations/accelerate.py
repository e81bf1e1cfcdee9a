"""Hugging Face Accelerate: :func:`register` commpress after ``accelerator.prepare``.

The recipe without this helper is three lines, but each hides a trap this function handles:

* the model to register on is the ``DistributedDataParallel`` that ``prepare`` returns (only in
  a multi-process run; a single process gets the bare module and nothing to compress);
* ``prepare`` wraps the optimizer in an ``AcceleratedOptimizer``; hooks that
  :func:`commpress.ddp.register` installs on it would never fire (``step`` and
  ``load_state_dict`` run on the inner optimizer), so the inner one is registered;
* ``accelerator.register_for_checkpointing`` writes custom objects from the main process only
  and loads them with ``weights_only=False``, which would lose every other rank's residuals.
  Instead, save/load pre-hooks make ``accelerator.save_state(dir)`` write one
  ``<name>_rank<r>.pt`` per rank (like Accelerate's own per-process RNG files) and
  ``accelerator.load_state(dir)`` read it back with ``torch.load(..., weights_only=True)``,
  before Accelerate restores the optimizer. Saved by another number of processes, each rank
  loads its own file or, a rank the saving run did not have, rank 0's (:func:`read_state`): what
  is global loads and the per-rank residuals and velocities start empty, with one warning.

Example::

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = commpress.integrations.accelerate.register(accelerator, model, "topk", optimizer=opt, ratio=0.01)
    ...
    accelerator.save_state("ckpt")      # + ckpt/commpress_rank<r>.pt on every rank
    accelerator.load_state("ckpt")      # each rank restores its own residuals

Imports ``accelerate``; ``import commpress`` never does.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch.nn.parallel import DistributedDataParallel

import commpress.ddp

from ..codecs import Codec
from ..optim import DISCOVER

#: Names registered per accelerator, so that two states never share a file.
_NAMES: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def state_path(directory: str | Path, name: str, rank: int) -> Path:
    """The file ``accelerator.save_state(directory)`` writes for rank ``rank``'s state."""
    return Path(directory) / f"{name}_rank{rank}.pt"


def read_state(directory: str | Path, name: str, rank: int, world_size: int, device: torch.device | str) -> Any:
    """The saved state rank ``rank`` loads from a ``save_state`` directory (``weights_only=True``).

    Its own file; a rank the saving run did not have (it had fewer processes) reads rank 0's,
    whose per-rank residuals and velocities the state's loader then drops with one warning,
    keeping what is global (:meth:`commpress.ddp.CompressionState.load_state_dict`). A file
    missing at the same world size is an error.
    """
    path = state_path(directory, name, rank)
    if path.is_file():
        return torch.load(path, map_location=device, weights_only=True)
    first = state_path(directory, name, 0)
    if rank > 0 and first.is_file():
        saved = torch.load(first, map_location=device, weights_only=True)
        if isinstance(saved, dict) and isinstance(saved.get("world_size"), int) and saved["world_size"] <= rank:
            return saved
    found = sorted(p.name for p in Path(directory).glob(f"{name}_rank*.pt"))
    raise FileNotFoundError(
        f"no commpress state for rank {rank} of {world_size} in {directory} (found {found}): the checkpoint was "
        f"saved without commpress.integrations.accelerate.register, or a rank's file is missing"
    )


def register(
    accelerator: Accelerator,
    model: Any,
    codec: str | Codec,
    *,
    optimizer: torch.optim.Optimizer | str | None = DISCOVER,
    checkpoint_name: str = "commpress",
    **options: Any,
) -> commpress.ddp.CompressionState:
    """Register commpress on a prepared DDP model and checkpoint its state with the accelerator.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the model ``accelerator.prepare`` returned (a ``DistributedDataParallel``).
        codec: a codec name or a :class:`commpress.codecs.Codec`.
        optimizer: the optimizer ``prepare`` returned (or the plain one); its SGD momentum moves
            into the hook, Adam gets 1-bit Adam's recipe (see :func:`commpress.ddp.register`).
            ``"auto"`` (default): the optimizer stepping the model is found at its first step
            (the inner one: Accelerate's wrapper steps it); ``None``: run it unchanged.
        checkpoint_name: file prefix in ``save_state`` directories; distinct per registered model.
        **options: :class:`commpress.ddp.CompressionState` options and codec parameters.

    Returns this rank's :class:`~commpress.ddp.CompressionState`. Call it on every rank, after
    ``prepare`` and before the first backward pass (and before ``load_state`` when resuming).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register needs the DistributedDataParallel model that accelerator.prepare returns in a "
            f"multi-process DDP run (accelerate launch / torchrun, 2+ processes); got {type(model).__name__} "
            f"with {accelerator.num_processes} process(es) and distributed type {accelerator.distributed_type}"
        )
    if not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name:
        raise ValueError(f"checkpoint_name must be a non-empty file-name prefix, got {checkpoint_name!r}")
    names = _NAMES.setdefault(accelerator, set())
    if checkpoint_name in names:
        raise ValueError(f"checkpoint_name {checkpoint_name!r} is already registered on this accelerator; pass another")
    if isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer  # its hooks fire; the wrapper's would not
    state = commpress.ddp.register(model, codec, optimizer=optimizer, **options)
    names.add(checkpoint_name)

    def save(models: list[Any], weights: list[Any], output_dir: str) -> None:
        torch.save(state.state_dict(), state_path(output_dir, checkpoint_name, state.rank))

    def load(models: list[Any], input_dir: str) -> None:
        device = next(model.parameters()).device
        state.load_state_dict(read_state(input_dir, checkpoint_name, state.rank, state.world_size, device))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state
