"""Two-phase compressed all-reduce (DeepSpeed's 1-bit scheme, for any fixed-size codec).

Rank ``r`` of ``n``:

1. cut every slot in n pieces (:func:`piece_bounds`, aligned to the codec's scale blocks) and
   encode piece j of every slot through worker error feedback under ``piece_key(key, j)``;
2. all_to_all: rank r receives piece r of every slot from every rank (phase 1, waited for here,
   so phase 2 is issued from this thread, in order);
3. decode the n copies, sum in rank order, average; re-encode with the server-side error
   feedback (keys ``piece_key(key, r)``; dense slots re-encode exactly);
4. all_gather the re-encoded pieces (frames padded to the largest piece frame);
5. every rank decodes every piece into the buffer (the future: decode only).

About ``2(n-1)/n * d * bits/8`` bytes per rank. A slot flagged non-finite by any rank in step 1
is flagged by every server in step 3, so all ranks write NaN for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs import Codec
from ..dtypes import accumulate_dtype
from ..errors import CodecError
from ..feedback import ErrorFeedback
from ..rng import derive_seed
from ..wire.packet import Packet
from .driver import (
    Algorithm,
    Entry,
    Part,
    Piece,
    StepContext,
    all_gather_single,
    empty_plan,
    frame_layout,
)

#: Phase tags mixed into derived seeds.
PHASE_SCATTER = 2
PHASE_SERVER = 3


def piece_key(key: str, piece: int) -> str:
    """Error-feedback key of piece ``piece`` of ``key``."""
    return f"{key}#{piece}"


def piece_bounds(numel: int, n: int, align: int = 1) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into ``n`` contiguous pieces on multiples of ``align``."""
    if n < 1 or align < 1:
        raise ValueError(f"piece_bounds: need n >= 1 and align >= 1, got n={n}, align={align}")
    blocks = -(-numel // align)
    edges = [min(numel, (j * blocks // n) * align) for j in range(n + 1)]
    edges[-1] = numel
    return [(edges[j], edges[j + 1]) for j in range(n)]


class TwoPhase(Algorithm):
    """Compressed all-reduce in two phases with worker and server error feedback."""

    name = "twophase"
    server_feedback = True

    def residual_layout(self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int) -> list[Piece]:
        """One residual per piece: ``name#j`` for j < world_size."""
        return [Piece(piece_key(name, j), lo, hi, (hi - lo,))
                for j, (lo, hi) in enumerate(piece_bounds(math.prod(shape), world_size, codec.block_alignment()))]

    def server_layout(
        self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int, rank: int
    ) -> list[Piece]:
        """The piece this rank averages and re-encodes."""
        return [self.residual_layout(name, shape, codec, world_size)[rank]]

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """All pieces all_to_all'd, the largest piece frame all-gathered; two decodes per element."""
        bounds = [piece_bounds(e.numel, n, codec.block_alignment()) for e in entries]
        layouts = [frame_layout([Entry(b[j][1] - b[j][0], e.compressed) for e, b in zip(entries, bounds)], codec, dtype)
                   for j in range(n)]
        return {**empty_plan(), "alltoall": sum(lay.nbytes for lay in layouts),
                "allgather": max(lay.nbytes for lay in layouts), "decodes": 2.0}

    def launch(self, ctx: StepContext, server_feedback: ErrorFeedback | None) -> torch.futures.Future[torch.Tensor]:
        """Phase 1 (waited for), server re-encode, phase 2; the future decodes."""
        n, r, slots = ctx.n, ctx.rank, ctx.slots
        t0 = time.perf_counter()
        bounds = [piece_bounds(s.numel, n, s.codec.block_alignment()) for s in slots]
        # Step 1: encode every piece; a slot that fails anywhere is flagged in every frame.
        enc = ctx.encode_frames([
            [Part(i, *b[j], piece_key(s.key, j), derive_seed(s.seed, PHASE_SCATTER, j, r))
             for i, (s, b) in enumerate(zip(slots, bounds))]
            for j in range(n)
        ], precheck=True)
        layouts, mine = enc.layouts, enc.layouts[r]
        recv = torch.empty(n * mine.nbytes, dtype=torch.uint8, device=ctx.device)
        t1 = time.perf_counter()
        # Step 2: phase 1, waited for on this thread.
        work = dist.all_to_all_single(recv, enc.send, output_split_sizes=[mine.nbytes] * n,
                                      input_split_sizes=enc.sizes, group=ctx.group, async_op=True)
        assert work is not None
        ctx.wait(work)  # raises at once when another rank failed
        t2 = time.perf_counter()
        # Step 3: decode, average and re-encode this rank's pieces.
        sizes = [b[r][1] - b[r][0] for b in bounds]
        acc_offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        acc = torch.empty(sum(sizes), dtype=accumulate_dtype(ctx.flat.dtype), device=ctx.device)
        try:
            bad = ctx.decode_frames(recv, [mine] * n, lambda j, i: acc[acc_offsets[i] : acc_offsets[i] + sizes[i]])
        except Exception as exc:  # the others are about to wait for phase 2: tell them
            raise ctx.failed(exc) from exc
        acc.div_(n)
        t3 = time.perf_counter()
        avg = acc.to(ctx.flat.dtype)
        server: list[Packet | None] = []
        for i, s in enumerate(slots):
            if bad[i]:  # flagged by some rank: every rank sees it here, and voids its own update
                ctx.void(i)
                server.append(None)
                continue
            piece = avg[acc_offsets[i] : acc_offsets[i] + sizes[i]]
            fb = None if s.dense else server_feedback
            server.append(ctx.compress(i, fb, s.codec, piece_key(s.key, r), piece, derive_seed(s.seed, PHASE_SERVER, r)))
        width = max(lay.nbytes for lay in layouts)
        send2 = torch.empty(width, dtype=torch.uint8, device=ctx.device)
        mine.pack(server, out=send2[: mine.nbytes])  # zeroes its part first
        send2[mine.nbytes :].zero_()
        recv2 = torch.empty(n * width, dtype=torch.uint8, device=ctx.device)
        t4 = time.perf_counter()
        to_others = sum(size for j, size in enumerate(enc.sizes) if j != r)
        ctx.count(collectives=2, bytes_sent=enc.send.numel() + width, bytes_wire=to_others + (n - 1) * width,
                  encode_s=(t1 - t0) + (t4 - t3), decode_s=t3 - t2, wait_s=t2 - t1, nonfinite_local=sum(enc.bad))
        # Step 4: phase 2, issued from this thread right after phase 1.
        work2 = all_gather_single(recv2, send2, group=ctx.group, async_op=True)

        def into(j: int, i: int) -> torch.Tensor:
            lo, hi = bounds[i][j]
            return ctx.view(i)[lo:hi]

        return ctx.finish(work2, lambda: ctx.decode_frames(recv2, layouts, into, width=width, accumulate=False))

    def check(self, codec: Codec) -> None:
        """Any fixed-size codec."""
        if not codec.fixed_size:
            raise CodecError(f"algorithm 'twophase' needs fixed-size packets; {codec!r} is variable-size")
