"""All-gather: every rank sends one frame of per-slot packets; all decode all frames.

Each rank encodes slot ``s`` with ``derive_seed(s.seed, PHASE_GATHER, rank)`` (independent
draws for stochastic codecs), all_gathers its fixed-size frame, then decodes the n frames in
rank order into one accumulator and averages. Every rank decodes the same bytes in the same
order, so the result is bit-identical everywhere. Suits sparse codecs (top-k), and quantizers
at 2 ranks, where it sends what the two-phase scheme sends while compressing once instead of
twice. Rank ``r`` sends one frame and receives ``(n-1)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codecs import Codec
from ..dtypes import accumulate_dtype
from ..feedback import ErrorFeedback
from ..rng import derive_seed
from .driver import (
    Algorithm,
    Encoded,
    Entry,
    Part,
    StepContext,
    all_gather_single,
    empty_plan,
    frame_layout,
)

#: Phase tag mixed into derived seeds (no two encodes of one step share a seed by accident).
PHASE_GATHER = 1


class AllGather(Algorithm):
    """All-gather of compressed frames; any fixed-size codec."""

    name = "allgather"

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """One frame all-gathered; every element decoded from ``n`` packets."""
        return {**empty_plan(), "allgather": frame_layout(entries, codec, dtype).nbytes, "decodes": float(n)}

    @staticmethod
    def encode(ctx: StepContext) -> Encoded:
        """Encode the rank's frame of every slot (seeded per rank), counted as the all-gather's bytes."""
        parts = [Part(i, 0, s.numel, s.key, derive_seed(s.seed, PHASE_GATHER, ctx.rank), s.shape)
                 for i, s in enumerate(ctx.slots)]
        enc = ctx.encode_frames([parts])
        nbytes = enc.layouts[0].nbytes
        ctx.count(collectives=1, bytes_sent=nbytes, bytes_wire=(ctx.n - 1) * nbytes,
                  encode_s=ctx.lap(), nonfinite_local=sum(enc.bad))
        return enc

    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """Encode every slot, all-gather the frames, decode-and-average in the future."""
        enc = self.encode(ctx)
        recv = torch.empty(ctx.n * enc.layouts[0].nbytes, dtype=torch.uint8, device=ctx.device)
        work = all_gather_single(recv, enc.send, group=ctx.group, async_op=True)

        def decode() -> list[bool]:
            # acc is the buffer itself when it accumulates in its own dtype (its input is encoded
            # by now): a fresh 64 MB accumulator cost ~25 ms of page faults per step, plus a copy
            wide = accumulate_dtype(ctx.flat.dtype)
            acc = ctx.flat if wide == ctx.flat.dtype else torch.empty(ctx.flat.numel(), dtype=wide, device=ctx.device)
            bad = ctx.decode_frames(recv, enc.layouts * ctx.n, lambda j, i: ctx.view(i, acc))
            acc.div_(ctx.n)
            if acc is not ctx.flat:
                ctx.flat.copy_(acc)
            return bad

        return ctx.finish(work, decode)
