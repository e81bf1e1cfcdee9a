"""PyTorch Lightning: :class:`CompressionCallback` registers commpress on the strategy's DDP model.

Why a callback and not ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)``: a
:class:`~commpress.ddp.CompressionState` needs a live process group (Lightning creates it
later), Lightning registers comm hooks on CUDA devices only (on CPU the hook would be silently
ignored), and its checkpoints would not carry the per-rank residuals. The callback:

1. ``on_fit_start`` (the DDP wrapper and the optimizers exist, no backward has run): calls
   :func:`commpress.ddp.register` on ``trainer.strategy.model`` with the trainer's optimizer, so
   SGD momentum moves into the hook (on CPU and GPU alike);
2. ``state_dict`` (every rank, when Lightning writes a checkpoint): gathers every rank's
   compression state to global rank 0, which writes the checkpoint (no pickle on the wire,
   see :mod:`commpress.integrations.ranks`);
3. ``load_state_dict`` (every rank, on ``fit(ckpt_path=...)``): keeps the entry, and each rank
   loads its own state right after registering, before Lightning restores the optimizer. A
   resumed run then continues exactly where the checkpointed one was;
4. ``on_train_batch_end`` (``log_stats=True``, the default): global rank 0 logs the state's
   ``stats()``, flattened to ``commpress/compression_ratio``, ``commpress/bytes_sent``, ...
   (:func:`commpress.statslog.flatten_stats`), through ``pl_module.log_dict`` on the steps
   Lightning's logger writes (``Trainer(log_every_n_steps=...)``); per-rank figures, so no
   ``sync_dist``.

Example::

    import lightning.pytorch as pl
    from commpress.integrations.lightning import CompressionCallback

    trainer = pl.Trainer(strategy="ddp", callbacks=[CompressionCallback("topk", ratio=0.01)])
    trainer.fit(model, ckpt_path="last.ckpt")   # weights_only loading works

Imports ``lightning`` (the ``lightning.pytorch`` namespace); ``import commpress`` never does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

import commpress.ddp

from ..codecs import Codec
from ..statslog import PREFIX, flatten_stats
from . import ranks

logger = logging.getLogger("commpress")


class CompressionCallback(Callback):
    """Compress DDP gradients with commpress in a Lightning ``Trainer(strategy="ddp")``.

    Args:
        codec: a codec name (``"topk"``, ``"sign"``, ...) or a :class:`commpress.codecs.Codec`.
        optimizer_index: which of ``trainer.optimizers`` goes to ``register(optimizer=...)``
            (its SGD momentum moves into the hook, Adam gets 1-bit Adam's recipe); ``None``
            registers without one. An index past the configured optimizers is an error.
        log_stats: log rank 0's flattened ``state.stats()`` with ``pl_module.log_dict`` in
            ``on_train_batch_end``, on the steps the Trainer's loggers write
            (``log_every_n_steps``); ``False``: not at all.
        log_prefix: the metrics are named ``<log_prefix>/<key>`` (``commpress/compression_ratio``).
        **options: the options of :class:`commpress.ddp.CompressionState` and the codec's
            parameters (``ratio=0.01``), as for :func:`commpress.ddp.register`.

    After ``on_fit_start``, :attr:`state` is this rank's
    :class:`~commpress.ddp.CompressionState` (``callback.state.stats()``).
    """

    def __init__(
        self,
        codec: str | Codec,
        *,
        optimizer_index: int | None = 0,
        log_stats: bool = True,
        log_prefix: str = PREFIX,
        **options: Any,
    ) -> None:
        super().__init__()
        if "optimizer" in options:
            raise TypeError("CompressionCallback takes optimizer_index=, not optimizer= (Lightning creates it)")
        if optimizer_index is not None and (not isinstance(optimizer_index, int) or optimizer_index < 0):
            raise TypeError(f"optimizer_index must be an int >= 0 or None, got {optimizer_index!r}")
        if not isinstance(log_stats, bool):
            raise TypeError(f"log_stats must be a bool, got {log_stats!r}")
        if not isinstance(log_prefix, str):
            raise TypeError(f"log_prefix must be a str, got {log_prefix!r}")
        self.codec = codec
        self.optimizer_index = optimizer_index
        self.options = options
        self.log_stats = log_stats
        self.log_prefix = log_prefix
        self.state: commpress.ddp.CompressionState | None = None
        self._pending: dict[str, Any] | None = None
        self._device: torch.device | None = None

    # ----- registration ------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Fail before any work when the strategy is not DDP or passes its own comm hook."""
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy):
            raise TypeError(
                f"CompressionCallback needs Lightning's DDPStrategy (strategy='ddp', 'ddp_spawn', ...), "
                f"got {type(strategy).__name__}"
            )
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                "DDPStrategy(ddp_comm_hook=...) and CompressionCallback both register a comm hook: "
                "pass only the callback"
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Register on the DDP wrapper, then load this rank's checkpointed state if any."""
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"CompressionCallback: the strategy's model is a {type(model).__name__}, not a "
                "DistributedDataParallel (use Lightning's DDPStrategy)"
            )
        optimizer = self._optimizer(trainer)
        carried = self.state.state_dict() if self.state is not None else None  # a second fit()
        self.state = commpress.ddp.register(model, self.codec, optimizer=optimizer, **self.options)
        group = self.state.process_group
        if group is not None and dist.get_global_rank(group, 0) != 0:
            raise ValueError(
                "CompressionCallback gathers every rank's state on the process group's rank 0, which must "
                "be global rank 0 (the rank that writes Lightning's checkpoints)"
            )
        device = self._device = trainer.strategy.root_device
        if self._pending is not None:
            own = ranks.own_state(self._pending, self.state.rank, self.state.world_size, device)
            self.state.load_state_dict(own)
            self._pending = None
        elif carried is not None:
            self.state.load_state_dict(ranks.to_device(carried, device))
        elif trainer.ckpt_path is not None:
            logger.warning(
                "commpress: resuming from %s, which holds no CompressionCallback state; residuals "
                "and the step count start from zero", trainer.ckpt_path,
            )

    def _optimizer(self, trainer: Trainer) -> torch.optim.Optimizer | None:
        if self.optimizer_index is None:
            return None
        optimizers = list(trainer.optimizers)
        if self.optimizer_index >= len(optimizers):
            if not optimizers and self.optimizer_index == 0:
                return None  # configure_optimizers returned nothing
            raise ValueError(
                f"optimizer_index={self.optimizer_index} but configure_optimizers gave {len(optimizers)} optimizer(s)"
            )
        optimizer = optimizers[self.optimizer_index]
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"trainer.optimizers[{self.optimizer_index}] is a {type(optimizer).__name__}, not a torch optimizer")
        return optimizer

    # ----- logging ----------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the flattened ``state.stats()`` on global rank 0 when Lightning's loggers write this step."""
        if not self.log_stats or self.state is None or not trainer.is_global_zero:
            return
        # Lightning's own test of log_every_n_steps (private; without it: every step, Lightning keeps the last)
        connector = getattr(trainer, "_logger_connector", None)
        due = getattr(connector, "should_update_logs", True) or getattr(trainer, "fast_dev_run", False)
        if not due:
            return
        metrics = flatten_stats(self.state.stats(), self.log_prefix)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True,
                           batch_size=1)

    # ----- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's compression state, gathered on global rank 0 (which writes the checkpoint).

        A collective: Lightning calls it on every rank when it saves (call
        ``trainer.save_checkpoint`` on every rank, as Lightning requires). Empty before ``fit``.
        """
        if self.state is None:
            return {}
        return ranks.checkpoint_entry(self.state.state_dict(), self.state.world_size, self.state.process_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the checkpoint's entry; each rank loads its own state when it registers.

        Lightning calls this before ``on_fit_start`` (before the DDP wrapper exists); when the
        hook is already registered the state is loaded at once.
        """
        if state_dict.get("format") != ranks.FORMAT:
            raise ValueError(
                f"CompressionCallback checkpoint entry has format {state_dict.get('format')!r}, expected {ranks.FORMAT}"
            )
        if self.state is None or self._device is None:
            self._pending = dict(state_dict)
            return
        self.state.load_state_dict(ranks.own_state(state_dict, self.state.rank, self.state.world_size, self._device))
