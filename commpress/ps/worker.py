"""A worker: computes gradients on its own batches, pushes them compressed, applies replies.

:class:`WorkerNode` holds the worker's state without MPI (its copy of the parameters, bound
to the model so the model always computes with it, the error-feedback memory and one
:class:`~.channel.ShardChannel` per server) and turns gradients into push messages and replies
into parameter changes. :class:`WorkerRun` is the worker's step sequence as a state machine
(join, push and wait, final pull, goodbye); :func:`commpress.ps.mpi_loop.work` only moves its
bytes, so serial tests drive workers and servers together without MPI.

Per step t: ``g = grad(loss(model, batch(w, t)))`` (with ``local_steps`` H: ``g = x_t - x'``, where
``x'`` is where H steps of the task's optimizer from ``x_t`` on batches ``H*t .. H*t + H - 1`` end: DiLoCo's
pseudo-gradient, after which the copy returns to ``x_t`` to take the servers' reply); for each shard, each segment is encoded
(compressed segments through error feedback, ``c = g + e``, ``e = c - decode(C(c))``; the
others dense) with the seed ``segment_seed(seed, PUSH_SEED, t, w, shard, segment)`` the server
checks; one message per shard goes out; then the worker waits for every server's reply
(``UPDATE``: add the decoded update; ``PARAMS``: copy; ``STOP``: leave) before step t + 1.

CUDA workers compute, compress and serialise on the GPU. Replies are always received and
decoded on the host (bit-identical to the server's replica), then copied to the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs.base import all_finite
from ..feedback import ErrorFeedback
from . import faults as faults_mod
from .channel import ShardChannel
from .config import PSConfig
from .errors import ConfigError, ProtocolError, PSError
from .protocol import HEADER_NBYTES, JOIN_GRACE
from .sharding import Layout

logger = logging.getLogger("commpress")

Out = list[tuple[int, Any]]  #: ``(server rank, message)`` pairs to send (tensors; raw arrays from faults)


def round_steps(step: int, local_steps: int) -> range:
    """The batch indices of step ``step``'s local round (``local_steps`` H): ``H*step .. H*step + H - 1``."""
    return range(local_steps * step, local_steps * (step + 1))


