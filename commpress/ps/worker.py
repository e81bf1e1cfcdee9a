"""A worker: computes gradients on its own batches, pushes them compressed, applies replies.

:class:`WorkerNode` holds the worker's state without MPI (its copy of the parameters, bound
to the model so the model always computes with it, and the error-feedback memory) and turns
gradients into push messages and replies into parameter changes. :func:`work` is the MPI
loop around it.

Per step t: ``g = grad(loss(model, batch(w, t)))``; for each shard, each segment is encoded
(compressed segments through error feedback, ``c = g + e``, ``e = c - decode(C(c))``; the
others dense) with the seed ``segment_seed(seed, PUSH_SEED, t, w, shard, segment)`` the server
checks; one message per shard goes out; then the worker waits for every server's reply
(``UPDATE``: add the decoded update; ``PARAMS``: copy; ``STOP``: leave) before step t + 1.

CUDA workers compute, compress and serialise on the GPU. Replies are always received and
decoded on the host (bit-identical to the server's replica), then copied to the device.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs import Codec
from ..codecs.base import all_finite
from ..feedback import ErrorFeedback
from . import faults as faults_mod
from .config import PSConfig
from .errors import ConfigError, ProtocolError, PSError, ServerTimeout
from .protocol import (
    BROADCAST,
    DENSE,
    FLAG_SKIP,
    HEADER_NBYTES,
    JOIN_GRACE,
    MAX_TEXT_NBYTES,
    PULL_SEED,
    PUSH_SEED,
    TO_WORKER,
    MsgType,
    build,
    decode_segments,
    parse_header,
    parse_segments,
    parse_text,
    payload_nbytes,
    segment_parts,
    segment_seed,
)
from .sharding import Layout, Segment

logger = logging.getLogger("commpress")


class WorkerNode:
    """State of worker ``worker`` (MPI rank ``layout.servers + worker``), without MPI.

    Args:
        layout: the shared layout; ``model`` must match it.
        worker: this worker's index.
        config: the run's options.
        model: the worker's model; its parameters become views of :attr:`flat`.
        fingerprint: presented to every server in the first PULL.
        checksum: put a CRC-32 of the payload into pushes (False for device buffers).
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
        self.skipped_steps = 0
        self.push_bytes = 0
        self.reply_bytes = 0

    def _push_codec_for(self, seg: Segment) -> Codec:
        return self.push_codec if seg.compress else DENSE

    def _pull_codec_for(self, seg: Segment) -> Codec:
        return self.pull_codec if seg.compress else DENSE

    def max_reply(self) -> int:
        """Largest valid message a server can send this worker (the receive limit)."""
        sizes = [MAX_TEXT_NBYTES]
        for shard in self.layout.shards:
            sizes.append(payload_nbytes(shard, lambda s: DENSE, self.layout.dtype))
            sizes.append(payload_nbytes(shard, self._pull_codec_for, self.layout.dtype))
        return HEADER_NBYTES + max(sizes)

    # ----- outgoing ------------------------------------------------------------------------
    def pull(self, step: int) -> list[tuple[int, torch.Tensor]]:
        """PULL messages (one per server) for ``step``."""
        fp = self.fingerprint.to_bytes(8, "little")
        return [(s, build(MsgType.PULL, shard=s, worker=self.worker, step=step, parts=[fp]))
                for s in range(self.layout.servers)]

    def bye(self, step: int) -> list[tuple[int, torch.Tensor]]:
        """BYE messages (one per server)."""
        return [(s, build(MsgType.BYE, shard=s, worker=self.worker, step=step)) for s in range(self.layout.servers)]

    def compute(self, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any) -> tuple[float, torch.Tensor]:
        """Loss and flat gradient of ``loss_fn(model, batch)`` at the worker's parameters."""
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.model, batch)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return float(loss.detach()), self.layout.flatten(grads)

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
        for shard in self.layout.shards:
            packets = []
            skip = not finite
            for i, seg in enumerate(shard.segments):
                if skip:
                    break
                x = grad[seg.start : seg.stop]
                seed = segment_seed(self.cfg.seed, PUSH_SEED, step, self.worker, shard.index, i)
                if seg.compress and self.ef is not None:
                    packet = self.ef.compress(f"{shard.index}.{i}", x, seed=seed)
                    if packet is None:  # g + e overflowed: this shard's push is skipped
                        skip = True
                        break
                else:
                    packet = self._push_codec_for(seg).encode(x, seed=seed)
                packets.append(packet)
            parts = [] if skip else segment_parts(packets)
            if self.checksum and self.device.type != "cpu":
                parts = [p.cpu() for p in parts]
            msg = build(
                MsgType.PUSH, shard=shard.index, worker=self.worker, step=step, parts=parts,
                value=loss if shard.index == 0 and math.isfinite(loss) else 0.0, flags=FLAG_SKIP if skip else 0,
                checksum=self.checksum,
            )
            self.push_bytes += msg.numel()
            out.append((shard.index, msg))
        return out

    # ----- incoming ------------------------------------------------------------------------
    def apply(self, server: int, buf: np.ndarray, step: int) -> str | None:
        """Apply server ``server``'s reply for ``step``; return the reason if it is a STOP.

        A reply that fails validation raises :class:`ProtocolError`: servers are trusted, so
        the worker stops rather than train on a copy it cannot vouch for.
        """
        self.reply_bytes += len(buf)
        head = parse_header(buf, server, TO_WORKER)
        if head.shard != server:
            raise ProtocolError(f"shard: reply for shard {head.shard} from the server of shard {server}", server)
        if head.worker not in (self.worker, BROADCAST):
            raise ProtocolError(f"worker: reply addressed to worker {head.worker}, this is worker {self.worker}", server)
        payload = buf[HEADER_NBYTES:]
        if head.type == MsgType.STOP:
            return parse_text(payload, server) or "stopped by the server"
        if head.step != step:
            raise ProtocolError(f"step: reply for step {head.step}, expected step {step}", server)
        shard = self.layout.shards[server]
        update = head.type == MsgType.UPDATE
        codec_for = self._pull_codec_for if update else (lambda s: DENSE)
        key = BROADCAST if self.cfg.mode == "sync" else self.worker
        seeds = [segment_seed(self.cfg.seed, PULL_SEED, step, key, server, i)
                 for i in range(len(shard.segments))] if update else None
        packets = parse_segments(payload, shard, codec_for, self.layout.dtype, server, seeds=seeds)
        scratch = decode_segments(packets, shard, codec_for, torch.zeros(shard.numel, dtype=self.layout.dtype), server)
        target = self.flat[shard.start : shard.stop]
        if update:
            target.add_(scratch.to(self.device))
        else:
            target.copy_(scratch)
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
        self.skipped_steps = int(state.get("skipped_steps", 0))


