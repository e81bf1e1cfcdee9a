"""All-gather: every rank sends one frame of per-slot packets; all decode all frames.

Each rank encodes slot ``s`` with ``derive_seed(s.seed, PHASE_GATHER, rank)`` (independent
draws for stochastic codecs), all_gathers its fixed-size frame (:class:`FrameLayout`), then
decodes the n frames in rank order into one accumulator and averages. Every rank decodes the
same bytes in the same order, so the result is bit-identical everywhere. Suits sparse codecs
(top-k), and quantizers at 2 ranks, where it sends what the two-phase scheme sends while
compressing once instead of twice. Rank ``r`` receives ``(n-1)`` frames.
"""

from __future__ import annotations

import torch

from ..dtypes import accumulate_dtype
from ..feedback import ErrorFeedback
from ..rng import derive_seed
from ..wire.frame import FrameLayout
from .driver import Algorithm, StepContext, all_gather_single, decode_add

#: Phase tag mixed into derived seeds (no two encodes of one step share a seed by accident).
PHASE_GATHER = 1


class AllGather(Algorithm):
    """All-gather of compressed frames; any fixed-size codec."""

    name = "allgather"

    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """Encode every slot, all-gather the frames, decode-and-average in the future."""
        layout = FrameLayout([(s.key, s.codec, s.numel) for s in ctx.slots], ctx.flat.dtype)
        packets = [
            ctx.compress(i, s.feedback, s.codec, s.key, ctx.view(i).view(s.shape),
                         derive_seed(s.seed, PHASE_GATHER, ctx.rank))
            for i, s in enumerate(ctx.slots)
        ]
        send = layout.pack(packets, device=ctx.device)
        recv = torch.empty(ctx.n * layout.nbytes, dtype=torch.uint8, device=ctx.device)
        ctx.count(collectives=1, bytes_sent=layout.nbytes, bytes_wire=(ctx.n - 1) * layout.nbytes,
                  encode_s=ctx.lap(), nonfinite_local=sum(p is None for p in packets))
        work = all_gather_single(recv, send, group=ctx.group, async_op=True)

        def decode() -> list[bool]:
            # rank 0's decode overwrites acc; a slot whose rank-0 packet is missing is flagged.
            # acc is the buffer itself when it accumulates in its own dtype (its input is encoded
            # by now): a fresh 64 MB accumulator cost ~25 ms of page faults per step, plus a copy
            wide = accumulate_dtype(ctx.flat.dtype)
            acc = ctx.flat if wide == ctx.flat.dtype else torch.empty(ctx.flat.numel(), dtype=wide, device=ctx.device)
            bad = [False] * len(ctx.slots)
            for j in range(ctx.n):
                frame = layout.unpack(recv[j * layout.nbytes : (j + 1) * layout.nbytes], source=j)
                for i, (s, p) in enumerate(zip(ctx.slots, frame)):
                    if p is None:
                        bad[i] = True
                    elif s.numel:
                        decode_add(s.codec, p, ctx.view(i, acc), first=j == 0)
            acc.div_(ctx.n)
            if acc is not ctx.flat:
                ctx.flat.copy_(acc)
            return bad

        return ctx.finish(work, decode)