class WorkerNode:
    """State of worker ``worker`` (MPI rank ``layout.servers + worker``), without MPI.

    Args:
        layout: the shared layout; ``model`` must match it.
        worker: this worker's index.
        config: the run's options.
        model: the worker's model; its parameters become views of :attr:`flat`.
        fingerprint: presented to every server in the first PULL.
        checksum: put a CRC-32 of the payload into pushes (False for device buffers).
        inner_optimizer: with ``config.local_steps``, builds the optimizer of the worker's inner
            steps over the model's parameters (the task's optimizer); kept for the whole run.
    """

    def __init__(
        self,
        layout: Layout,
        worker: int,
        config: PSConfig,
        model: torch.nn.Module,
        *,
        fingerprint: int = 0,
        checksum: bool = True,
        inner_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    ) -> None:
        self.layout, self.worker, self.cfg = layout, worker, config
        self.fingerprint = fingerprint
        self.checksum = checksum
        self.params = layout.check_model(model)
        self.device = self.params[0].device
        self.flat = torch.empty(layout.numel, dtype=layout.dtype, device=self.device)
        layout.bind(model, self.flat)
        self.model = model
        self.push_codec = config.push_codec()
        self.pull_codec = config.reply_codec()
        self.ef = ErrorFeedback(self.push_codec) if config.use_error_feedback() else None
        self.channels = [ShardChannel(layout, s, worker, config, fingerprint=fingerprint, checksum=checksum,
                                      device=self.device) for s in range(layout.servers)]
        self.skipped_steps = 0
        self.push_bytes = 0
        self.reply_bytes = 0
        self.inner: torch.optim.Optimizer | None = None
        if config.local_steps:
            if inner_optimizer is None:
                raise ConfigError("local_steps needs the workers' inner optimizer (the task's optimizer)")
            self.inner = inner_optimizer(self.params)

    def max_reply(self) -> int:
        """Largest valid message a server can send this worker (the receive limit)."""
        return HEADER_NBYTES + max(ch.max_reply() for ch in self.channels)

    # ----- outgoing ------------------------------------------------------------------------
    def pull(self, step: int) -> list[tuple[int, torch.Tensor]]:
        """PULL messages (one per server) for ``step``."""
        return [(ch.index, ch.pull(step)) for ch in self.channels]

    def bye(self, step: int) -> list[tuple[int, torch.Tensor]]:
        """BYE messages (one per server)."""
        return [(ch.index, ch.bye(step)) for ch in self.channels]

    def compute(self, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any) -> tuple[float, torch.Tensor]:
        """Loss and flat gradient of ``loss_fn(model, batch)`` at the worker's parameters."""
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.model, batch)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return float(loss.detach()), self.layout.flatten(grads)

    def local_round(self, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batches: Sequence[Any]) -> tuple[float, torch.Tensor]:
        """``local_steps``: the inner steps on ``batches``; their mean loss and the pseudo-gradient (flat).

        The pseudo-gradient is the parameters before the steps minus after them; the parameters
        then return to where they started (the servers' replica, which the reply moves on). A
        non-finite one (a NaN or Inf loss or gradient in the round) is pushed as a skip by
        :meth:`push`; the inner optimizer's state, which then holds the NaN, is cleared here so the
        next round starts clean (its momenta restart from zero).
        """
        assert self.inner is not None, "local_round needs local_steps"
        start = self.flat.detach().clone()
        total = 0.0
        for batch in batches:
            self.inner.zero_grad(set_to_none=True)
            loss = loss_fn(self.model, batch)
            loss.backward()
            self.inner.step()
            total += float(loss.detach())
        with torch.no_grad():
            delta = start - self.flat
            self.flat.copy_(start)
        if not all_finite(delta):
            self.inner.state.clear()
            logger.warning("[commpress.ps worker %d] non-finite local round: inner optimizer state cleared", self.worker)
        return total / max(len(batches), 1), delta

    def push(self, step: int, grad: torch.Tensor, loss: float = 0.0) -> list[tuple[int, torch.Tensor]]:
        """PUSH messages (one per server) carrying ``grad`` (flat) for ``step``.

        A non-finite gradient is not sent: every push is flagged SKIP and the error-feedback
        memory is left untouched (see :mod:`commpress.feedback`). A non-finite ``loss`` is
        reported as 0 (the header's ``value`` must be finite).
        """
        out = []
        finite = all_finite(grad)
        if not finite:
            self.skipped_steps += 1
            logger.warning("[commpress.ps worker %d] non-finite gradient at step %d: push skipped", self.worker, step)
        for ch in self.channels:
            msg = ch.push(step, grad, loss, finite, self.ef)
            self.push_bytes += msg.numel()
            out.append((ch.index, msg))
        return out

    # ----- incoming ------------------------------------------------------------------------
    def apply(self, server: int, buf: np.ndarray, step: int) -> str | None:
        """Apply server ``server``'s reply for ``step``; return the reason if it is a STOP.

        A reply that fails validation raises :class:`ProtocolError`: servers are trusted, so
        the worker stops rather than train on a copy it cannot vouch for.
        """
        self.reply_bytes += len(buf)
        if not 0 <= server < len(self.channels):
            raise ProtocolError(f"rank {server} is not a server (servers are ranks 0..{len(self.channels) - 1})", server)
        reply = self.channels[server].accept(buf, step)
        if reply.stop is not None:
            return reply.stop
        assert reply.values is not None
        shard = self.layout.shards[server]
        target = self.flat[shard.start : shard.stop]
        if reply.update:
            target.add_(reply.values.to(self.device))
        else:
            target.copy_(reply.values)
        return None

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals and counters (tensors and plain types)."""
        return {
            "role": "worker",
            "worker": self.worker,
            "fingerprint": self.fingerprint,
            "ef": None if self.ef is None else self.ef.state_dict(),
            "skipped_steps": self.skipped_steps,
            "inner": None if self.inner is None else self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked against this worker's setup)."""
        if state.get("role") != "worker" or state.get("worker") != self.worker:
            raise ConfigError(f"checkpoint is not for worker {self.worker}")
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError("checkpoint fingerprint differs: another model, layout or codec setup")
        if self.ef is not None:
            ef = state.get("ef")
            if not isinstance(ef, dict) or not isinstance(ef.get("residuals"), dict):
                raise ConfigError("checkpoint has no error-feedback state")
            # residuals live on the worker's device
            self.ef.load_state_dict({**ef, "residuals": {
                k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in ef["residuals"].items()}})
        if self.inner is not None:
            inner = state.get("inner")
            if not isinstance(inner, dict):
                raise ConfigError("checkpoint has no inner optimizer state (local_steps)")
            self.inner.load_state_dict(inner)
        self.skipped_steps = int(state.get("skipped_steps", 0))


@dataclass
class WorkerOutcome:
    """How a worker's loop ended."""

    steps_done: int
    stopped: str | None = None   #: a server's STOP reason
    vanished: bool = False       #: left without goodbye (fault injection)
    seconds: float = 0.0