@dataclass
class WorkerOutcome:
    """How a worker's loop ended."""

    steps_done: int
    stopped: str | None = None   #: a server's STOP reason
    vanished: bool = False       #: left without goodbye (fault injection)
    seconds: float = 0.0


def work(
    comm: Any,
    node: WorkerNode,
    *,
    loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Callable[[int, int, int], Any],
    workers: int,
    start: int = 0,
    device_buffers: bool = False,
    faults: Sequence[faults_mod.Fault] = (),
    save: Callable[[int, dict[str, Any]], None] | None = None,
) -> WorkerOutcome:
    """Train ``node`` from step ``start`` to ``config.steps``; see the module docstring."""
    from .transport import Inbox, Outbox

    cfg = node.cfg
    inbox = Inbox(comm, node.max_reply())
    outbox = Outbox(comm, device_buffers)
    servers = list(range(node.layout.servers))
    t_begin = time.monotonic()

    def exchange(msgs: Sequence[tuple[int, torch.Tensor]], step: int, patience: float) -> str | None:
        for dest, msg in msgs:
            outbox.post(dest, msg)
        waiting = set(servers)
        stop: str | None = None
        deadline = time.monotonic() + patience
        while waiting:
            got = inbox.wait(sorted(waiting), deadline)
            if got is None:
                raise ServerTimeout(
                    f"worker {node.worker} (rank {comm.Get_rank()}) got no reply from server rank(s) "
                    f"{sorted(waiting)} for step {step} within {patience:g} s", min(waiting),
                )
            src, buf = got
            reason = node.apply(src, buf, step)
            waiting.discard(src)
            if reason is not None:
                stop = stop or f"server {src}: {reason}"
        outbox.poll()
        return stop

    def send_raw(dest: int, buf: np.ndarray) -> None:
        outbox.post(dest, buf)

    patience = 2 * cfg.timeout + 10.0
    stop = exchange(node.pull(start), start, cfg.timeout + JOIN_GRACE)
    step = start
    outcome = WorkerOutcome(steps_done=start)
    try:
        while stop is None and step < cfg.steps:
            if save is not None and cfg.checkpoint_every and step > start and step % cfg.checkpoint_every == 0:
                save(step, node.state_dict())
            value, grad = node.compute(loss, batch(node.worker, workers, step))
            pushes = node.push(step, grad, value)
            for fault in faults:
                if fault.applies(node.worker, step):
                    faults_mod.before_push(fault, step, pushes, send_raw)
            stop = exchange(pushes, step, patience)
            if stop is None:
                step += 1
        if stop is None:
            if save is not None and step > start:
                save(step, node.state_dict())
            stop_final = exchange(node.pull(step), step, patience)  # exact final parameters
            stop = stop_final
            outcome.stopped = stop
        else:
            outcome.stopped = stop
            logger.warning("[commpress.ps worker %d] stopping at step %d: %s", node.worker, step, stop)
    except faults_mod.Vanish:
        outcome.vanished = True
        outcome.steps_done = step
        outcome.seconds = time.monotonic() - t_begin
        return outcome
    for dest, msg in node.bye(step):
        outbox.post(dest, msg)
    outbox.flush(time.monotonic() + cfg.timeout)
    outbox.cancel()
    outcome.steps_done = step
    outcome.seconds = time.monotonic() - t_begin
    return outcome


__all__ = ["PSError", "WorkerNode", "WorkerOutcome", "work"]
