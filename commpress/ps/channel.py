"""One worker's side of its conversation with the server of one shard, without MPI.

A :class:`ShardChannel` knows what worker ``w`` sends to the server of shard ``s`` (``PULL``
with the configuration fingerprint, ``PUSH`` of the shard's segments, ``BYE``) and what it
expects back: a reply of that shard, addressed to ``w`` (or, in sync mode, to everyone), for
the step it is waiting for, whose segments carry the seeds
``segment_seed(seed, PULL_SEED, step, key, s, segment)`` and decode to finite values. Anything
else raises :class:`~commpress.ps.errors.ProtocolError`: servers are trusted, so the worker
stops rather than train on a copy it cannot vouch for. Replies are decoded on the host
(bit-identical to the server's replica); the worker adds or copies the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs import Codec
from ..feedback import ErrorFeedback
from .config import PSConfig
from .errors import ProtocolError
from .protocol import (
    BROADCAST,
    DENSE,
    FLAG_SKIP,
    HEADER_NBYTES,
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


@dataclass
class Reply:
    """A validated reply: ``stop`` (a STOP's reason) or the shard's decoded ``values``."""

    stop: str | None = None
    values: torch.Tensor | None = None  #: host tensor of the shard's size
    update: bool = False  #: add ``values`` (UPDATE) rather than copy them (PARAMS)


class ShardChannel:
    """Worker ``worker``'s channel to the server of shard ``shard`` (messages in, messages out).

    Args:
        layout: the shared layout.
        shard: the shard (and server rank) this channel talks to.
        worker: this worker's index.
        config: the run's options (codecs, seed, mode).
        fingerprint: presented in every PULL.
        checksum: put a CRC-32 of the payload into pushes (False for device buffers).
        device: where the worker's gradients live (pushes are moved to the host to checksum them).
    """

    def __init__(self, layout: Layout, shard: int, worker: int, config: PSConfig, *, fingerprint: int = 0,
                 checksum: bool = True, device: torch.device | None = None) -> None:
        self.layout, self.worker, self.cfg = layout, worker, config
        self.shard = layout.shards[shard]
        self.index = shard
        self.fingerprint = fingerprint
        self.checksum = checksum
        self.device = device or torch.device("cpu")
        self.dtype = layout.dtype
        self.push_codec = config.push_codec()
        self.pull_codec = config.reply_codec()
        self.key = BROADCAST if config.mode == "sync" else worker  #: the reply seeds' key

    def _push_codec_for(self, seg: Segment) -> Codec:
        return self.push_codec if seg.compress else DENSE

    def _pull_codec_for(self, seg: Segment) -> Codec:
        return self.pull_codec if seg.compress else DENSE

    def max_reply(self) -> int:
        """Largest valid payload this shard's server can send (dense, compressed or a STOP reason)."""
        return max(MAX_TEXT_NBYTES, payload_nbytes(self.shard, lambda s: DENSE, self.dtype),
                   payload_nbytes(self.shard, self._pull_codec_for, self.dtype))

    # ----- outgoing ------------------------------------------------------------------------
    def pull(self, step: int) -> torch.Tensor:
        """The PULL for ``step`` (start, resume, final parameters)."""
        fp = self.fingerprint.to_bytes(8, "little")
        return build(MsgType.PULL, shard=self.index, worker=self.worker, step=step, parts=[fp])

    def bye(self, step: int) -> torch.Tensor:
        """The BYE (done, or acknowledging a STOP)."""
        return build(MsgType.BYE, shard=self.index, worker=self.worker, step=step)

    def push(self, step: int, grad: torch.Tensor, loss: float, finite: bool, ef: ErrorFeedback | None) -> torch.Tensor:
        """The PUSH of this shard's segments of the flat ``grad`` for ``step``.

        Compressed segments go through ``ef`` (keys ``"<shard>.<segment>"``) when given. The push
        is flagged SKIP, without payload, when ``finite`` is False or ``g + e`` overflowed;
        ``loss`` travels to shard 0 only, as 0 when it is not finite.
        """
        packets = []
        skip = not finite
        for i, seg in enumerate(self.shard.segments):
            if skip:
                break
            x = grad[seg.start : seg.stop]
            seed = segment_seed(self.cfg.seed, PUSH_SEED, step, self.worker, self.index, i)
            if seg.compress and ef is not None:
                packet = ef.compress(f"{self.index}.{i}", x, seed=seed)
                if packet is None:  # g + e overflowed: this shard's push is skipped
                    skip = True
                    break
            else:
                packet = self._push_codec_for(seg).encode(x, seed=seed)
            packets.append(packet)
        parts = [] if skip else segment_parts(packets)
        if self.checksum and self.device.type != "cpu":
            parts = [p.cpu() for p in parts]
        return build(
            MsgType.PUSH, shard=self.index, worker=self.worker, step=step, parts=parts,
            value=loss if self.index == 0 and math.isfinite(loss) else 0.0, flags=FLAG_SKIP if skip else 0,
            checksum=self.checksum,
        )

    # ----- incoming ------------------------------------------------------------------------
    def accept(self, buf: np.ndarray, step: int) -> Reply:
        """Validate and decode this server's reply ``buf`` for ``step`` (see the module docstring)."""
        server = self.index
        head = parse_header(buf, server, TO_WORKER)
        if head.shard != server:
            raise ProtocolError(f"shard: reply for shard {head.shard} from the server of shard {server}", server)
        if head.worker not in (self.worker, BROADCAST):
            raise ProtocolError(f"worker: reply addressed to worker {head.worker}, this is worker {self.worker}", server)
        payload = buf[HEADER_NBYTES:]
        if head.type == MsgType.STOP:
            return Reply(stop=parse_text(payload, server) or "stopped by the server")
        if head.step != step:
            raise ProtocolError(f"step: reply for step {head.step}, expected step {step}", server)
        update = head.type == MsgType.UPDATE
        codec_for = self._pull_codec_for if update else (lambda s: DENSE)
        seeds = [segment_seed(self.cfg.seed, PULL_SEED, step, self.key, server, i)
                 for i in range(len(self.shard.segments))] if update else None
        packets = parse_segments(payload, self.shard, codec_for, self.dtype, server, seeds=seeds)
        values = decode_segments(packets, self.shard, codec_for, torch.zeros(self.shard.numel, dtype=self.dtype), server)
        return Reply(values=values, update=update)


__all__ = ["Reply", "ShardChannel"]