class WorkerRun:
    """The step sequence of one worker as a state machine over its channels (no MPI inside).

    :meth:`begin` returns the first messages (the PULLs of step ``start``); then, while
    :attr:`waiting` names servers, feed each reply to :meth:`receive`; once it is empty,
    :meth:`advance` returns the next messages (checkpointing, computing and pushing the next
    step, or the final PULLs, or the BYEs) until :attr:`finished`. :attr:`patience` is how long
    the current exchange may wait for its replies (the caller raises the timeout).

    Args:
        node: the worker's state.
        loss, batch: the task's loss and batch functions.
        workers: ``W`` (the batch function's argument).
        start: the first step (a resumed run's checkpoint step).
        faults: injected faults (testing only): their messages go out before the honest pushes.
        save: ``save(step, state)`` writes a checkpoint of the worker.
        on_step: ``on_step(steps)`` once the replies of a training step were applied: the
            node's parameters are those of ``steps`` completed steps (it must not change them).
    """

    def __init__(
        self,
        node: WorkerNode,
        *,
        loss: Callable[[torch.nn.Module, Any], torch.Tensor],
        batch: Callable[[int, int, int], Any],
        workers: int,
        start: int = 0,
        faults: Sequence[faults_mod.Fault] = (),
        save: Callable[[int, dict[str, Any]], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.node, self.loss, self.batch, self.W = node, loss, batch, workers
        self.start, self.faults, self.save, self.on_step = start, faults, save, on_step
        self.step = start
        self.end = node.cfg.steps  #: the run's last step (earlier when preempted: :meth:`stop_at`)
        self.stop: str | None = None  #: the first STOP reason of the current exchange ("server s: ...")
        self.waiting: set[int] = set()  #: servers whose reply the current exchange still needs
        self.patience = 0.0
        self.finished = False
        self.outcome = WorkerOutcome(steps_done=start)
        self._phase = "join"  # join -> train -> final -> (bye) finished
        self._expect = start  # the step the awaited replies belong to

    def _exchange(self, msgs: Out, step: int, patience: float) -> Out:
        self.waiting = {dest for dest, _ in msgs}
        self._expect, self.patience = step, patience
        return msgs

    def begin(self) -> Out:
        """The PULLs that join (or rejoin) the run at ``start``."""
        cfg = self.node.cfg
        return self._exchange(self.node.pull(self.start), self.start, cfg.timeout + JOIN_GRACE)

    def receive(self, server: int, buf: np.ndarray) -> None:
        """Apply server ``server``'s reply to the current exchange (a bad reply raises ProtocolError)."""
        reason = self.node.apply(server, buf, self._expect)
        self.waiting.discard(server)
        if reason is not None:
            self.stop = self.stop or f"server {server}: {reason}"

    def advance(self) -> Out:
        """The next messages once every awaited reply arrived (see the class docstring)."""
        assert not self.waiting and not self.finished
        cfg, node = self.node.cfg, self.node
        patience = 2 * cfg.timeout + 10.0
        if self._phase == "final":
            self.outcome.stopped = self.stop
            return self._goodbye()
        if self._phase == "train" and self.stop is None:
            self.step += 1
            if self.on_step is not None:
                self.on_step(self.step)
        self._phase = "train"
        if self.stop is not None:
            self.outcome.stopped = self.stop
            logger.warning("[commpress.ps worker %d] stopping at step %d: %s", node.worker, self.step, self.stop)
            return self._goodbye()
        step = self.step
        if step < self.end:
            if self.save is not None and cfg.checkpoint_every and step > self.start and step % cfg.checkpoint_every == 0:
                self.save(step, node.state_dict())
            if cfg.local_steps:
                value, grad = node.local_round(self.loss, [self.batch(node.worker, self.W, i)
                                                           for i in round_steps(step, cfg.local_steps)])
            else:
                value, grad = node.compute(self.loss, self.batch(node.worker, self.W, step))
            pushes = node.push(step, grad, value)
            raw: Out = []
            try:
                for fault in self.faults:
                    if fault.applies(node.worker, step):
                        faults_mod.before_push(fault, step, pushes, lambda dest, buf: raw.append((dest, buf)))
            except faults_mod.Vanish:
                self.outcome.vanished = True
                self.outcome.steps_done = step
                self.finished = True
                return raw
            return raw + self._exchange(list(pushes), step, patience)
        if self.save is not None and step > self.start:
            self.save(step, node.state_dict())
        self._phase = "final"
        return self._exchange(node.pull(step), step, patience)  # exact final parameters

    def stop_at(self, step: int) -> None:
        """End the run after ``step`` (preemption, :mod:`.preempt`): checkpoint there, then goodbye."""
        if step < self.step + (self._phase == "train"):
            logger.error("[commpress.ps worker %d] asked to stop at step %d but already at step %d: its "
                         "checkpoint will not match the servers'", self.node.worker, step, self.step)
        self.end = min(self.end, max(step, self.step + (self._phase == "train")))

    def _goodbye(self) -> Out:
        self.finished = True
        self.outcome.steps_done = self.step
        return list(self.node.bye(self.step))


__all__ = ["PSError", "WorkerNode", "WorkerOutcome", "WorkerRun", "round_steps"]
