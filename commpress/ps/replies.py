"""A server's replies: dense parameters or the compressed update ``x - replica``, with the drift guard.

The server keeps a replica ``r`` of what each worker holds (one shared replica in sync mode,
key :data:`~.protocol.BROADCAST`; one per worker otherwise). A reply encodes ``v = x - r`` with
the pull codec (error feedback on the server: what the codec dropped stays in ``x - r`` and
goes out with the next reply), and both sides add ``decode(v)``, so worker and replica stay
bit-equal. The drift ``||x - r||`` then obeys ``d' <= sqrt(1 - delta) (d + ||step||)`` for a
codec with contraction ``delta``; whatever the codec, a reply that would leave
``d' > max_drift * ||x||`` is replaced by the dense parameters (``d' = 0``), so the bound holds
after every reply. No MPI here: :class:`Replies` returns messages.
"""

from __future__ import annotations

import math
import time

import torch

from ..codecs import Codec
from .config import PSConfig
from .protocol import BROADCAST, DENSE, PULL_SEED, MsgType, build, segment_parts, segment_seed
from .sharding import Segment, Shard
from .stats import Stats


class Replies:
    """Builds the replies of the server of ``shard`` and keeps the replicas they imply.

    Args:
        shard: the server's shard.
        config: the run's options (pull codec, ``resync_every``, ``max_drift``, seed).
        workers: ``W``; a broadcast reply counts ``W`` messages.
        stats: the server's counters (replies, bytes, resyncs, drift, seconds).
    """

    def __init__(self, shard: Shard, config: PSConfig, workers: int, stats: Stats) -> None:
        self.shard, self.cfg, self.W, self.stats = shard, config, workers, stats
        self.index = shard.index
        self.codec = config.reply_codec()
        self.replica: dict[int, torch.Tensor] = {}  # key BROADCAST in sync mode
        self.since_resync: dict[int, int] = {}

    def codec_for(self, seg: Segment) -> Codec:
        """The codec of ``seg`` in an UPDATE (dense segments stay dense)."""
        return self.codec if seg.compress else DENSE

    def count(self, msg: torch.Tensor, key: int, answer: bool) -> None:
        """Count a reply; ``answer``: it answers a push (a training step), not a PULL."""
        n = self.W if key == BROADCAST else 1
        self.stats.reply_msgs += n
        self.stats.reply_bytes += n * msg.numel()
        if answer:
            self.stats.step_reply_msgs += n
            self.stats.step_reply_bytes += n * msg.numel()

    def params(self, key: int, values: torch.Tensor, step: int, worker: int, *, answer: bool = False) -> torch.Tensor:
        """A PARAMS message carrying ``values`` (the shard, dense) to ``worker``."""
        packets = [DENSE.encode(values[self.shard.local(seg)]) for seg in self.shard.segments]
        msg = build(MsgType.PARAMS, shard=self.index, worker=worker, step=step, parts=segment_parts(packets))
        self.stats.params_replies += 1
        self.count(msg, key, answer)
        return msg

    def answer(self, x: torch.Tensor, key: int, step: int) -> torch.Tensor:
        """Answer a push: the compressed update ``x - replica[key]``, or dense parameters."""
        t0 = time.perf_counter()
        replica = self.replica[key]
        count = self.since_resync.get(key, 0) + 1
        resync = self.codec.name == "none" or (self.cfg.resync_every and count >= self.cfg.resync_every)
        msg = None
        if not resync:
            delta = x - replica
            packets = [
                self.codec_for(seg).encode(delta[self.shard.local(seg)],
                                           seed=segment_seed(self.cfg.seed, PULL_SEED, step, key, self.index, i))
                for i, seg in enumerate(self.shard.segments)
            ]
            decoded = torch.zeros_like(x)
            for seg, p in zip(self.shard.segments, packets):
                self.codec_for(seg).decode(p, decoded[self.shard.local(seg)])
            new = replica + decoded
            drift = float(torch.linalg.vector_norm(x - new)) / max(float(torch.linalg.vector_norm(x)), 1e-30)
            if drift <= self.cfg.max_drift and math.isfinite(drift):
                replica.copy_(new)
                self.stats.max_drift = max(self.stats.max_drift, drift)
                self.since_resync[key] = count
                msg = build(MsgType.UPDATE, shard=self.index, worker=key, step=step, parts=segment_parts(packets))
                self.count(msg, key, True)
            elif self.codec.name != "none":
                self.stats.resyncs += 1
        if msg is None:
            replica.copy_(x)
            self.since_resync[key] = 0
            msg = self.params(key, x, step, key, answer=True)
        self.stats.seconds["reply"] += time.perf_counter() - t0
        return msg
