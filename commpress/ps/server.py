"""A server: holds one shard, aggregates pushes, steps the optimizer, answers pulls.

:class:`ShardServer` is the whole server logic without MPI: feed it a received message with
:meth:`ShardServer.handle` and the current time, and it returns the messages to send. The MPI
loop (:func:`commpress.ps.mpi_loop.serve`) only moves bytes, so the logic is tested serially
(``tests/test_ps_server.py``). Replies and the drift guard live in :mod:`.replies`, the check of
pushed values in :mod:`.plausibility`, the counters in :mod:`.stats`.

**Modes.** ``sync``: pushes of step t are kept per worker and summed in worker order once all
arrived (bit-reproducible), averaged, one optimizer step, one broadcast reply. ``async``:
each push is applied on arrival as an optimizer step on ``grad / W`` and answered at once.
``ssp``: like async, but the reply that lets worker w start step ``c_w`` (its clock: pushes
applied) is held until ``c_w - min_live(c) <= K``; every release is logged with its lead.

**Liveness.** A worker the server is waiting for (sync: its push for the current step;
async/ssp: any message once its reply went out) that stays silent for ``timeout`` seconds
raises :class:`~commpress.ps.errors.WorkerTimeout` in sync mode, and is dropped in
async/ssp mode (it no longer holds back ssp, and gets ``STOP`` if it comes back).

**No single message stops the server.** Anything a peer sends that the run cannot accept
(bad bytes, a first PULL with another configuration fingerprint or from another step, a
BYE before joining or, in sync mode, before the last step) raises
:class:`~commpress.ps.errors.ProtocolError`: the message is rejected, named and counted, and
nothing changes. Only silence ends a sync run, and its :class:`WorkerTimeout` then quotes the
last message rejected from that worker, so a misconfigured worker is still reported as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..codecs import Codec
from .config import PSConfig
from .errors import ConfigError, ProtocolError, WorkerTimeout
from .plausibility import PushNormCheck
from .protocol import (
    BROADCAST,
    DENSE,
    FINGERPRINT_NBYTES,
    HEADER_NBYTES,
    JOIN_GRACE,
    PUSH_SEED,
    TO_SERVER,
    MsgType,
    build,
    decode_segments,
    parse_header,
    parse_segments,
    payload_nbytes,
    segment_seed,
    text_payload,
)
from .replies import Replies
from .sharding import Layout, Segment
from .stats import EventLog, Stats, gather_stats

logger = logging.getLogger("commpress")

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class ShardServer:
    """The state machine of the server of one shard (no MPI inside).

    Args:
        layout: the shared parameter layout.
        shard: which shard this server holds.
        config: the run's options.
        workers: number of workers; worker ``w`` is MPI rank ``first_worker + w``.
        initial: the shard's initial values (a flat tensor of ``layout.shards[shard].numel``).
        optimizer: builds the optimizer from the shard's pieces (one tensor per parameter piece).
        fingerprint: the configuration fingerprint every worker must present in its PULL.
        now: clock (``time.monotonic``), replaceable in tests.
        log: where event lines go (a callable taking a dict), or None.
        require_crc: reject pushes without a payload CRC (default); False only where workers
            hand MPI device buffers, which they cannot checksum.
    """

    def __init__(
        self,
        layout: Layout,
        shard: int,
        config: PSConfig,
        workers: int,
        initial: torch.Tensor,
        optimizer: OptimizerFactory,
        *,
        first_worker: int | None = None,
        fingerprint: int = 0,
        now: Callable[[], float] = time.monotonic,
        log: Callable[[dict[str, Any]], None] | None = None,
        require_crc: bool = True,
    ) -> None:
        if workers < 1:
            raise ConfigError("a parameter server needs at least one worker")
        self.layout, self.cfg, self.W = layout, config, workers
        self.shard = layout.shards[shard]
        self.index = shard
        self.first_worker = layout.servers if first_worker is None else first_worker
        self.fingerprint = fingerprint
        self.require_crc = require_crc  # False only where workers push MPI device buffers
        self.now = now
        self.log = log
        self.dtype = layout.dtype
        self.push_codec = config.push_codec()
        if initial.numel() != self.shard.numel:
            raise ConfigError(f"initial shard has {initial.numel()} elements, shard {shard} needs {self.shard.numel}")
        self.x = initial.detach().to("cpu", self.dtype).clone().reshape(-1)
        self.grad = torch.zeros_like(self.x)
        params = []
        for piece in self.shard.pieces:
            p = torch.nn.Parameter(self.x[self.shard.local(piece)].view(piece.shape))
            p.grad = self.grad[self.shard.local(piece)].view(piece.shape)
            params.append(p)
        self.params = params
        self.optimizer = optimizer(params)
        self.mode = config.mode
        self.step = 0                      # sync: the step being collected
        self.end = config.steps            # the run's last step (earlier when preempted: stop_at)
        self.clock = [0] * workers         # pushes applied per worker
        self.pending: dict[int, torch.Tensor | None] = {}
        self.held: set[int] = set()        # ssp: workers whose reply is held back
        self.joined: set[int] = set()
        self.done: set[int] = set()
        self.dropped: dict[int, float] = {}
        self.started = now()
        self.last_heard = [self.started] * workers
        self.last_loss: dict[int, float] = {}
        self.last_rejected: dict[int, str] = {}  # worker -> reason of its last rejected message
        self.stats = Stats()
        self.replies = Replies(self.shard, config, workers, self.stats)
        self.pull_codec = self.replies.codec
        self.replica = self.replies.replica  # key BROADCAST in sync mode
        if self.mode == "sync":
            self.replica[BROADCAST] = self.x.clone()
        self.replies_since_resync = self.replies.since_resync
        self.push_check = PushNormCheck(config.max_push_norm, workers, shard, self.stats, self._event)
        self._push_size = payload_nbytes(self.shard, self._push_codec_for, self.dtype)

    # ----- helpers -------------------------------------------------------------------------
    def _push_codec_for(self, seg: Segment) -> Codec:
        return self.push_codec if seg.compress else DENSE

    def rank_of(self, worker: int) -> int:
        """MPI rank of ``worker``."""
        return self.first_worker + worker

    def max_message(self) -> int:
        """Largest valid message a worker can send to this server (the receive limit)."""
        return HEADER_NBYTES + max(self._push_size, FINGERPRINT_NBYTES)

    def live(self) -> list[int]:
        """Workers still training (not dropped, not finished)."""
        return [w for w in range(self.W) if w not in self.dropped and w not in self.done]

    def min_clock(self) -> int:
        """Clock of the slowest live worker (``steps`` when none is left)."""
        live = self.live()
        return min(self.clock[w] for w in live) if live else self.end

    def finished(self) -> bool:
        """Every worker said goodbye or was dropped."""
        return all(w in self.done or w in self.dropped for w in range(self.W))

    def progress(self) -> int:
        """Steps completed by the slowest live worker (what rank 0's progress bar shows)."""
        return self.step if self.mode == "sync" else self.min_clock()

    def _event(self, **fields: Any) -> None:
        if self.log is not None:
            self.log({"t": round(self.now() - self.started, 6), "shard": self.index, **fields})

    # ----- message handling ----------------------------------------------------------------
    Out = list[tuple[int, torch.Tensor]]

    def handle(self, sender: int, buf: np.ndarray) -> Out:
        """Process one message from MPI rank ``sender``; return ``(dest rank, message)`` pairs.

        Raises :class:`ProtocolError` for a message to reject (nothing changed but the counters
        and :attr:`last_rejected`); no message ends the run (only :meth:`check` does, on silence).
        """
        self.stats.msgs_in += 1
        self.stats.bytes_in += len(buf)
        t0 = time.perf_counter()
        worker = sender - self.first_worker
        if not 0 <= worker < self.W:
            raise ProtocolError(f"rank {sender} is not a worker (workers are ranks {self.first_worker}.."
                                f"{self.first_worker + self.W - 1})", sender)
        head = parse_header(buf, sender, TO_SERVER, require_crc=self.require_crc)
        if head.worker != worker:
            raise ProtocolError(f"worker: header says worker {head.worker}, the sender is worker {worker}", sender)
        if head.shard != self.index:
            raise ProtocolError(f"shard: message for shard {head.shard} reached the server of shard {self.index}", sender)
        payload = buf[HEADER_NBYTES:]
        self.stats.seconds["validate"] += time.perf_counter() - t0
        if worker in self.dropped:
            if head.type == MsgType.BYE:
                self.done.add(worker)
                return []
            reason = f"worker {worker} (rank {sender}) was dropped after {self.cfg.timeout:g} s of silence"
            return [(sender, self._stop(worker, reason))]
        if worker in self.done:
            raise ProtocolError(f"{head.type.name} after the worker said goodbye", sender)
        try:
            if head.type == MsgType.PULL:
                return self._on_pull(worker, head.step, payload, sender)
            if head.type == MsgType.BYE:
                return self._on_bye(worker, head.step, sender)
            return self._on_push(worker, head.step, head.skip, head.value, payload, sender)
        except ProtocolError as exc:
            self.last_rejected[worker] = f"{head.type.name} at step {head.step}: {exc.reason}"
            raise

    def _on_pull(self, worker: int, step: int, payload: np.ndarray, sender: int) -> Out:
        if len(payload) != FINGERPRINT_NBYTES:
            raise ProtocolError(f"PULL payload must be the {FINGERPRINT_NBYTES}-byte fingerprint, got {len(payload)} bytes", sender)
        fp = int.from_bytes(payload.tobytes(), "little")
        first = worker not in self.joined
        current = self.step if self.mode == "sync" else self.clock[worker]
        if not first:  # a worker already in the run: a bad PULL is rejected, not fatal
            if fp != self.fingerprint:
                raise ProtocolError(f"PULL fingerprint {fp:#018x} differs from the one this worker joined with", sender)
            if step != current:
                raise ProtocolError(f"step: PULL at step {step}, the worker is at step {current}", sender)
        elif fp != self.fingerprint:  # not admitted; only its silence can end a sync run
            raise ProtocolError(
                f"fingerprint: worker rank {sender} runs a different model, shard layout or codec setup "
                f"(fingerprint {fp:#018x}, server {self.index} has {self.fingerprint:#018x}); not admitted", sender,
            )
        elif self.mode == "sync" and step != self.step:
            raise ProtocolError(
                f"step: worker rank {sender} starts at step {step} but server {self.index} is at step "
                f"{self.step} (checkpoints from different steps?); not admitted", sender,
            )
        self.last_heard[worker] = self.now()
        self.joined.add(worker)
        if self.mode == "sync":
            if step < self.end:  # start or resume: the workers' copy is the replica
                return [(sender, self.replies.params(worker, self.replica[BROADCAST], step, worker))]
            return [(sender, self.replies.params(worker, self.x, step, worker))]
        self.clock[worker] = step  # async/ssp: a (re)joining worker brings its own step
        self.replica[worker] = self.x.clone()
        self.replies_since_resync[worker] = 0
        return [(sender, self.replies.params(worker, self.x, step, worker))]

    def _on_bye(self, worker: int, step: int, sender: int) -> Out:
        if worker not in self.joined:
            raise ProtocolError("BYE before the worker's first PULL", sender)
        if self.mode == "sync" and step < self.end:
            raise ProtocolError(
                f"BYE at step {step} of {self.end}: sync mode cannot continue without this worker, so it is "
                "still waited for (the run stops if it stays silent)", sender,
            )
        self.done.add(worker)
        self.held.discard(worker)
        self.replica.pop(worker, None)
        self._event(event="bye", worker=worker, step=step)
        return self._release() if self.mode == "ssp" else []

    def _on_push(self, worker: int, step: int, skip: bool, value: float, payload: np.ndarray, sender: int) -> Out:
        if worker not in self.joined:
            raise ProtocolError("PUSH before the worker's first PULL", sender)
        expect = self.step if self.mode == "sync" else self.clock[worker]
        if self.mode == "sync" and worker in self.pending:
            raise ProtocolError(f"step: duplicate push for step {step}", sender)
        if step != expect:
            raise ProtocolError(f"step: push for step {step}, expected step {expect}", sender)
        if step >= self.end:
            raise ProtocolError(f"step: push for step {step}, the run has {self.end} steps", sender)
        t0 = time.perf_counter()
        grad: torch.Tensor | None = None
        if skip:
            if len(payload):
                raise ProtocolError("SKIP push with a payload", sender)
        else:
            seeds = [segment_seed(self.cfg.seed, PUSH_SEED, step, worker, self.index, i)
                     for i in range(len(self.shard.segments))]
            packets = parse_segments(payload, self.shard, self._push_codec_for, self.dtype, sender, seeds=seeds)
            t1 = time.perf_counter()
            self.stats.seconds["validate"] += t1 - t0
            grad = decode_segments(packets, self.shard, self._push_codec_for, torch.empty_like(self.x), sender)
            self.stats.seconds["decode"] += time.perf_counter() - t1
            reason = self.push_check.admit(worker, step, grad, sender) if self.push_check.enabled else None
            if reason is not None:  # dropped like a skip push: the step goes on without it
                self.last_rejected[worker] = reason
                grad = None
        # accepted: from here on the message counts
        self.last_heard[worker] = self.now()
        self.stats.push_msgs += 1
        self.stats.push_bytes += HEADER_NBYTES + len(payload)
        if skip:
            self.stats.skipped_pushes += 1
        if value:
            self.last_loss[worker] = value
        if self.mode == "sync":
            self.pending[worker] = grad
            if len(self.pending) < self.W:
                return []
            return self._sync_step()
        if grad is not None:
            t0 = time.perf_counter()
            self.grad.copy_(grad).div_(self.W)
            self.optimizer.step()
            self.stats.seconds["apply"] += time.perf_counter() - t0
        self.clock[worker] += 1
        if self.mode == "async":
            self._log_reply(worker)
            return [(sender, self.replies.answer(self.x, worker, step))]
        self.held.add(worker)
        return self._release()

    def _sync_step(self) -> Out:
        t0 = time.perf_counter()
        grads = [self.pending[w] for w in range(self.W)]
        valid = [g for g in grads if g is not None]
        if valid:
            total = valid[0].clone()
            for g in valid[1:]:
                total.add_(g)
            self.grad.copy_(total.div_(len(valid)))
            self.optimizer.step()
        self.stats.seconds["apply"] += time.perf_counter() - t0
        step = self.step
        self.pending.clear()
        self.step += 1
        self.clock = [self.step] * self.W
        now = self.now()
        self.last_heard = [now] * self.W  # the silence clock restarts when the reply goes out
        self._event(event="reply", worker=-1, step=step, ahead=0, min_clock=self.step)
        msg = self.replies.answer(self.x, BROADCAST, step)
        return [(self.rank_of(w), msg) for w in range(self.W)]

    def _log_reply(self, worker: int) -> None:
        lead = self.clock[worker] - self.min_clock()
        self.stats.max_ahead = max(self.stats.max_ahead, lead)
        self._event(event="reply", worker=worker, step=self.clock[worker] - 1, ahead=lead, min_clock=self.min_clock())

    def _release(self) -> Out:
        """ssp: send every held reply whose worker is now within the staleness bound."""
        out: ShardServer.Out = []
        floor = self.min_clock()
        for w in sorted(self.held):
            if self.clock[w] - floor <= self.cfg.staleness:
                self.held.discard(w)
                self.last_heard[w] = self.now()
                self._log_reply(w)
                out.append((self.rank_of(w), self.replies.answer(self.x, w, self.clock[w] - 1)))
        return out

    def _stop(self, worker: int, reason: str) -> torch.Tensor:
        return build(MsgType.STOP, shard=self.index, worker=worker, step=self.clock[worker], parts=[text_payload(reason)])

    # ----- liveness ------------------------------------------------------------------------
    def check(self) -> Out:
        """Apply the timeout rules (see the module docstring); return STOPs and released replies."""
        now = self.now()
        out: ShardServer.Out = []
        for w in self.live():
            owed = w in self.held or (self.mode == "sync" and w in self.pending)
            if owed:
                continue
            limit = self.cfg.timeout + (0.0 if w in self.joined else JOIN_GRACE)
            silent = now - self.last_heard[w]
            if silent <= limit:
                continue
            rank = self.rank_of(w)
            what = f"step {self.step}" if self.mode == "sync" else f"step {self.clock[w]}"
            if self.mode == "sync":
                rejected = self.last_rejected.get(w)
                raise WorkerTimeout(
                    f"worker rank {rank} (worker {w}) sent nothing for {silent:.1f} s (timeout "
                    f"{self.cfg.timeout:g} s) while server {self.index} waited for {what}; stopping "
                    "all ranks: sync mode cannot continue without it"
                    + (f" (its last rejected message: {rejected})" if rejected else ""), rank,
                )
            self.dropped[w] = now
            self.stats.dropped.append(rank)
            self.held.discard(w)
            self._event(event="drop", worker=w, step=self.clock[w], silent=round(silent, 3))
            logger.warning("[commpress.ps server %d] dropping worker rank %d (worker %d): silent for %.1f s at %s "
                           "(timeout %g s); continuing without it", self.index, rank, w, silent, what, self.cfg.timeout)
            out.append((rank, self._stop(w, f"dropped by server {self.index} after {silent:.1f} s of silence")))
            if self.mode == "ssp":
                out.extend(self._release())
        return out

    def abandoned(self, grace: float) -> list[int]:
        """Dropped workers that have not said goodbye ``grace`` seconds after being dropped."""
        now = self.now()
        return [self.rank_of(w) for w, t in self.dropped.items() if w not in self.done and now - t > grace]

    # ----- checkpoints ---------------------------------------------------------------------
    def checkpoint_due(self) -> int | None:
        """The step to save now, if a checkpoint boundary was just crossed (else None)."""
        if not self.cfg.checkpoint:
            return None
        every = self.cfg.checkpoint_every
        step = self.progress()
        last = getattr(self, "_last_saved", None)
        if step == last:
            return None
        if (every and step % every == 0 and step > 0) or step >= self.end:
            return step
        return None

    def state_dict(self) -> dict[str, Any]:
        """Shard values, replica, optimizer state and clocks (tensors and plain types)."""
        state: dict[str, Any] = {
            "role": "server",
            "shard": self.index,
            "fingerprint": self.fingerprint,
            "step": self.step,
            "clock": list(self.clock),
            "x": self.x.clone(),
            "optimizer": self.optimizer.state_dict(),
        }
        if self.mode == "sync":
            state["replica"] = self.replica[BROADCAST].clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked against this server's setup)."""
        if state.get("role") != "server" or state.get("shard") != self.index:
            raise ConfigError(f"checkpoint is not for server {self.index} (role {state.get('role')}, shard {state.get('shard')})")
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError("checkpoint fingerprint differs: another model, layout or codec setup")
        x = state["x"]
        if not isinstance(x, torch.Tensor) or x.shape != self.x.shape or x.dtype != self.dtype:
            raise ConfigError(f"checkpoint shard has shape {getattr(x, 'shape', None)}, expected {tuple(self.x.shape)}")
        self.x.copy_(x)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.clock = [int(c) for c in state["clock"]]
        if self.mode == "sync":
            self.replica[BROADCAST].copy_(state["replica"])
        self._last_saved = self.progress()

    def furthest_step(self) -> int:
        """The furthest step this server knows of (its own in sync mode, the workers' clocks)."""
        return max(self.step, *self.clock)

    def stop_at(self, step: int) -> None:
        """End the run after ``step`` (preemption: :mod:`.preempt`); checkpoints are due there."""
        self.end = min(self.end, step)

    def mark_saved(self, step: int) -> None:
        """Remember that ``step`` was saved."""
        self._last_saved = step


__all__ = ["EventLog", "OptimizerFactory", "ShardServer", "Stats", "gather_stats"]
